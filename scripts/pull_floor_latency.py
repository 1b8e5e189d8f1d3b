"""The floor under a peer pull's first byte on this machine (issue 12).

A warm one-block pull crosses three processes twice: the engine's client asks
its daemon B (Unix socket), B asks the owner A for a pin (TCP), A answers B, B
copies the block and answers the client. This script times that chain with no
product code at all: A and B are bare uvloop servers (as the daemons run) that
answer at once, B copies 64 KiB between two arrays; the client is a blocking
socket. Printed: p50 / p10 / p90 of the chain back to back and after an idle
gap (a client whose engine is busy elsewhere calls after an idle gap), and,
beside it, the same small numpy work timed back to back and after the gap (what
an idle gap does to any work on these VMs).

    .venv/bin/python scripts/pull_floor_latency.py          # gaps 0 and 2 ms
    GAPS_MS=0,2,10 ROUNDS=1000 .venv/bin/python scripts/pull_floor_latency.py
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

COPY_BYTES = 64 << 10
ASK_BYTES, PIN_BYTES, REPLY_BYTES = 50, 300, 80  # about the real frames' sizes


def _owner(ports: mp.Queue) -> None:  # A: answers each pin request at once
    async def main() -> None:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                try:
                    await r.readexactly(100)
                except asyncio.IncompleteReadError:
                    return
                w.write(b"x" * PIN_BYTES)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    uvloop.run(main())


def _puller(port: int, path: str, ready: mp.Event) -> None:  # B: pin on A, copy, answer
    src = np.random.default_rng(0).integers(0, 256, COPY_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)

    async def main() -> None:
        r_a, w_a = await asyncio.open_connection("127.0.0.1", port)

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                try:
                    await r.readexactly(ASK_BYTES)
                except asyncio.IncompleteReadError:
                    return  # the client is done
                w_a.write(b"p" * 100)
                await r_a.readexactly(PIN_BYTES)
                dst[:] = src
                w.write(b"y" * REPLY_BYTES)

        server = await asyncio.start_unix_server(serve, path)
        ready.set()
        await server.serve_forever()

    uvloop.run(main())


def _pct(xs: list[float]) -> str:
    us = np.asarray(xs) * 1e6
    return f"p50 {np.median(us):6.0f} us  p10 {np.percentile(us, 10):6.0f}  p90 {np.percentile(us, 90):6.0f}"


def main() -> None:
    gaps_s = [float(g) / 1e3 for g in os.environ.get("GAPS_MS", "0,2").split(",")]
    rounds = int(os.environ.get("ROUNDS", "600"))
    path = str(Path(tempfile.mkdtemp(prefix="pull-floor-")) / "b.sock")
    ports: mp.Queue = mp.Queue()
    ready = mp.Event()
    owner = mp.Process(target=_owner, args=(ports,), daemon=True)
    owner.start()
    puller = mp.Process(target=_puller, args=(ports.get(timeout=30), path, ready), daemon=True)
    puller.start()
    ready.wait(30)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)

    def chain() -> None:
        sock.sendall(b"q" * ASK_BYTES)
        got = 0
        while got < REPLY_BYTES:
            got += len(sock.recv(REPLY_BYTES - got))

    work = np.zeros(1000, dtype=np.uint64)

    def numpy_work() -> None:
        for _ in range(20):
            work.sum()

    try:
        for what, call in (
            ("client -> B -> A -> B -> client", chain),
            ("20 numpy sums", numpy_work),
        ):
            for gap_s in gaps_s:
                samples = []
                for i in range(rounds):
                    if gap_s:
                        time.sleep(gap_s)
                    t0 = time.perf_counter()
                    call()
                    if i >= rounds // 6:  # warm-up rounds dropped
                        samples.append(time.perf_counter() - t0)
                print(f"{what:34s} gap {gap_s * 1e3:4.1f} ms: {_pct(samples)}")
    finally:
        sock.close()
        owner.terminate()
        puller.terminate()


if __name__ == "__main__":
    main()
