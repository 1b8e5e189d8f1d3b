"""Lean-channel call latency after an idle gap, next to a bare asyncio echo (issue 12).

A real daemon (kvstore.process.DaemonProcess in a temp dir), a Client over the
lean local channel, and a bare asyncio Unix-socket echo server in its own
process, all called from this one process: each round makes an echo, a lookup
and a prepare_store + commit_store of 8 blocks, each after a sleep of the gap.
Prints p50/p90 (ms) per call and gap, so the daemon's cost after a gap reads
against the bare floor measured in the same run (the echo server sits idle ~3 gaps
between its calls, the daemon one: the comparison favours the echo less, not more).

    PYTHONPATH=$PWD flock /work/wt/bench.lock .venv/bin/python scripts/idle_gap_latency.py
    LOOP=uvloop ...        # the daemon and the echo on uvloop (server.event_loop)
    ROUNDS=30 GAPS_MS=0,100 ...
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

from kvstore.client import Client
from kvstore.namespace import NamespaceSpec
from kvstore.process import DaemonProcess
from kvstore_bench._common import summarize

BLOCK_BYTES = 4096
ECHO_SERVER = r"""
import asyncio, struct, sys
class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buf = transport, bytearray()
    def data_received(self, data):
        self.buf += data
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from("<I", self.buf)
            if len(self.buf) < 4 + n:
                return
            frame = bytes(self.buf[: 4 + n])
            del self.buf[: 4 + n]
            self.transport.write(frame)
async def main():
    await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[1])
    print("ready", flush=True)
    await asyncio.Event().wait()
if sys.argv[2] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


def main() -> None:
    gaps_ms = [int(g) for g in os.environ.get("GAPS_MS", "0,10,50,100,300").split(",")]
    rounds = int(os.environ.get("ROUNDS", "15"))
    loop = os.environ.get("LOOP", "asyncio")
    settings = {"server.event_loop": loop} if loop != "asyncio" else {}
    spec = NamespaceSpec(
        model="idle-gap",
        dtype="float16",
        block_size_tokens=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_bytes=BLOCK_BYTES,
    )
    with tempfile.TemporaryDirectory() as tmp:
        echo_path = os.path.join(tmp, "echo.sock")
        echo = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER, echo_path, loop], stdout=subprocess.PIPE, text=True
        )
        try:
            assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(echo_path)
            frame = struct.pack("<I", 100) + b"x" * 100

            def ping() -> None:
                sock.sendall(frame)
                got = 0
                while got < len(frame):
                    got += len(sock.recv(65536))

            res: dict[int, dict[str, list[float]]] = {
                g: {"echo": [], "lookup": [], "store": []} for g in gaps_ms
            }
            with DaemonProcess(tmp, settings=settings) as d, Client(d.address) as c:
                assert c.using_local_channel, "no lean channel"
                ns = c.declare_namespace(spec)
                first = 1
                for _ in range(rounds):
                    for g in gaps_ms:
                        hashes = list(range(first, first + 8))
                        first += 8
                        for name, call in (
                            ("echo", ping),
                            ("lookup", lambda h=hashes: c.lookup(ns, h)),
                            ("store", lambda h=hashes: c.commit_store(c.prepare_store(ns, h))),
                        ):
                            time.sleep(g / 1000)
                            t = time.perf_counter()
                            call()
                            res[g][name].append(time.perf_counter() - t)
                    c.delete(ns, list(range(1, first)))  # the region stays small
                    first = 1
            sock.close()
        finally:
            echo.kill()
            echo.wait()
    print(f"loop={loop} rounds={rounds} (ms; 'store' = prepare_store + commit_store, 8 blocks)")
    for g in gaps_ms:
        sums = {k: summarize(v) for k, v in res[g].items()}
        cols = "  ".join(
            f"{k} p50 {1e3 * m.median_s:6.3f} p90 {1e3 * m.p90_s:6.3f}" for k, m in sums.items()
        )
        print(f"gap {g:4d} ms  {cols}")


if __name__ == "__main__":
    main()
