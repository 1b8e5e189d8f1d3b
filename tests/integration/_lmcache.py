"""A real LMCache engine (tests/lmcache/driver.py) in .venv-lmcache, driven from a test."""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import threading
from typing import Any

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REPLY_TIMEOUT_S = 120.0  # the first call imports torch and builds the engine


def lmcache_python() -> str:
    """$KVSTORE_LMCACHE_PYTHON, else .venv-lmcache (bench/setup_peers.sh --only lmcache)."""
    for cand in (
        os.environ.get("KVSTORE_LMCACHE_PYTHON", ""),
        os.path.join(ROOT, ".venv-lmcache", "bin", "python"),
    ):
        if cand and os.path.exists(cand):
            return cand
    pytest.skip("no LMCache venv: run `bash bench/setup_peers.sh --only lmcache`")


class LMCacheEngineProc:
    """One engine process; ``call(op, **args)`` -> its JSON answer (errors raise)."""

    def __init__(self, address: str, *, model: str = "tiny-lmcache", **opts: Any) -> None:
        args = [lmcache_python(), "-m", "tests.lmcache.driver", address, "--model", model]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "0"}
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=16)
        threading.Thread(target=self._read, daemon=True).start()
        self._reply()  # ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._replies.put(json.loads(line[3:]))
            else:
                self.log.append(line.rstrip())
        self._replies.put(None)

    def _reply(self) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError("the LMCache driver did not answer:\n" + self.tail()) from None
        if reply is None:
            raise AssertionError("the LMCache driver exited:\n" + self.tail())
        if "error" in reply:
            raise AssertionError(f"LMCache driver: {reply['error']}\n{reply['trace']}")
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.log)[-n:])

    def warnings(self) -> list[str]:
        return [line for line in self.log if "WARNING" in line or "ERROR" in line]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
