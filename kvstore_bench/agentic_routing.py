"""`kvstore-bench agentic`'s routing glue: the strategies it replays (kvstore_router_client's,
plus a baseline without kvstore), and the indexer they ask: the real `kvstore.indexer`
process over gRPC, or its index fed in this process from the same KV events."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvstore_bench import _common
from kvstore_bench.agentic_cluster import MODEL, START_TIMEOUT_S, NodeProcs
from kvstore_router_client.policy import NodeHit, Policy, ScoreResult
from kvstore_router_client.strategies import STRATEGIES as ROUTER_STRATEGIES

STRATEGIES = (*ROUTER_STRATEGIES, "approximate-gpu-only")
# Baseline without kvstore at all: approximate routing, engines with their GPU
# prefix cache only (no daemon loads, stores or peer pulls) — llm-d's estimated
# scorer in front of plain vLLM, the setting of the published +79% figure.
GPU_ONLY = "approximate-gpu-only"


class Scorer(Protocol):
    def score(self, hashes: np.ndarray) -> dict[str, Any]: ...

    def catch_up(self) -> int: ...

    def close(self) -> None: ...


def policy_from_args(overrides: Sequence[str]) -> Policy:
    """kvstore_router_client's default Policy with ``field=value`` overrides (--policy)."""
    import msgspec

    fields: dict[str, Any] = msgspec.structs.asdict(Policy())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--policy {item!r}: one of {', '.join(fields)} = a number")
        fields[key] = type(fields[key])(value)
    return Policy(**fields)


def index_scores(index: Scorer, hashes: np.ndarray) -> ScoreResult:
    """The index's answer in kvstore_router_client's form (what RouterClient.scores returns)."""
    return ScoreResult(
        request_blocks=len(hashes),
        hits=[
            NodeHit(s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks)
            for s in index.score(hashes).values()
        ],
    )


class EventTap:
    """A ZMQ subscriber to every daemon's and engine model's KV-event stream, read
    in this process without blocking."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        import zmq

        from kvstore.events import wire

        self._zmq = zmq
        self.wire = wire
        self.decoder = wire.lean_decoder()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._sub.set_hwm(1_000_000)
        for ep in endpoints:
            self._sub.connect(ep)

    def recv(self) -> list[bytes] | None:
        """The next message already delivered (its frames), or None: never blocks."""
        try:
            return self._sub.recv_multipart(flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            return None

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


class EventIndex(EventTap):
    """The indexer's index (kvstore.indexer.memory.MemoryIndex) fed from every
    daemon's and every engine model's ZMQ event stream, consumed in this
    process so the modelled clock can drain it before each routing decision."""

    description = "kvstore.indexer MemoryIndex fed by ZMQ KV events (consumed in-process)"

    def __init__(self, endpoints: Sequence[str]) -> None:
        from kvstore.indexer.memory import MemoryIndex

        super().__init__(endpoints)
        self.index = MemoryIndex()
        self.events = 0

    def catch_up(self, max_messages: int = 100_000) -> int:
        """Apply every event already delivered (bounded); return how many batches."""
        wire = self.wire
        n = 0
        while n < max_messages:
            frames = self.recv()
            if frames is None:
                break
            n += 1
            parsed = wire.parse_topic(frames[0])
            if parsed is None:
                continue
            node, model = parsed
            batch = self.decoder.decode(frames[2])
            for ev in batch.events:
                self.events += 1
                if not isinstance(ev, wire.LeanStored | wire.LeanRemoved):
                    self.index.clear(node, model or None)
                    continue
                hashes = np.fromiter(
                    (wire.block_hash_to_int(h) for h in ev.block_hashes),
                    dtype=np.uint64,
                    count=len(ev.block_hashes),
                )
                if isinstance(ev, wire.LeanStored):
                    self.index.add(model, node, ev.medium, hashes)
                else:
                    self.index.remove(model, node, ev.medium, hashes)
        return n

    def score(self, hashes: np.ndarray) -> dict[str, Any]:
        return {s.node: s for s in self.index.score(MODEL, hashes)}


class IndexerService:
    """The real indexer: a `python -m kvstore.indexer` process following every
    daemon's stream (kind daemon) and every engine model's (kind engine),
    queried over gRPC through kvstore_router_client.RouterClient. It ingests on its own
    clock, as in a deployment, so a routing decision may miss the last few
    milliseconds of events."""

    description = "kvstore indexer process (ZMQ KV events -> gRPC Score via kvstore_router_client)"

    def __init__(self, nodes: Sequence[NodeProcs], block_tokens: int, log_path: Path) -> None:
        from kvstore_router_client.scorer import RouterClient

        args = [
            sys.executable,
            "-m",
            "kvstore.indexer",
            "--address",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
        ]
        for nd in nodes:
            args += [
                "--source",
                f"node={nd.name},endpoint={nd.events}",
                "--source",
                f"node={nd.name},endpoint={nd.engine_events},kind=engine,model={MODEL}",
            ]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._log, cwd=_common.repo_root()
        )
        address = self._wait_listening()
        self.client = RouterClient(address, block_size_tokens=block_tokens, deadline_s=2.0)

    def _wait_listening(self) -> str:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"indexer exited with {self.proc.returncode}")
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline().decode()
                if "listening on" in line:
                    return line.rsplit(" ", 1)[-1].strip()
        raise RuntimeError(f"indexer not listening after {START_TIMEOUT_S:.0f} s")

    def catch_up(self) -> int:
        return 0

    def score(self, hashes: np.ndarray) -> dict[str, Any]:
        return {h.node: h for h in self.client.scores(MODEL, hashes).hits}

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()
