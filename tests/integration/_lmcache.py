"""Real LMCache processes in .venv-lmcache, driven from a test: an in-process engine
(tests/lmcache/driver.py), the MP server (`lmcache server`) and its client
(tests/lmcache/mp_driver.py)."""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import threading
import time
import urllib.request
from typing import Any

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REPLY_TIMEOUT_S = 120.0  # the first call imports torch and builds the engine


def lmcache_python() -> str:
    """$KVSTORE_LMCACHE_PYTHON, else .venv-lmcache (kvstore_bench/setup_peers.sh --only lmcache)."""
    for cand in (
        os.environ.get("KVSTORE_LMCACHE_PYTHON", ""),
        os.path.join(ROOT, ".venv-lmcache", "bin", "python"),
    ):
        if cand and os.path.exists(cand):
            return cand
    pytest.skip("no LMCache venv: run `bash kvstore_bench/setup_peers.sh --only lmcache`")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "0"}


class DriverProc:
    """One driver process; ``call(op, **args)`` -> its JSON answer (errors raise)."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [lmcache_python(), "-m", module, *args],
            cwd=ROOT,
            env={**_env(), **(env or {})},
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


class LMCacheEngineProc(DriverProc):
    """A real LMCacheEngine on CPU with kvstore as its remote backend."""

    def __init__(
        self,
        address: str,
        *,
        model: str = "tiny-lmcache",
        env: dict[str, str] | None = None,
        **opts: Any,
    ) -> None:
        args = [address, "--model", model]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        super().__init__("tests.lmcache.driver", *args, env=env)


class LMCacheMPServer:
    """`lmcache server` (engine-driven shared-memory transfer, LRU L1) with kvstore
    as its L2 (kvstore_connectors.lmcache.l2), on free ports."""

    def __init__(self, daemon_address: str, workdir: str, *, l1_size_gb: float) -> None:
        from kvstore_bench.ports import free_port

        self.port, http = free_port(), free_port()
        self.http_url = f"http://127.0.0.1:{http}"
        l2 = {
            "type": "plugin",
            "module_path": "kvstore_connectors.lmcache.l2",
            "class_name": "KVStoreL2Adapter",
            "adapter_params": {"address": daemon_address},
        }
        exe = os.path.join(os.path.dirname(lmcache_python()), "lmcache")
        self.log_path = os.path.join(workdir, f"lmcache-server-{self.port}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [
                exe, "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--http-port", str(http), "--l1-size-gb", str(l1_size_gb),
                "--eviction-policy", "LRU", "--shm-name", f"kvst{os.getpid()}p{self.port}",
                "--disable-observability", "--supported-transfer-mode", "engine_driven",
                "--l2-adapter", json.dumps(l2),
            ],
            cwd=ROOT,
            env=_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self._up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError("lmcache server did not start:\n" + self.tail())
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + "/config", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
