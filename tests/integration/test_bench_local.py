"""kvstore-bench local measures what a workload pays: no namespace re-declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.client import Client
from kvstore.process import DaemonProcess
from kvstore_bench import local

MiB = 1 << 20


def test_transfer_rounds_reuse_the_namespace_and_drop_warmup(tmp_path: Path) -> None:
    """Between rounds the bench frees its blocks without dropping the namespace:
    a clear that empties it dropped it, so every round's first put paid a
    NamespaceNotFound answer and a declare again, inside the timed region."""
    daemon = DaemonProcess(str(tmp_path), dram_bytes=64 * MiB, chunk_bytes=4 * MiB)
    daemon.start()
    try:
        with Client(daemon.address) as client:
            declares: list[Any] = []
            declare = client.declare_namespace

            def counting(spec: Any) -> Any:
                declares.append(spec)
                return declare(spec)

            client.declare_namespace = counting  # type: ignore[method-assign]
            r = local._transfer(client, 64 * 1024, 4 * MiB, 16, False, 3)
            assert len(declares) == 1, f"declared {len(declares)} times over the rounds"
            assert r["store"].n == r["load"].n == r["memcpy"].n == 3  # warm-up rounds dropped
    finally:
        daemon.stop()
