"""`kvstore-bench agentic`'s cluster: N real `kvstore serve` daemons on this
machine, started and stopped together (each with its own socket, DRAM region,
optional disk tier and KV-event stream; peers on, they know each other by node id)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore_bench import _common
from kvstore_bench.ports import free_ports

# The one model every daemon, engine model and the indexer serve in the replay.
MODEL = "kvstore-bench/agentic"
START_TIMEOUT_S = 60.0


@dataclass
class NodeProcs:
    name: str
    socket: Path
    events: str
    proc: subprocess.Popen
    engine_events: str = ""


@contextlib.contextmanager
def cluster(
    n: int,
    tmp: Path,
    dram_bytes: int,
    disk_bytes: int,
    chunk_bytes: int,
    events: bool = True,
    peer_transport: str = "",
) -> Iterator[list[NodeProcs]]:
    """Start n daemons; stop them (SIGTERM, then kill) and remove their files.

    peer_transport ("auto", "nixl", "grpc_stream"; "" = peer transfer off): every
    daemon serves and pulls blocks (`peer.enabled`), knows every other one by
    node id (`peer.peers`), and they share one secret made for this cluster.
    """
    nodes: list[NodeProcs] = []
    tag = f"{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
    names = [f"node{i}" for i in range(n)]
    ports = free_ports(n) if peer_transport else [0] * n
    secret = secrets.token_hex(16)
    env = dict(os.environ)
    if peer_transport:
        # One host: UCX over loopback; NIXL's own logging at WARN (see README, Transports).
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        env["KVSTORE_PEER__SECRET"] = secret  # not on the command line (ps shows it)
    try:
        for i in range(n):
            name = names[i]
            sock = tmp / f"{name}.sock"
            pub = f"ipc://{tmp}/{name}.events"
            args = [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--set",
                f"node_id={name}",
                "--set",
                f"server.socket_path={sock}",
                "--set",
                f"server.tcp_address=127.0.0.1:{ports[i]}"
                if peer_transport
                else "server.tcp_address=",
                "--set",
                "metrics.address=",
                "--set",
                f"dram.path=/dev/shm/kvsbench-{tag}-{name}.dram",
                "--set",
                f"dram.capacity_bytes={dram_bytes}",
                "--set",
                f"dram.chunk_bytes={chunk_bytes}",
                "--set",
                f"events.enabled={str(events).lower()}",
                "--set",
                f"events.publish_address={pub}",
                "--set",
                "events.replay_address=",
                "--set",
                "log.level=warning",
            ]
            if peer_transport:
                args += [
                    "--set",
                    "peer.enabled=true",
                    "--set",
                    f"peer.transport={peer_transport}",
                ]
                for j, other in enumerate(names):
                    if j != i:
                        args += ["--set", f"peer.peers.{other}=127.0.0.1:{ports[j]}"]
            if disk_bytes:
                (tmp / f"{name}.disk").mkdir(exist_ok=True)
                args += [
                    "--set",
                    f"disk.path={tmp / f'{name}.disk'}",
                    "--set",
                    f"disk.capacity_bytes={disk_bytes}",
                    "--set",
                    f"disk.slab_bytes={chunk_bytes}",
                ]
            log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=_common.repo_root(), env=env
            )
            log.close()
            nodes.append(NodeProcs(name, sock, pub, proc, f"ipc://{tmp}/{name}.engine-events"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in nodes:
            while not node.socket.exists():
                if node.proc.poll() is not None:
                    raise RuntimeError(
                        f"{node.name} exited with {node.proc.returncode}: "
                        + (tmp / f"{node.name}.log").read_text()[-1500:]
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} not ready after {START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.proc.wait(15)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
        for f in Path("/dev/shm").glob(f"kvsbench-{tag}-*"):
            with contextlib.suppress(OSError):
                f.unlink()
