"""`kvstore-bench local`: store and load through one running daemon vs memcpy.

Measured in one run, interleaved, so the machine's swings hit both alike:

- memcpy: numpy.copyto of the whole buffer between two pre-faulted private
  arrays (the best plain copy of the same bytes; the reference).
- store: Client.put = PrepareStore RPC + scatter into the shared region + CommitStore RPC.
- store into reserves (where the client has them: the lean channel): the vLLM
  connector's save path (``_Reserves``). Each step scatters into the next
  slots of the reserve held, then sends its commit naming the positions and
  keeping the rest, without waiting; the commit of a step that leaves fewer
  slots than a step asks for the next reserve (the connector's RESERVE_STEPS
  steps within its default store_reserve_blocks: one step at 64 blocks, four
  at 16 or fewer); timed to the last answer read (flush), so every commit has
  landed. Not Client.put: a put must skip blocks the daemon
  has, which only its prepare knows (a reserve cannot, so a reserve's commit
  of a block already there counts it skipped; here none is).
- load: Client.get = PrepareLoad RPC + gather out of the region + Release (not awaited).

The control calls go over the daemon's lean local channel when the client can
open it (docs/local-channel.md), else gRPC: `KVSTORE_LOCAL_CHANNEL=0` measures
gRPC in the same checkout.

Each is run with request steps of `--step-blocks` blocks (default: 64, and the
whole transfer in one step) and with slots in allocation order ("contiguous",
what a fresh daemon gives a request) and shuffled ("scattered", what a daemon
after heavy churn gives). Also: control overhead per request-step (the RPCs
with no bytes copied; with a daemon the bench started, also into a DRAM tier
full of unpinned blocks, each step evicting as many: ``store_step_full_tier``)
and the daemon's lookup of 12,000 hashes, in-process.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
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
WARMUP_ROUNDS = 2  # of each transfer measurement, dropped


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="use a running daemon (default: start one in a temp dir)")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    p.add_argument("--block-kib", type=int, nargs="+", default=[64, 2048], help="block sizes")
    p.add_argument(
        "--step-blocks",
        type=int,
        nargs="+",
        default=[64, 0],
        help="blocks per request-step (0 = all in one)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--results", default="results", help="folder for the JSON report")
    p.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (CI smoke)")


def _spec(block_bytes: int, model: str) -> Any:
    from kvstore.namespace import NamespaceSpec

    return NamespaceSpec(
        model=model,
        dtype="float16",
        block_size_tokens=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        block_bytes=block_bytes,
    )


def _fmt(s: Summary, nbytes: int) -> str:
    return (
        f"{gbps(nbytes, s.median_s):6.2f} GB/s "
        f"[p10-p90 {gbps(nbytes, s.p90_s):.2f}-{gbps(nbytes, s.p10_s):.2f}]"
    )


def _transfer(
    client: Any, block_bytes: int, total_bytes: int, step: int, scattered: bool, repeats: int
) -> dict[str, Any]:
    n = total_bytes // block_bytes
    step = step or n
    ns = client.declare_namespace(_spec(block_bytes, f"bench-{block_bytes}-{step}-{scattered}"))
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    out = np.zeros_like(data)
    ref_dst = np.zeros_like(data)
    mem, store, load, reserved = [], [], [], []
    reserves = bool(getattr(client, "reserves", False))
    # scattered: blocks reach the daemon in a random order, so neighbours in a
    # later load request sit in non-neighbouring slots. The shuffled copy of
    # the data is made here, outside the timed region.
    order = rng.permutation(n) if scattered else np.arange(n)
    data_in_store_order = np.ascontiguousarray(data[order]) if scattered else data
    # The first rounds warm up and are dropped: two, since the first kept one of
    # a fresh run was still slow for memcpy and kvstore alike (1.3x, 1.7x the
    # median: fresh pages behind the arrays and the region, no page faults seen).
    for rep in range(repeats + WARMUP_ROUNDS):
        hashes = np.arange(n, dtype=np.uint64) + np.uint64(rep * n + 1)
        store_hashes = np.ascontiguousarray(hashes[order])
        t = time.perf_counter()
        np.copyto(ref_dst, data)
        t_mem = time.perf_counter() - t
        t = time.perf_counter()
        for s in range(0, n, step):
            client.put(ns, store_hashes[s : s + step], data_in_store_order[s : s + step])
        t_store = time.perf_counter() - t
        t = time.perf_counter()
        for s in range(0, n, step):
            got = client.get(ns, hashes[s : s + step], out=out[s : s + step])
            assert got.found == min(step, n - s), "blocks went missing"
        t_load = time.perf_counter() - t
        if not np.array_equal(out, data):
            raise AssertionError("loaded bytes differ from stored bytes")
        if reserves:
            client.delete(ns, hashes)
            t_reserved = _store_into_reserves(client, ns, store_hashes, data_in_store_order, step)
            out[:] = 0
            got = client.get(ns, hashes, out=out)
            if got.found != n or not np.array_equal(out, data):
                raise AssertionError("blocks stored into reserves came back different")
        # Room for the next round, untimed. delete, not clear: a clear that
        # empties a namespace drops it, and the next round's first put then paid
        # two more round trips (NamespaceNotFound, declare again) that no workload
        # without clears pays (~0.7 ms a round here).
        client.delete(ns, hashes)
        if rep >= WARMUP_ROUNDS:
            mem.append(t_mem)
            store.append(t_store)
            load.append(t_load)
            if reserves:
                reserved.append(t_reserved)
    client.clear(ns)
    m, st, ld = summarize(mem), summarize(store), summarize(load)
    rs = summarize(reserved) if reserved else None
    return {
        "block_bytes": block_bytes,
        "step_blocks": step,
        "slots": "scattered" if scattered else "contiguous",
        "memcpy": m,
        "store": st,
        "load": ld,
        "store_ratio": m.median_s / st.median_s,
        "load_ratio": m.median_s / ld.median_s,
        **(
            {"store_reserved": rs, "store_reserved_ratio": m.median_s / rs.median_s}
            if rs is not None
            else {}
        ),
    }


def _store_into_reserves(
    client: Any, ns: Any, hashes: np.ndarray, data: np.ndarray, step: int
) -> float:
    """Seconds to store ``data`` as the connector's worker does (see the module
    docstring and ``_Reserves``): the first reserve is asked for untimed (an
    engine has one from its last step), the time runs to the last commit's answer."""
    from kvstore.client import scatter

    n, block_bytes = len(hashes), ns.block_bytes
    committed: list[int | Exception] = []
    reserves = _Reserves(client, ns, step)
    t = time.perf_counter()
    for s in range(0, n, step):
        k = min(step, n - s)
        h, base = reserves.take(k)
        rows = np.arange(k)
        written = scatter(
            client.region, h.offsets[base : base + k], data[s : s + k], rows, block_bytes,
            deadline_s=h.deadline_s,
        )  # fmt: skip
        if written < k:
            raise AssertionError(f"a reserve ran out before its {k} blocks were written")
        reserves.commit(h, hashes[s : s + k], base, on_done=committed.append, last=s + k >= n)
    client.flush()
    elapsed = time.perf_counter() - t
    if sum(c for c in committed if isinstance(c, int)) != n:
        raise AssertionError(f"commits into reserves answered {committed}, not {n} blocks")
    reserves.close()
    return elapsed


