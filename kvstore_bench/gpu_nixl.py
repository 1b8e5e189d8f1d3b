"""NIXL between two processes on one machine, from GPU memory: VRAM -> VRAM or VRAM -> DRAM.

Two child processes (each a NIXL agent with the UCX backend, as a daemon runs
it: ``kvstore.transfer.nixl_agent``), one holding a source buffer, the other a
destination; the destination READs the whole buffer in blocks, as the puller
does, and checks every byte. Reference: a same-process torch copy of the same
bytes between the same kinds of memory.

Daemons register only their DRAM region with NIXL today, so this runs the
agents directly with ``mem_type="VRAM"`` registrations: it answers whether the
carried NIXL build moves GPU memory here, and how fast.

Without CUDA, ``--src DRAM --dst DRAM`` runs the same code host to host.

    python -m kvstore_bench.gpu_nixl [--src VRAM] [--dst VRAM|DRAM] [--figures PATH]
    (child) python -m kvstore_bench.gpu_nixl --child NAME --mem VRAM|DRAM --bytes N
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from kvstore_bench._common import Figure, gbps, write_figures

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", default="", help="VRAM or DRAM (default VRAM with CUDA, else DRAM)")
    p.add_argument("--dst", default="", help="VRAM or DRAM (default: both, one after the other)")
    p.add_argument("--bytes", type=int, default=1 << 30)
    p.add_argument("--block-bytes", type=int, default=2 * MiB)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per read and per reply")
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    p.add_argument("--figures", default="", help="append figures as JSON lines to this file")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--mem", default="DRAM", help=argparse.SUPPRESS)


# ------------------------------------------------------------------ child


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _pattern(torch: Any, nbytes: int, device: str) -> Any:
    return (torch.arange(nbytes, device=device, dtype=torch.int64) % 251).to(torch.uint8)


def child(name: str, mem: str, nbytes: int) -> None:
    """One agent: allocate, register, then serve JSON-line commands on stdin."""
    import torch

    from kvstore.errors import KVStoreError
    from kvstore.transfer.base import ReadBatch
    from kvstore.transfer.nixl_agent import NixlAgent, ProgressPump

    try:
        if mem == "VRAM":
            device = "cuda:0"
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        else:
            device = "cpu"
            buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        expected = _pattern(torch, nbytes, device)
        if name == "source":
            buf.copy_(expected)
        if buf.is_cuda:
            torch.cuda.synchronize()
        agent = NixlAgent(name)
        agent.register_region(buf.data_ptr(), nbytes, mem_type=mem, device_id=0)
    except Exception as exc:  # the parent prints it as the one reason
        _reply({"error": type(exc).__name__, "message": str(exc)[:2000]})
        os._exit(0)
    pump = ProgressPump(agent)
    pump.hold(0, 3600.0)  # measure the transport, not the pump's idle latency
    _reply({"metadata": agent.metadata().hex(), "base": buf.data_ptr(), "mem": mem})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "add_peer":
                _reply({"name": agent.add_peer(bytes.fromhex(cmd["metadata"]))})
            elif cmd["op"] == "read":
                block = int(cmd["block_bytes"])
                n = nbytes // block
                offsets = [i * block for i in range(n)]
                batch = ReadBatch.of(offsets, offsets, [block] * n)
                times = []
                for _ in range(int(cmd["repeats"]) + 1):  # the first warms up
                    buf.zero_()
                    if buf.is_cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    agent.read(
                        cmd["peer"],
                        int(cmd["remote_base"]),
                        batch,
                        float(cmd["timeout_s"]),
                        remote_mem_type=cmd["remote_mem"],
                    )
                    times.append(time.perf_counter() - t0)
                ok = bool(torch.equal(buf[: n * block], expected[: n * block]))
                _reply({"times_s": times[1:], "bytes": n * block, "intact": ok})
            elif cmd["op"] == "exit":
                break
        except KVStoreError as exc:
            _reply({"error": type(exc).__name__, "message": str(exc)[:2000]})
    pump.stop()
    agent.close()
    _reply({})
    os._exit(0)  # a process that created a UCX backend segfaults at exit otherwise


# ----------------------------------------------------------------- parent


class _Child:
    def __init__(self, name: str, mem: str, nbytes: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore_bench.gpu_nixl", "--child", name, "--mem", mem]
            + ["--bytes", str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")},
        )
        self.hello: dict[str, Any] = {}

    def recv(self) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            raise TimeoutError(f"no reply within {self.timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the NIXL child exited (rc {self.proc.poll()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{msg['error']}: {msg['message']}")
        return msg

    def send(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
            self.proc.wait()


def _reference_s(src: str, dst: str, nbytes: int, repeats: int) -> float:
    import torch

    def alloc(mem: str) -> Any:
        if mem == "VRAM":
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    a, b = alloc(src), alloc(dst)
    times = []
    for _ in range(repeats + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_all(src: str, dsts: list[str], args: argparse.Namespace) -> list[Figure]:
    """One source and one target per destination kind, all started at once (each
    child takes seconds to import torch and bring up UCX)."""
    names = {dst: f"NIXL READ {src} -> {dst}, two processes" for dst in dsts}
    children: dict[str, _Child] = {}
    results: dict[str, dict[str, Any] | str] = {}
    try:
        children["source"] = _Child("source", src, args.bytes, args.timeout_s)
        for dst in dsts:
            children[dst] = _Child(f"target-{dst.lower()}", dst, args.bytes, args.timeout_s)
        for child in children.values():
            child.hello = child.recv()
        source = children["source"]
        for dst in dsts:
            target = children[dst]
            try:
                peer = target.send({"op": "add_peer", "metadata": source.hello["metadata"]})
                results[dst] = target.send(
                    {
                        "op": "read",
                        "peer": peer["name"],
                        "remote_base": source.hello["base"],
                        "remote_mem": src,
                        "block_bytes": args.block_bytes,
                        "repeats": args.repeats,
                        "timeout_s": args.timeout_s,
                    }
                )
            except (RuntimeError, TimeoutError, OSError) as exc:
                results[dst] = f"failed: {exc}"
    except (RuntimeError, TimeoutError, OSError) as exc:
        for dst in dsts:
            results.setdefault(dst, f"failed: {exc}")
    finally:
        for c in children.values():
            c.close()
    figures = []
    for dst in dsts:
        got = results[dst]
        if isinstance(got, str):
            figures.append(Figure(figure=names[dst], value=None, unit="GB/s", note=got[:500]))
            continue
        if not got["intact"]:
            figures.append(
                Figure(figure=names[dst], value=None, unit="GB/s", note="FAILED: bytes differ")
            )
            continue
        median_s = statistics.median(got["times_s"])
        ref_s = _reference_s(src, dst, got["bytes"], args.repeats)
        figures.append(
            Figure(
                figure=names[dst],
                value=gbps(got["bytes"], median_s),
                unit="GB/s",
                reference=gbps(got["bytes"], ref_s),
                reference_what="same-process torch copy",
                ratio=ref_s / median_s,
                note=f"{got['bytes'] // MiB} MiB in {args.block_bytes // 1024} KiB blocks, "
                "bytes checked",
            )
        )
    return figures


def run(args: argparse.Namespace) -> int:
    if args.child:
        child(args.child, args.mem, args.bytes)
        return 0
    import torch

    from kvstore.errors import BackendError
    from kvstore.transfer.nixl_agent import load_nixl

    cuda = torch.cuda.is_available()
    if args.quick or not cuda:
        args.bytes, args.repeats = min(args.bytes, 16 * MiB), min(args.repeats, 2)
        args.block_bytes = min(args.block_bytes, 1 * MiB)
    src = args.src or ("VRAM" if cuda else "DRAM")
    dsts = [args.dst] if args.dst else (["VRAM", "DRAM"] if cuda else ["DRAM"])
    try:
        load_nixl()
    except BackendError as exc:
        fig = Figure(figure="NIXL from GPU memory", value=None, unit="GB/s", note=str(exc)[:500])
        print(f"bench gpu_nixl: NIXL does not load here: {exc}")
        write_figures(args.figures, [fig])
        return 0
    if "VRAM" in (src, *dsts) and not cuda:
        print("bench gpu_nixl: VRAM needs CUDA; none here")
        return 2
    figures = measure_all(src, dsts, args)
    for fig in figures:
        if fig.value is None:
            print(f"  {fig.figure}: not measured: {fig.note}")
        else:
            print(
                f"  {fig.figure}: {fig.value:.2f} GB/s, {fig.reference_what} "
                f"{fig.reference:.2f} GB/s, ratio {fig.ratio:.2f}x ({fig.note})"
            )
    write_figures(args.figures, figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
