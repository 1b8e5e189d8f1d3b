"""Run a daemon as a child process: for tests, benchmarks and demos.

    with DaemonProcess(tmp_path, dram_bytes=64 << 20) as d:
        client = Client(d.address)

The child is a real `python -m kvstore serve`; readiness is its JSON `ready`
line on stdout (bound ports included, so port 0 works). Waits are bounded.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.errors import Unavailable


class DaemonProcess:
    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        name: str = "kvstored",
        dram_bytes: int = 64 << 20,
        chunk_bytes: int = 4 << 20,
        tcp: bool = True,
        metrics: bool = False,
        settings: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.socket_path = str(self.workdir / f"{name}.sock")
        self.settings: dict[str, Any] = {
            "node_id": name,
            "server.socket_path": self.socket_path,
            "server.tcp_address": "127.0.0.1:0" if tcp else "",
            "server.drain_timeout_s": 2,
            "dram.path": self.default_region_path(self.workdir, name),
            "dram.capacity_bytes": dram_bytes,
            "dram.chunk_bytes": chunk_bytes,
            "metrics.address": "127.0.0.1:0" if metrics else "",
        }
        self.settings.update(settings or {})
        self.socket_path = str(self.settings["server.socket_path"])
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        self.log_path = self.workdir / f"{name}.log"

    @staticmethod
    def default_region_path(workdir: Path, name: str) -> str:
        """A region in shared memory (/dev/shm), named after workdir and node.

        Not in workdir: a region on a disk filesystem would be written back to
        disk. Derived from workdir, so a node restarted on the same workdir finds
        its region again (warm restart); remove_region() deletes it.
        """
        tag = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:12]
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() else workdir
        # A test run sets KVSTORE_TEST_RUN so its clean-up touches only its own
        # regions, never those of another run on the same machine.
        run = os.environ.get("KVSTORE_TEST_RUN", "x")
        return str(base / f"kvstore-test-{run}-{tag}-{name}.dram")

    def remove_region(self) -> None:
        """Delete the region file and its warm-restart manifest (after the daemon stopped)."""
        region = str(self.settings["dram.path"])
        tenant_files = glob.glob(glob.escape(region) + ".tenant-*")  # dram.tenant_regions
        extra = (".manifest", ".gpu", ".presence")  # warm restart, GPU host mode, lookups
        for path in (region, *(region + x for x in extra), *tenant_files):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    @property
    def address(self) -> str:
        return "unix:" + self.socket_path

    @property
    def tcp_address(self) -> str:
        return str(self.info["tcp_address"])

    @property
    def metrics_address(self) -> str:
        return str(self.info["metrics_address"])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvstore", "serve"]
        for key, value in self.settings.items():
            cmd += ["--set", f"{key}={value}"]
        return cmd

    def start(self) -> DaemonProcess:
        env = dict(os.environ)
        env.update(self.env or {})
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in _reap
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        deadline = time.monotonic() + self.start_timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if msg.get("event") == "ready":
                        self.info = msg
                        return self
            if self.proc.poll() is not None:
                break
        rc = self.proc.poll()
        # A daemon that exited by itself removed the region it created; the path
        # may be another daemon's (a refused second daemon on one region), so only
        # one we had to kill gets its region removed here.
        self.kill(keep_region=rc is not None)
        raise Unavailable(
            f"daemon {self.name} did not become ready (rc={rc}); log tail:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0, *, keep_region: bool = False) -> int:
        """SIGTERM, wait for the drain; return the exit code.

        The daemon keeps its region for a warm restart; unless keep_region, it
        is removed here, so test and bench runs leave nothing in /dev/shm.
        """
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=5)
        self._reap()
        if not keep_region:
            self.remove_region()
        return rc

    def kill(self, *, keep_region: bool = False) -> None:
        """SIGKILL: a crash, as far as the daemon is concerned.

        A crashed daemon leaves no manifest, so its region is never reused;
        unless keep_region, it is removed here so nothing is left in /dev/shm.
        """
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reap()
        if not keep_region:
            self.remove_region()

    def _reap(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> DaemonProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.remove_region()