class _Reserves:
    """Store steps' slots as the connector's worker takes them (docs/vllm.md, "Store
    steps"): in order from the reserve held, each commit keeping the rest
    (``keep_rest``, where the daemon serves it); the commit of a step that leaves
    fewer slots than a step asks, in its frame, for the next reserve of
    RESERVE_STEPS steps within the connector's default ``store_reserve_blocks``
    (one step where keep_rest is not served); its answer is read by the next
    step, waited for only if it has not arrived. The old reserve's leftover
    slots go back with the next frame."""

    def __init__(self, client: Any, ns: Any, step: int) -> None:
        from kvstore_connectors.vllm.config import RESERVE_STEPS, ConnectorConfig

        self.client, self.ns, self.step = client, ns, step
        self.keep = bool(getattr(client, "reserve_keep", False))
        limit = ConnectorConfig().store_reserve_blocks
        self.size = max(step, min(step * RESERVE_STEPS, limit)) if self.keep else step
        self.got: list[Any] = []
        self.held: Any = None
        self.cursor = 0
        client.reserve_store_later(ns, self.size, on_done=self.got.append)
        client.flush()  # untimed: an engine has one from its last step

    def take(self, k: int) -> tuple[Any, int]:
        """The reserve to write ``k`` blocks into and the position of the first."""
        if self.held is None or len(self.held.allocated) - self.cursor < k:
            if not self.got:
                self.client.flush()
            fresh = self.got.pop()
            if isinstance(fresh, Exception):
                raise fresh
            if self.held is not None:
                self.client.release_all([self.held], wait=False, now=False)
            self.held, self.cursor = fresh, 0
        base = self.cursor
        self.cursor += k
        return self.held, base

    def commit(self, h: Any, hashes: np.ndarray, base: int, *, on_done: Any, last: bool) -> None:
        left = len(h.allocated) - self.cursor
        ask = self.size if not last and left < self.step and not self.got else 0
        kept = self.keep and left > 0
        self.client.commit_store_later(
            h,
            hashes,
            positions=np.arange(base, base + len(hashes)),
            keep_rest=kept,
            on_done=on_done,
            reserve_blocks=ask,
            on_reserved=self.got.append,
        )
        if not kept:
            self.held = None

    def close(self) -> None:
        self.client.flush()
        held = [self.held] if self.held is not None else []
        self.client.release_all(held + [h for h in self.got if not isinstance(h, Exception)])


