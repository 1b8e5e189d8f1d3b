"""`kvstore-bench p2p`: pull blocks between two daemons vs bare NIXL vs memcpy.

For each block size (default 2 MiB and 64 KiB, 1 GiB in all), in one run and
interleaved repetition by repetition so the machine's swings hit all alike:

- daemon: ``Client.fetch_from_peer`` on daemon B (over B's lean local channel)
  for blocks daemon A holds (pin RPC on A, one NIXL READ, xxh3 verification of
  every block on B, commit, release), timed at the client; B's copies are
  deleted between repetitions.
- bare NIXL: two plain processes, one NIXL READ of the *same descriptors*
  (A's and B's slot offsets, regions of the same size in /dev/shm), posted and
  polled with nothing else around it: the reference.
- memcpy: numpy copy of the same bytes in the same block size, one process.

Also: time to first byte (a one-block pull, connected and warm; beside it the
same pull asked over gRPC ``FetchFromPeer``, one round trip more, and the same
pull of a pin A handed over first, ``Client.hand_over``, none; against a bare
one-block READ back to back and after a 2 ms idle gap) and the
per-transfer overhead (daemon minus bare NIXL medians). Ratios are
bare_time / daemon_time (1.0 = the daemon adds nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_bench._common import (
    Summary,
    gbps,
    results_dir,
    summarize,
    wait_collapsed,
    write_json,
)

MiB = 1 << 20
# The daemon's bound on each pull (under the puller's 115 s maximum).
PULL_TIMEOUT_S = 60.0
SECRET = "bench-secret"
# Idle time before each bare one-block READ of the first byte's second reference.
TTFB_GAP_S = 0.002
NIXL_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per pull")
    p.add_argument("--block-kib", type=int, nargs="+", default=[2048, 64], help="block sizes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ttfb-repeats", type=int, default=30, help="one-block pulls timed")
    p.add_argument(
        "--ucx-tls", default="", help="UCX_TLS for all processes (e.g. tcp); default: UCX's choice"
    )
    p.add_argument("--results", default="results", help="folder for the JSON report")
    p.add_argument(
        "--huge-pages",
        choices=["auto", "off"],
        default="auto",
        help="dram.huge_pages of both daemons; the bare processes' regions follow "
        "(auto: collapsed into 2 MiB pages as the daemons' are)",
    )
    p.add_argument(
        "--region-dir",
        default="/dev/shm",
        help="memory filesystem for the daemons' and the bare processes' regions alike "
        "(e.g. a tmpfs mounted with huge=within_size: 2 MiB pages; docs/tiers.md)",
    )
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats (CI smoke)")
    p.add_argument(
        "--pin-channel",
        choices=["true", "false"],
        default="true",
        help="peer.pin_channel of both daemons (false: pins over gRPC, as before it)",
    )


# ------------------------------------------------------------- bare NIXL child


def _child(role: str, region_path: str, huge_pages: str) -> None:
    """A bare NIXL process: 'owner' serves its region; 'puller' reads on command.
    Its region is mapped, and with huge_pages "auto" collapsed into 2 MiB pages,
    as a daemon's is (kvstore.tiers.dram), so both read between the same pages."""
    from kvstore.tiers.dram import collapse_all, map_file_at, reserve_addresses
    from kvstore.transfer.nixl_agent import ProgressPump, load_nixl

    agent_cls, config_cls = load_nixl()
    fd = os.open(region_path, os.O_RDWR)
    nbytes = os.fstat(fd).st_size
    _reservation, view = reserve_addresses(nbytes)
    map_file_at(view, 0, fd, nbytes, populate=True)
    os.close(fd)
    region = view  # the mapping lives as long as the process
    base = view.ctypes.data
    huge_bytes = collapse_all(base, nbytes)[0] if huge_pages == "auto" else 0
    agent = agent_cls(
        f"bare-{role}-{os.getpid()}", config_cls(enable_prog_thread=False, backends=["UCX"])
    )
    reg = agent.register_memory([(base, nbytes, 0, "")], "DRAM")
    out = sys.stdout
    if role == "owner":
        words = np.frombuffer(region, dtype=np.uint64)
        words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(8)  # each word = its offset

        class _Agent:  # what ProgressPump needs: the owner must progress for peers
            def progress(self) -> object:
                return agent.get_new_notifs()

        # Fast only while the puller reads (the parent says when), as a daemon's
        # pump is fast only while pins are out: a reference polling all run long
        # would steal a share of a core from the daemons timed beside it.
        pump = ProgressPump(_Agent())  # type: ignore[arg-type]
        out.write(
            json.dumps(
                {
                    "metadata": agent.get_agent_metadata().hex(),
                    "base": base,
                    "huge_page_bytes": huge_bytes,
                }
            )
            + "\n"
        )
        out.flush()
        for line in sys.stdin:  # until the parent says stop (or dies)
            op = json.loads(line)["op"]
            if op == "stop":
                break
            if op == "hold":
                pump.hold(0, 1e9)
            elif op == "idle":
                pump.release(0)
            out.write("{}\n")
            out.flush()
        pump.stop()
    else:
        out.write(json.dumps({"ready": True, "huge_page_bytes": huge_bytes}) + "\n")
        out.flush()
        peer = ""
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "stop":
                break
            if cmd["op"] == "connect":
                peer = agent.add_remote_agent(bytes.fromhex(cmd["metadata"]))
                remote_base = cmd["base"]
                out.write("{}\n")
                out.flush()
                continue
            remote = np.load(cmd["remote"]) + np.uint64(remote_base)
            local = np.load(cmd["local"]) + np.uint64(base)
            size = cmd["size"]
            times = []
            gap_s = cmd.get("gap_s", 0.0)
            for _ in range(cmd["repeats"]):
                if gap_s:
                    time.sleep(gap_s)  # idle, as a pull's READ is after its round trips
                ldesc = np.stack([local, np.full_like(local, size), np.zeros_like(local)], axis=1)
                rdesc = np.stack(
                    [remote, np.full_like(remote, size), np.zeros_like(remote)], axis=1
                )
                started = time.perf_counter()
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(ldesc, "DRAM"),
                    agent.get_xfer_descs(rdesc, "DRAM"),
                    peer,
                )
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                times.append(time.perf_counter() - started)
                agent.release_xfer_handle(handle)
                if state != "DONE":
                    raise SystemExit(f"bare READ failed: {state}")
            words = np.frombuffer(region, dtype=np.uint64)
            first = words[((local - np.uint64(base)) // np.uint64(8)).astype(np.int64)]
            ok = bool((first == remote - np.uint64(remote_base)).all())
            out.write(json.dumps({"seconds": times, "ok": ok}) + "\n")
            out.flush()
    agent.deregister_memory(reg)
    out.flush()
    os._exit(0)  # a process that created a UCX backend segfaults at interpreter exit


class _Bare:
    def __init__(self, role: str, region_path: Path, env: dict[str, str], huge_pages: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore_bench.p2p", role, str(region_path), huge_pages],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.hello = self.recv(60)

    def recv(self, timeout_s: float = 120) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"bare NIXL child gave no answer (rc={self.proc.poll()})")
        return json.loads(line)

    def send(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


# -------------------------------------------------------------------- the run


def _fetch_stub(address: str) -> Any:
    import grpc

    from kvstore.v1 import peer_pb2_grpc

    channel = grpc.insecure_channel(address)
    return channel, peer_pb2_grpc.PeerFetchServiceStub(channel)


def _one_size(
    args: argparse.Namespace, block_bytes: int, total_bytes: int, env: dict[str, str]
) -> dict[str, Any]:
    from kvstore.client import Client
    from kvstore.namespace import NamespaceSpec
    from kvstore.process import DaemonProcess
    from kvstore.v1 import peer_pb2

    n = total_bytes // block_bytes
    region_bytes = total_bytes + 64 * MiB
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-p2p-", dir="/dev/shm"))
    # Every region, the daemons' and the bare processes', on one filesystem.
    regions = Path(tempfile.mkdtemp(prefix="kvstore-bench-p2p-regions-", dir=args.region_dir))
    daemons = []
    bare: list[_Bare] = []
    try:
        for name in ("bench-a", "bench-b"):
            d = DaemonProcess(
                work / name,
                name=name,
                dram_bytes=region_bytes,
                chunk_bytes=64 * MiB,
                settings={
                    "peer.enabled": "true",
                    "peer.secret": SECRET,
                    "peer.transfer_timeout_s": 60,
                    "leases.default_ttl_s": 120,
                    "peer.pin_channel": args.pin_channel,
                    "dram.path": str(regions / f"{name}.dram"),
                    "dram.huge_pages": args.huge_pages,
                },
                env=env,
                start_timeout_s=120,
            )
            d.start()
            daemons.append(d)
        a, b = daemons
        page_bytes = int(a.info["region_page_bytes"])  # b's and the bare regions' too
        daemon_huge = [wait_collapsed(d.address) for d in daemons]  # before anything is timed
        spec = NamespaceSpec(
            model="bench-p2p",
            dtype="uint8",
            block_size_tokens=16,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            block_bytes=block_bytes,
        )
        hashes = list(range(1, n + 1))
        ttfb_hash = [n + 1]
        with Client(a.address) as ca:
            ns_a = ca.declare_namespace(spec)
            step = max(1, (256 * MiB) // block_bytes)
            rng = np.random.default_rng(1)
            for i in range(0, n + 1, step):
                chunk = (hashes + ttfb_hash)[i : i + step]
                ca.put(ns_a, chunk, rng.integers(0, 256, (len(chunk), block_bytes), dtype=np.uint8))
            load = ca.prepare_load(ns_a, hashes)
            remote_offsets = np.asarray(load.offsets, dtype=np.uint64).copy()
            ca.release(load)
        # A's client stays open: the handed-over first byte has A's client pin
        # each block for B (as a prefill engine's connector would, after its store).
        ca = Client(a.address)
        ns_a = ca.declare_namespace(spec)
        cb = Client(b.address)
        ns_b = cb.declare_namespace(spec)
        channel, stub = _fetch_stub(b.address)
        packed = np.asarray(hashes, dtype="<u8").tobytes()

        def pull(hs: bytes, ticket: bytes = b"") -> Any:
            # As an engine's client pulls: Client.fetch_from_peer, over the lean
            # local channel (the first byte waits for A's pin, on the pin
            # channel; none with a ticket: a pin A handed over).
            return cb.fetch_from_peer(
                ns_b,
                np.frombuffer(hs, dtype="<u8"),
                peer_address=a.tcp_address,
                timeout_s=PULL_TIMEOUT_S,
                ticket=ticket,
            )

        def pull_grpc(hs: bytes) -> Any:
            # The same pull asked over gRPC FetchFromPeer (one call more before the pin).
            return stub.FetchFromPeer(
                peer_pb2.FetchFromPeerRequest(
                    namespace_id=ns_b.namespace_id,
                    block_hashes=hs,
                    peer_address=a.tcp_address,
                    timeout_s=PULL_TIMEOUT_S,
                ),
                timeout=PULL_TIMEOUT_S + 5,
            )

        first = pull(packed)  # warm: connects, and A hashes each block once (then cached)
        if first.fetched_blocks != n:
            raise RuntimeError(f"warm-up pull moved {first.fetched_blocks} of {n} blocks")
        load = cb.prepare_load(ns_b, hashes)
        local_offsets = np.asarray(load.offsets, dtype=np.uint64).copy()
        cb.release(load)

        # Bare NIXL over regions of the same sizes and the same descriptors.
        paths = []
        for role in ("owner", "puller"):
            path = regions / f"bare-{role}.region"
            with open(path, "wb") as f:
                f.truncate(region_bytes)
            paths.append(path)
        owner = _Bare("owner", paths[0], env, args.huge_pages)
        bare.append(owner)
        puller = _Bare("puller", paths[1], env, args.huge_pages)
        bare.append(puller)
        puller.send(op="connect", metadata=owner.hello["metadata"], base=owner.hello["base"])
        np.save(work / "remote.npy", remote_offsets)
        np.save(work / "local.npy", local_offsets)
        np.save(work / "remote1.npy", remote_offsets[:1])
        np.save(work / "local1.npy", local_offsets[:1])

        def bare_read(which: str, repeats: int, gap_s: float = 0.0) -> list[float]:
            owner.send(op="hold")  # the owner progresses fast while it is read
            try:
                reply = puller.send(
                    op="read",
                    remote=str(work / f"remote{which}.npy"),
                    local=str(work / f"local{which}.npy"),
                    size=block_bytes,
                    repeats=repeats,
                    gap_s=gap_s,
                )
            finally:
                owner.send(op="idle")
            if not reply["ok"]:
                raise RuntimeError("bare NIXL READ landed wrong bytes")
            return reply["seconds"]

        bare_read("", 1)  # warm

        src = np.ones((n, block_bytes), dtype=np.uint8)
        dst = np.zeros_like(src)

        daemon_s, bare_s, memcpy_s = [], [], []
        parts: dict[str, list[float]] = {"pin_s": [], "transfer_s": [], "verify_s": []}
        for _ in range(args.repeats):
            cb.delete(ns_b, hashes)
            t0 = time.perf_counter()
            r = pull(packed)
            daemon_s.append(time.perf_counter() - t0)
            if r.fetched_blocks != n or r.corrupt_blocks:
                raise RuntimeError(f"pull moved {r.fetched_blocks}/{n}, {r.corrupt_blocks} corrupt")
            for key, samples in parts.items():
                samples.append(getattr(r, key))
            bare_s += bare_read("", 1)
            t0 = time.perf_counter()
            for i in range(n):
                np.copyto(dst[i], src[i])
            memcpy_s.append(time.perf_counter() - t0)
        del src, dst

        # Time to first byte: a warm one-block pull, whole protocol, vs a one-block bare
        # READ; interleaved with the same pull asked over gRPC (one call more before
        # it) and with the same pull of a pin A handed over before B was asked (the
        # P/D split's path: A's client pins right after its store, untimed here as it
        # is off the decode side's path; B's daemon then reads at once).
        one = np.asarray(ttfb_hash, dtype="<u8").tobytes()
        ttfb_s: list[float] = []
        ttfb_grpc_s: list[float] = []
        ttfb_ticket_s: list[float] = []
        ttfb_pin_s: list[float] = []
        ticket = b""

        def pull_ticket(hs: bytes) -> Any:
            return pull(hs, ticket)

        lean = "fetch_from_peer" in (cb.local.ops if cb.local is not None else ())
        for _ in range(args.ttfb_repeats):
            for how, samples in (
                (pull, ttfb_s),
                (pull_grpc, ttfb_grpc_s),
                (pull_ticket, ttfb_ticket_s),
            ):
                cb.delete(ns_b, ttfb_hash)
                if how is pull_ticket:
                    handed = ca.hand_over(ns_a, ttfb_hash)
                    assert handed.found_blocks == 1
                    ticket = handed.ticket
                t0 = time.perf_counter()
                r = how(one)
                samples.append(time.perf_counter() - t0)
                assert r.fetched_blocks == 1
                if how is pull:
                    ttfb_pin_s.append(r.pin_s)
                if how is pull_ticket and r.pin_s:
                    raise RuntimeError("a pull of a handed-over pin pinned on A again")
        bare1_s = bare_read("1", args.ttfb_repeats)
        # The same READ after an idle gap: a pull's READ comes after round trips
        # that leave the processes idle, and on VMs like these a copy after idle
        # runs several times slower than back to back (docs/peer-transfer.md).
        bare1_gap_s = bare_read("1", args.ttfb_repeats, gap_s=TTFB_GAP_S)
        got = cb.get(ns_b, hashes[:4])
        want = ca.get(ns_a, hashes[:4])
        if not np.array_equal(got.data, want.data):
            raise RuntimeError("pulled bytes differ from the owner's")
        ca.close()
        cb.close()
        channel.close()

        dm, bn, m = summarize(daemon_s), summarize(bare_s), summarize(memcpy_s)
        t1, b1 = summarize(ttfb_s), summarize(bare1_s)
        return {
            "block_bytes": block_bytes,
            "blocks": n,
            "total_bytes": n * block_bytes,
            "daemon": dm,
            "bare_nixl": bn,
            "memcpy": m,
            "ttfb_daemon": t1,
            "ttfb_daemon_grpc": summarize(ttfb_grpc_s),
            "ttfb_daemon_handed_over": summarize(ttfb_ticket_s),
            "ttfb_pin_median_s": float(np.median(ttfb_pin_s)),
            "ttfb_lean_channel": lean,
            "ttfb_bare_nixl": b1,
            "region_page_bytes": page_bytes,
            "region_bytes": region_bytes,
            "daemon_huge_page_bytes": daemon_huge,
            "bare_huge_page_bytes": [
                owner.hello["huge_page_bytes"],
                puller.hello["huge_page_bytes"],
            ],
            "ttfb_bare_nixl_after_gap": summarize(bare1_gap_s),
            "ratio_vs_bare": bn.median_s / dm.median_s,
            "ratio_vs_memcpy": m.median_s / dm.median_s,
            "bare_vs_memcpy": m.median_s / bn.median_s,
            "overhead_s": dm.median_s - bn.median_s,
            "overhead_per_block_us": (dm.median_s - bn.median_s) / n * 1e6,
            "daemon_parts_median_s": {k: float(np.median(v)) for k, v in parts.items()},
        }
    finally:
        for x in bare:
            x.stop()
        for d in daemons:
            d.stop()
        # Daemons keep their region files for a warm restart: drop the whole folders.
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(regions, ignore_errors=True)


def _pages(r: dict[str, Any]) -> str:
    if r["region_page_bytes"] >= 2 * MiB:
        return f"{r['region_page_bytes'] >> 10} KiB pages (the filesystem's)"
    shares = [
        x / r["region_bytes"] for x in r["daemon_huge_page_bytes"] + r["bare_huge_page_bytes"]
    ]
    if not any(shares):
        return "4 KiB pages"
    return (
        "4 KiB pages collapsed into 2 MiB ones: daemons "
        + " / ".join(f"{x:.0%}" for x in shares[:2])
        + ", bare "
        + " / ".join(f"{x:.0%}" for x in shares[2:])
    )


def _line(name: str, s: Summary, nbytes: int) -> str:
    return (
        f"  {name:<10} median {s.median_s * 1e3:9.2f} ms  ({gbps(nbytes, s.median_s):6.2f} GB/s)  "
        f"p10 {s.p10_s * 1e3:8.2f}  p90 {s.p90_s * 1e3:8.2f}  spread {s.spread:5.2f}"
    )


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.total_mib, args.repeats, args.ttfb_repeats = 64, 3, 10
    if not Path(args.region_dir).is_dir():
        print(
            f"kvstore-bench p2p: --region-dir {args.region_dir} is not a directory", file=sys.stderr
        )
        return 2
    env = dict(os.environ)
    env.update(NIXL_ENV)
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    )
    total = args.total_mib * MiB
    results = []
    print(
        f"p2p: {args.total_mib} MiB per pull, {args.repeats} repeats, UCX_TLS={args.ucx_tls or 'default'}, "
        f"pins over {'the pin channel' if args.pin_channel == 'true' else 'gRPC'}"
    )
    for kib in args.block_kib:
        r = _one_size(args, kib * 1024, total, env)
        results.append(r)
        nbytes = r["total_bytes"]
        print(f"block {kib} KiB x {r['blocks']}: regions on {_pages(r)}")
        print(_line("daemon", r["daemon"], nbytes))
        print(_line("bare NIXL", r["bare_nixl"], nbytes))
        print(_line("memcpy", r["memcpy"], nbytes))
        print(
            f"  daemon/bare NIXL throughput ratio {r['ratio_vs_bare']:.2f}x   vs memcpy {r['ratio_vs_memcpy']:.2f}x"
            f"   (bare NIXL vs memcpy {r['bare_vs_memcpy']:.2f}x)"
        )
        print(
            f"  per-transfer overhead {r['overhead_s'] * 1e3:.2f} ms ({r['overhead_per_block_us']:.1f} us/block); "
            f"time to first byte (1-block pull) {r['ttfb_daemon'].median_s * 1e3:.2f} ms "
            f"[p10 {r['ttfb_daemon'].p10_s * 1e3:.2f}, p90 {r['ttfb_daemon'].p90_s * 1e3:.2f}] "
            f"vs bare 1-block READ {r['ttfb_bare_nixl'].median_s * 1e3:.3f} ms back to back, "
            f"{r['ttfb_bare_nixl_after_gap'].median_s * 1e3:.3f} ms after a "
            f"{TTFB_GAP_S * 1e3:g} ms idle gap"
        )
        g = r["ttfb_daemon_grpc"]
        print(
            f"  first byte after: {'the lean local channel + ' if r['ttfb_lean_channel'] else ''}"
            f"A's pin ({r['ttfb_pin_median_s'] * 1e3:.2f} ms, over "
            f"{'the pin channel' if args.pin_channel == 'true' else 'gRPC'}); the same pull "
            f"asked over gRPC FetchFromPeer (one call more): {g.median_s * 1e3:.2f} ms "
            f"[p10 {g.p10_s * 1e3:.2f}, p90 {g.p90_s * 1e3:.2f}]"
        )
        h = r["ttfb_daemon_handed_over"]
        print(
            f"  first byte of a pin A handed over (HandOver, then FetchFromPeer with its "
            f"ticket: no pin round trip): {h.median_s * 1e3:.2f} ms "
            f"[p10 {h.p10_s * 1e3:.2f}, p90 {h.p90_s * 1e3:.2f}]"
        )
        p = r["daemon_parts_median_s"]
        print(
            f"  inside the daemon pull (medians): pin {p['pin_s'] * 1e3:.1f} ms, NIXL read "
            f"{p['transfer_s'] * 1e3:.1f} ms, xxh3 verify {p['verify_s'] * 1e3:.1f} ms"
        )
    out = results_dir(args.results, "p2p")
    write_json(out / "p2p.json", {"ucx_tls": args.ucx_tls or "default", "results": results})
    print(f"report: {out / 'p2p.json'}")
    return 0


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
