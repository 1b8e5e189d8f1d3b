"""kvstore.transfer.nixl_agent across real processes: bytes, faults, UCX_TLS=tcp.

NIXL runs only in child processes (tests/integration/nixl_proc.py): the
pytest process maps the same /dev/shm files and checks the bytes itself.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_cu12") is None,
        reason="NIXL (nixl-cu12) not installed",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
REGION_BYTES = 64 << 20
REPLY_TIMEOUT_S = 30.0


def nixl_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


class Peer:
    """One nixl_proc.py child and a mapping of its region."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.path = Path("/dev/shm") / f"kvstore-test-{name}-{uuid.uuid4().hex[:8]}"
        with open(self.path, "wb") as f:
            f.truncate(REGION_BYTES)
        with open(self.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), REGION_BYTES, mmap.MAP_SHARED)
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/integration/nixl_proc.py"), name, str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        hello = self._recv()
        self.name, self.base = hello["name"], hello["base"]
        self.metadata = hello["metadata"]

    def _recv(self) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        assert ready, "peer process did not answer in time"
        line = self.proc.stdout.readline()
        assert line, f"peer process died (rc={self.proc.poll()})"
        return json.loads(line)

    def call(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._recv()

    def read_from(self, owner: Peer, remote, local, sizes, timeout_s: float = 5.0) -> dict:  # type: ignore[no-untyped-def]
        return self.call(
            op="read",
            peer=owner.name,
            remote_base=owner.base,
            remote_offsets=[int(x) for x in remote],
            local_offsets=[int(x) for x in local],
            sizes=[int(x) for x in sizes],
            timeout_s=timeout_s,
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
            except (AssertionError, BrokenPipeError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self.map.closed:
            del self.view
            self.map.close()
            self.path.unlink(missing_ok=True)
        return self.proc.returncode


@pytest.fixture
def peers(request):  # type: ignore[no-untyped-def]
    started: list[Peer] = []

    def make(name: str, **env: str) -> Peer:
        p = Peer(name, nixl_env(**env))
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def _scatter_plan(rng: np.random.Generator, n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    slots = REGION_BYTES // block
    remote = rng.choice(slots, size=n, replace=False).astype(np.uint64) * block
    local = rng.choice(slots, size=n, replace=False).astype(np.uint64) * block
    return remote, local


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_batched_read_moves_exact_bytes(peers, tls: str) -> None:  # type: ignore[no-untyped-def]
    extra = {} if tls == "default" else {"UCX_TLS": "tcp"}
    owner, puller = peers(f"owner-{tls}", **extra), peers(f"puller-{tls}", **extra)
    assert puller.call(op="add_peer", metadata=owner.metadata)["name"] == owner.name
    rng = np.random.default_rng(7)
    owner.view[:] = rng.integers(0, 256, REGION_BYTES, dtype=np.uint8)
    block = 64 << 10
    remote, local = _scatter_plan(rng, 200, block)
    reply = puller.read_from(owner, remote, local, [block] * len(remote))
    assert "error" not in reply, reply
    for r, lo in zip(remote.tolist(), local.tolist(), strict=True):
        assert np.array_equal(puller.view[lo : lo + block], owner.view[r : r + block])
    # Bytes the batch did not name stay untouched (the puller's region started zeroed).
    untouched = np.ones(REGION_BYTES // block, dtype=bool)
    untouched[(local // block).astype(np.int64)] = False
    assert not puller.view.reshape(-1, block)[untouched].any()


def test_read_outside_registered_region_is_refused(peers) -> None:  # type: ignore[no-untyped-def]
    owner, puller = peers("owner-oob"), peers("puller-oob")
    puller.call(op="add_peer", metadata=owner.metadata)
    reply = puller.read_from(owner, [REGION_BYTES - 4096], [0], [8192])
    assert reply.get("error") in ("BackendError", "InvalidRequest"), reply


def test_killed_owner_fails_fast_and_restart_recovers(peers) -> None:  # type: ignore[no-untyped-def]
    owner, puller = peers("owner-kill"), peers("puller-kill")
    puller.call(op="add_peer", metadata=owner.metadata)
    owner.view[: 1 << 20] = 5
    assert "error" not in puller.read_from(owner, [0], [0], [1 << 20])
    os.kill(owner.proc.pid, signal.SIGKILL)
    owner.proc.wait(timeout=10)
    started = time.monotonic()
    reply = puller.read_from(owner, [0], [1 << 20], [1 << 20], timeout_s=2.0)
    assert reply.get("error") in ("Unavailable", "DeadlineExceeded"), reply
    assert time.monotonic() - started < 5.0
    # The owner comes back (same name, new process, new metadata): the puller drops the
    # stale peer, loads the new metadata and reads again.
    owner2 = peers("owner-kill")
    owner2.view[: 1 << 20] = 9
    puller.call(op="remove_peer", name=owner.name)
    assert puller.call(op="add_peer", metadata=owner2.metadata)["name"] == owner2.name
    reply = puller.read_from(owner2, [0], [2 << 20], [1 << 20])
    assert "error" not in reply, reply
    assert (puller.view[2 << 20 : 3 << 20] == 9).all()


def test_unknown_peer_is_a_state_error(peers) -> None:  # type: ignore[no-untyped-def]
    puller = peers("puller-lonely")
    reply = puller.call(
        op="read",
        peer="nobody",
        remote_base=4096,
        remote_offsets=[0],
        local_offsets=[0],
        sizes=[4096],
        timeout_s=1.0,
    )
    assert reply.get("error") == "StateConflict", reply


def test_clean_exit_code(peers) -> None:  # type: ignore[no-untyped-def]
    p = peers("exiter")
    assert p.stop() == 0


def test_stalled_owner_hits_the_deadline_and_puller_keeps_serving(peers) -> None:  # type: ignore[no-untyped-def]
    # Over tcp the owner's UCX worker must answer reads; a stopped owner never does,
    # so the read can only end by its deadline, never by an error from NIXL.
    owner = peers("owner-stall", UCX_TLS="tcp")
    puller = peers("puller-stall", UCX_TLS="tcp")
    other = peers("owner-other", UCX_TLS="tcp")
    for o in (owner, other):
        puller.call(op="add_peer", metadata=o.metadata)
    assert "error" not in puller.read_from(owner, [0], [0], [4096])
    os.kill(owner.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        reply = puller.read_from(owner, [0], [0], [32 << 20], timeout_s=1.0)
        elapsed = time.monotonic() - started
        assert reply.get("error") == "DeadlineExceeded", reply
        assert 1.0 <= elapsed < 5.0  # the deadline, plus slack for a loaded CI machine
    finally:
        os.kill(owner.proc.pid, signal.SIGKILL)
        owner.proc.wait(timeout=10)
    other.view[:4096] = 77
    reply = puller.read_from(other, [0], [8192], [4096])
    assert "error" not in reply, reply
    assert (puller.view[8192 : 8192 + 4096] == 77).all()