def _full_tier_steps(client: Any, repeats: int, blocks: int = 64) -> Summary:
    """Store steps (PrepareStore + CommitStore of ``blocks`` new 4 KiB blocks) into a
    DRAM tier full of unpinned blocks, as a cache runs once warm: each step's
    prepare evicts ``blocks`` of them. Fills the tier first (untimed), so only
    for a daemon the bench started."""
    from kvstore.v1 import store_pb2 as pb

    ns = client.declare_namespace(_spec(4096, "bench-full-tier"))
    dram = next(t for t in client.stats().tiers if t.tier == pb.TIER_DRAM)
    fill_steps = int(dram.capacity_bytes // (4096 * blocks)) + 2
    base = 1
    for _ in range(fill_steps):  # every slot taken: the last steps evict already
        client.commit_store(
            client.prepare_store(ns, np.arange(base, base + blocks, dtype=np.uint64))
        )
        base += blocks
    samples = []
    for _ in range(repeats * 20):
        hashes = np.arange(base, base + blocks, dtype=np.uint64)
        base += blocks
        t = time.perf_counter()
        client.commit_store(client.prepare_store(ns, hashes))
        samples.append(time.perf_counter() - t)
    client.clear(ns)
    return summarize(samples)


def _control_overhead(client: Any, repeats: int, blocks: int = 64) -> dict[str, Summary]:
    ns = client.declare_namespace(_spec(4096, "bench-control"))
    store_s, load_s, direct_s, lookup_s = [], [], [], []
    for rep in range(repeats * 20):
        hashes = np.arange(blocks, dtype=np.uint64) + np.uint64(rep * blocks + 1)
        t = time.perf_counter()
        h = client.prepare_store(ns, hashes)
        client.commit_store(h)
        store_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        lh = client.prepare_load(ns, hashes)
        client.release(lh, wait=False)
        load_s.append(time.perf_counter() - t)
        # What the connector's worker does (direct_loads): the prefix found in the
        # presence table, its one unanswered message, the check after the copy.
        if getattr(client, "intact", None) is not None:
            t = time.perf_counter()
            lh = client.prepare_load(ns, hashes, pin=False)
            client.intact(lh)
            client.release(lh, wait=False)  # (a no-op for a direct load)
            direct_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        client.lookup(ns, hashes)
        lookup_s.append(time.perf_counter() - t)
    # What the connector's worker does: the commit goes without waiting, its
    # answer read by the next call (here the next step's prepare).
    later_s = []
    base = repeats * 20 * blocks + 1
    for rep in range(repeats * 20):
        hashes = np.arange(blocks, dtype=np.uint64) + np.uint64(base + rep * blocks)
        t = time.perf_counter()
        h = client.prepare_store(ns, hashes)
        commit_later = getattr(client, "commit_store_later", None)
        if commit_later is not None:
            commit_later(h)
        else:  # a client without it (an older checkout measured for reference)
            client.commit_store(h)
        later_s.append(time.perf_counter() - t)
    # What the connector's worker does with reserves (store_reserve_blocks): the
    # step's slots come from the reserve asked for with the last commit, whose
    # answer is read (here at once: back to back, nothing between the steps); the
    # commit names the positions and asks for the next reserve in one frame. Not
    # Client.put: a put must skip blocks the daemon has, which only a prepare knows.
    reserved_s: list[float] = []
    paced_s: list[float] = []
    if getattr(client, "reserves", False):
        base += repeats * 20 * blocks
        reserved_s = _reserved_steps(client, ns, blocks, repeats * 20, base, None)
        # The same with a stand-in forward between the steps (untimed): memory
        # traffic for ~1 ms, as an engine's step has between its store steps. The
        # reserve's answer has arrived by the next step, as in an engine; the
        # step's code runs after caches were flushed, as in an engine.
        base += repeats * 20 * blocks
        work = np.ones(8 * MiB, dtype=np.uint8)
        sink = np.empty_like(work)

        def forward() -> None:
            deadline = time.perf_counter() + 0.001
            while time.perf_counter() < deadline:
                np.copyto(sink, work)

        paced_s = _reserved_steps(client, ns, blocks, repeats * 20, base, forward)
    client.clear(ns)
    return {
        "store_step": summarize(store_s),
        "store_step_nowait": summarize(later_s),
        **({"store_step_reserved": summarize(reserved_s)} if reserved_s else {}),
        **({"store_step_reserved_paced": summarize(paced_s)} if paced_s else {}),
        "load_step": summarize(load_s),
        **({"load_step_direct": summarize(direct_s)} if direct_s else {}),
        "lookup_rpc": summarize(lookup_s),
    }


def _reserved_steps(
    client: Any,
    ns: Any,
    blocks: int,
    steps: int,
    base: int,
    between: Callable[[], None] | None,
) -> list[float]:
    """Store steps into reserves, as the connector's worker makes them
    (``_Reserves``): the step's slots from the reserve held (the next reserve's
    answer read, and waited for if it has not arrived), the commit naming
    positions, keeping the rest and, when few are left, asking for the next
    reserve in one frame. ``between``: untimed work between steps. Not
    Client.put: a put must skip blocks the daemon has, which only a prepare
    knows."""
    reserves = _Reserves(client, ns, blocks)
    times = []
    for rep in range(steps):
        if between is not None:
            between()
        hashes = np.arange(blocks, dtype=np.uint64) + np.uint64(base + rep * blocks)
        t = time.perf_counter()
        h, first = reserves.take(blocks)
        reserves.commit(h, hashes, first, on_done=None, last=rep == steps - 1)
        times.append(time.perf_counter() - t)
    reserves.close()
    return times


def _lookup_in_daemon(repeats: int, n_hashes: int = 12_000) -> Summary:
    """The daemon's own work for a 195k-token lookup: unpack + index probes."""
    from kvstore.config import load_config
    from kvstore.manager import BlockManager
    from kvstore.service import unpack_u64
    from kvstore.tiers.dram import Region

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            environ={},
            assignments=[
                f"dram.path={tmp}/r",
                "dram.capacity_bytes=64MiB",
                "dram.chunk_bytes=4MiB",
            ],
        )
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        manager = BlockManager(config, region)
        ns = manager.declare_namespace(_spec(4096, "bench-lookup"))
        hashes = np.random.default_rng(1).integers(0, 2**63, n_hashes, dtype=np.uint64)
        # 12k present blocks (4 KiB slots: 48 MiB) plus 200k others in the index
        for s in range(0, n_hashes, 4096):
            plan = manager.prepare_store(ns.namespace_id, hashes[s : s + 4096].tolist())
            manager.commit_store(plan.lease_id)
        packed = hashes.tobytes()
        samples = []
        for _ in range(repeats * 10):
            t = time.perf_counter()
            result = manager.lookup(ns.namespace_id, unpack_u64(packed))
            samples.append(time.perf_counter() - t)
            assert result.prefix_blocks == n_hashes
        region.close(unlink=True)
    return summarize(samples)


