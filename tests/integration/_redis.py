"""A real redis-server on a free 127.0.0.1 port, for tests that need Redis.

    from tests.integration._redis import redis_server  # noqa: F401  (pytest fixture)

The fixture yields the server's URL and stops the process afterwards; tests
are skipped when no redis-server binary exists (CI installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_bench.ports import free_port


class RedisProcess:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._cmd = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self._cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path)
    try:
        yield server
    finally:
        server.stop()