def run(args: argparse.Namespace) -> int:
    from kvstore.client import Client
    from kvstore.presence import compiled_probes
    from kvstore.process import DaemonProcess

    if args.quick:
        args.total_mib, args.repeats = min(args.total_mib, 32), 3
    total = args.total_mib * MiB
    tmp = tempfile.TemporaryDirectory()
    daemon = None
    address = args.address
    if address is None:
        daemon = DaemonProcess(
            tmp.name,
            dram_bytes=2 * total + 64 * MiB,
            chunk_bytes=max(4 * MiB, max(args.block_kib) * 1024 * 2),
        )
        daemon.start()
        address = daemon.address
    wait_collapsed(address)  # its region in 2 MiB pages before anything is timed
    rows = []
    try:
        with Client(address) as client:
            # the presence table's probes compiled before anything is timed (kvstore.native)
            probes = "compiled" if compiled_probes(120.0) else "numpy"
            print(
                f"kvstore-bench local: {args.total_mib} MiB per measurement, {args.repeats} repeats, "
                f"median [p10-p90]; presence probes: {probes}"
            )
            print("ratio = memcpy time / kvstore time (1.0 = as fast as a plain in-process memcpy)")
            for block_kib in args.block_kib:
                for step in args.step_blocks:
                    for scattered in (False, True):
                        r = _transfer(
                            client, block_kib * 1024, total, step, scattered, args.repeats
                        )
                        rows.append(r)
                        print(
                            f"  block {block_kib:>5} KiB step {r['step_blocks']:>5} {r['slots']:<10} "
                            f"memcpy {_fmt(r['memcpy'], total)} | store {_fmt(r['store'], total)} "
                            f"x{r['store_ratio']:.2f} | load {_fmt(r['load'], total)} x{r['load_ratio']:.2f}"
                        )
                        if "store_reserved" in r:
                            print(
                                f"  {'':>38} store into reserves (the connector's path) "
                                f"{_fmt(r['store_reserved'], total)} x{r['store_reserved_ratio']:.2f}"
                            )
            control = _control_overhead(client, args.repeats)
            if daemon is not None:  # fills the tier: never a daemon the bench was pointed at
                control["store_step_full_tier"] = _full_tier_steps(client, args.repeats)
        print("control overhead per request-step of 64 blocks (RPCs only, no bytes), p50 / p99:")
        for name, s in control.items():
            print(f"  {name:<19} {s.median_s * 1e3:.3f} ms / {s.p99_s * 1e3:.3f} ms")
        lookup = _lookup_in_daemon(args.repeats)
        print(
            f"lookup of 12,000 hashes inside the daemon (unpack + index): "
            f"p50 {lookup.median_s * 1e3:.3f} ms, p99 {lookup.p99_s * 1e3:.3f} ms"
        )
    finally:
        if daemon is not None:
            daemon.stop()
        tmp.cleanup()
    out = results_dir(args.results, "local")
    write_json(out / "local.json", {"transfers": rows, "control": control, "lookup_12000": lookup})
    print(f"report: {out / 'local.json'}")
    return 0
