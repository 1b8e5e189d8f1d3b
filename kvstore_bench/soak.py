"""`kvstore-bench soak`: a cluster under agentic load with faults injected.

    kvstore-bench soak --minutes 30                  # the full soak
    kvstore-bench soak --quick                       # CI smoke, <= 3 minutes

N daemons (DRAM + disk tiers, peers on, one secret) and the indexer
(kvstore_bench/chaos.py: Cluster), M client processes replaying an agentic trace
through the real client at a target rate (kvstore_bench/soak_client.py), and a seeded
fault schedule injected while they run (kvstore_bench/chaos.py: schedule, Chaos).

Checked, continuously and at the end (docs/soak.md):
  - every loaded byte against its content-derived payload (wrong bytes: 0);
  - acknowledged stores, audited at the end: present and right, or missing
    (evicted, lost with a crashed DRAM), never wrong;
  - after quiesce, on every daemon: no lease, no pinned block, and every used
    slot owned by a block (used_bytes == blocks x slot bytes, DRAM and disk);
  - tier usage never above its capacity (sampled every second);
  - the indexer's view converges to the daemons' own after each fault (staleness);
  - no client call past its deadline (+ slack): hangs.
Exit status 0 only when all of them hold.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import queue
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import errors
from kvstore.client import Client
from kvstore.tiers.dram import slot_bytes_for
from kvstore_bench import _common
from kvstore_bench import chaos as C
from kvstore_bench import soak_client as SC

DISK_ALIGN_BYTES = 4096  # disk slots are rounded up to this (O_DIRECT)
MAX_SAMPLES = 2_000_000  # client operations kept for the figures (bounded)
QUIESCE_TIMEOUT_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30)")
    p.add_argument(
        "--quick", action="store_true", help="CI smoke: 2 minutes of load, every fault kind once"
    )
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second, all clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-kib", type=int, default=16)
    p.add_argument("--block-tokens", type=int, default=2048)
    p.add_argument("--max-blocks", type=int, default=64, help="longest request, in blocks")
    p.add_argument("--dram-mib", type=int, default=16, help="DRAM tier per node")
    p.add_argument("--disk-mib", type=int, default=32, help="disk tier per node")
    p.add_argument("--lease-ttl-s", type=float, default=2.0, help="daemons' default lease")
    p.add_argument("--quarantine-s", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=5.0, help="clients' call timeout")
    p.add_argument("--indexer", choices=["memory", "redis"], default="memory")
    p.add_argument(
        "--redis-url", default="", help="with --indexer redis; default: a redis-server started here"
    )
    p.add_argument(
        "--faults",
        default=",".join(C.FAULT_KINDS),
        help=f"comma-separated fault kinds (default all: {','.join(C.FAULT_KINDS)}); '' = none",
    )
    p.add_argument("--fault-interval-s", type=float, default=0.0, help="default: from duration")
    p.add_argument("--daemon-log-level", default="warning", help="the daemons' log.level")
    p.add_argument("--results", default="results")
    p.add_argument("--no-plot", action="store_true")


class Collector:
    """Aggregates the client processes' reports (one thread, a bounded queue)."""

    def __init__(self, q: Any) -> None:
        self.q = q
        self.samples: list[SC.Sample] = []
        self.wrong_blocks = 0
        self.wrong_bytes = 0
        self.hangs = 0
        self.late_copies = 0
        self.late_stores = 0
        self.acked_blocks = 0
        self.acked: list[tuple[str, float, list[int]]] = []
        self.reports = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def add_wrong(self, blocks: int, nbytes: int) -> None:
        self.wrong_blocks += blocks
        self.wrong_bytes += nbytes

    def _take(self, rep: SC.Report) -> None:
        self.reports += 1
        room = MAX_SAMPLES - len(self.samples)
        self.samples.extend(rep.samples[: max(0, room)])
        self.add_wrong(rep.wrong_blocks, rep.wrong_bytes)
        self.hangs += rep.hangs
        self.late_copies += rep.late_copies
        self.late_stores += rep.late_stores
        self.acked_blocks += rep.acked_blocks
        self.acked.extend(rep.acked)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Empty):
                self._take(self.q.get(timeout=0.2))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        while True:
            try:
                self._take(self.q.get_nowait())
            except queue.Empty:
                return


class Monitor:
    """Every second: each daemon's Stats (caps) and RSS; a thread."""

    def __init__(self, cluster: C.Cluster, interval_s: float = 1.0) -> None:
        self.cluster = cluster
        self.faulting: set[str] = set()  # set by the chaos loop: targets down on purpose
        self.exits: list[dict[str, Any]] = []  # daemons that exited by themselves
        self._seen_exit: set[int] = set()
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self.over_cap: list[dict[str, Any]] = []
        self.max_rss_bytes: dict[str, int] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for nd in self.cluster.nodes:
                proc = nd.daemon.proc
                if (
                    proc is not None
                    and proc.poll() is not None
                    and nd.name not in self.faulting
                    and proc.pid not in self._seen_exit
                ):
                    self._seen_exit.add(proc.pid)
                    self.exits.append(
                        {"t": time.time(), "node": nd.name, "rc": proc.returncode,
                         "log_tail": nd.daemon.log_tail(40)}
                    )  # fmt: skip
                s = node_stats(nd.daemon.address)
                if s is None:
                    continue
                row = {"t": time.time(), "node": nd.name, **s}
                if len(self.rows) < 100_000:
                    self.rows.append(row)
                for tier in s["tiers"]:
                    if tier["used_bytes"] > tier["capacity_bytes"]:
                        self.over_cap.append({"t": row["t"], "node": nd.name, **tier})
                rss = _rss_bytes(nd.daemon.proc.pid if nd.daemon.proc else 0)
                self.max_rss_bytes[nd.name] = max(self.max_rss_bytes.get(nd.name, 0), rss)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def node_stats(address: str) -> dict[str, Any] | None:
    """The daemon's public Stats, as a dict (None when it does not answer)."""
    try:
        with Client(address, timeout_s=1.0, map_region=False) as c:
            s = c.stats()
    except errors.KVStoreError:
        return None
    return {
        "active_leases": int(s.active_leases),
        "expired_leases": int(s.expired_leases),
        "evicted_blocks": int(s.evicted_blocks),
        "demoted_blocks": int(s.demoted_blocks),
        "promoted_blocks": int(s.promoted_blocks),
        "stored_blocks": int(s.stored_blocks),
        "loaded_blocks": int(s.loaded_blocks),
        "tiers": [
            {
                "tier": _tier(t.tier),
                "capacity_bytes": int(t.capacity_bytes),
                "used_bytes": int(t.used_bytes),
                "blocks": int(t.blocks),
                "pinned_blocks": int(t.pinned_blocks),
            }
            for t in s.tiers
        ],
    }


def _tier(value: int) -> str:
    from kvstore.v1 import store_pb2 as pb

    return pb.Tier.Name(value).removeprefix("TIER_").lower()  # type: ignore[arg-type]


def leaks_of(s: dict[str, Any], block_bytes: int) -> dict[str, int]:
    """What a quiet daemon must not hold: leases, pins, slots no block owns."""
    slot = {
        "dram": slot_bytes_for(block_bytes),
        "disk": -(-block_bytes // DISK_ALIGN_BYTES) * DISK_ALIGN_BYTES,
    }
    out = {"leases": s["active_leases"], "pinned_blocks": 0, "orphan_slot_bytes": 0}
    for t in s["tiers"]:
        out["pinned_blocks"] += t["pinned_blocks"]
        if t["tier"] in slot:
            out["orphan_slot_bytes"] += abs(t["used_bytes"] - t["blocks"] * slot[t["tier"]])
    return out


def quiesce(cluster: C.Cluster, block_bytes: int) -> dict[str, Any]:
    """Wait (bounded) for every lease to expire and be reaped; the leaks left then."""
    time.sleep(cluster.lease_ttl_s + cluster.quarantine_s + 0.5)
    deadline = time.monotonic() + QUIESCE_TIMEOUT_S
    t0 = time.monotonic()
    while True:
        per_node: dict[str, Any] = {}
        for nd in cluster.nodes:
            s = node_stats(nd.daemon.address)
            per_node[nd.name] = (
                {"unreachable": 1} if s is None else {**leaks_of(s, block_bytes), "stats": s}
            )
        total = sum(
            v.get("leases", 0)
            + v.get("pinned_blocks", 0)
            + v.get("orphan_slot_bytes", 0)
            + v.get("unreachable", 0)
            for v in per_node.values()
        )
        if total == 0 or time.monotonic() > deadline:
            return {"total": total, "waited_s": round(time.monotonic() - t0, 2), "nodes": per_node}
        time.sleep(0.5)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    a = np.asarray(values)
    return {
        "n": len(values),
        "p50": round(float(np.percentile(a, 50)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
        "max": round(float(a.max()), 3),
    }


def summarize(
    args: argparse.Namespace,
    t0: float,
    col: Collector,
    chaos: C.Chaos,
    mon: Monitor,
    leaks: dict[str, Any],
    audit: dict[str, int],
    planned: list[C.Planned],
    final_staleness_s: float | None,
    notes: list[str],
) -> dict[str, Any]:
    loads = [s for s in col.samples if s.op == "load"]
    ok_loads = [s for s in loads if not s.error]
    stores = [s for s in col.samples if s.op == "store" and not s.error]
    pulls = [s for s in col.samples if s.op == "pull"]
    windows = [
        (r.t_start, (r.t_serving or r.t_start) + (r.staleness_s or 0.0))
        for r in chaos.records
        if not r.skipped
    ]

    def under_fault(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    faulted = [s.latency_s for s in ok_loads if under_fault(s.t_s)]
    calm = [s.latency_s for s in ok_loads if not under_fault(s.t_s)]
    by_kind: dict[str, Any] = {}
    for kind in sorted({r.kind for r in chaos.records}):
        rs = [r for r in chaos.records if r.kind == kind]
        done = [r for r in rs if not r.skipped and "error" not in r.detail]
        by_kind[kind] = {
            "injected": len(done),
            "skipped": len([r for r in rs if r.skipped]),
            "failed": len([r for r in rs if "error" in r.detail]),
            "skip_reason": next((r.skipped for r in rs if r.skipped), ""),
            "down_s": _percentiles([r.down_s for r in done]),
            "recovery_s": _percentiles([r.recovery_s for r in done]),
            "staleness_s": _percentiles([r.staleness_s for r in done if r.staleness_s is not None]),
            "not_converged": len([r for r in done if r.staleness_s is None]),
        }
    errors_by_kind: dict[str, int] = {}
    for s in col.samples:
        if s.error:
            errors_by_kind[f"{s.op}:{s.error}"] = errors_by_kind.get(f"{s.op}:{s.error}", 0) + 1
    wall_s = max((s.t_s for s in col.samples), default=t0) - t0
    return {
        "command": "kvstore-bench soak " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else []),
        "load_average": _loadavg(),
        "params": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "duration_s": round(wall_s, 1),
        "notes": notes,
        "requests": len(loads),
        "loads_ok": len(ok_loads),
        "loaded_blocks": sum(s.blocks for s in ok_loads),
        "loaded_bytes": sum(s.nbytes for s in ok_loads),
        "stored_blocks": sum(s.blocks for s in stores),
        "stored_bytes": sum(s.nbytes for s in stores),
        "peer_pulls": len(pulls),
        "peer_pulled_blocks": sum(s.blocks for s in pulls if not s.error),
        "client_errors": errors_by_kind,
        "wrong_blocks": col.wrong_blocks + audit.get("wrong_blocks", 0),
        "wrong_bytes": col.wrong_bytes,
        "hangs": col.hangs,
        "late_copies_discarded": col.late_copies,
        "late_stores_released": col.late_stores,
        "acked_blocks": col.acked_blocks,
        "audit": audit,
        "leaks": {"total": leaks["total"], "waited_s": leaks["waited_s"]},
        "leaks_by_node": {
            n: {k: v for k, v in d.items() if k != "stats"} for n, d in leaks["nodes"].items()
        },
        # over the whole run: a restart resets a daemon's counters, summed across it
        "daemon_counters": counters_over_restarts(
            mon.rows
            + [{"node": n, **d["stats"]} for n, d in leaks["nodes"].items() if "stats" in d],
            ("evicted_blocks", "demoted_blocks", "promoted_blocks", "expired_leases"),
        ),
        "over_cap_samples": len(mon.over_cap),
        "unexpected_exits": mon.exits,
        "max_rss_bytes": mon.max_rss_bytes,
        "faults_planned": len(planned),
        "faults": by_kind,
        "final_staleness_s": final_staleness_s,
        "load_latency_s": {"calm": _percentiles(calm), "under_fault": _percentiles(faulted)},
        # restarted daemons that did not answer at once after their ready line
        "unreachable_after_ready": [
            {
                "kind": r.kind,
                "target": r.target,
                "s": r.detail["unreachable_after_ready_s"],
                "error": r.detail["unreachable_after_ready_error"],
            }
            for r in chaos.records
            if "unreachable_after_ready_s" in r.detail
        ],
        "fault_log": [asdict(r) for r in chaos.records],
    }


def counters_over_restarts(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, int]:
    """Counters summed over every daemon lifetime: samples in time order per node;
    a value below the previous one means the daemon restarted from 0."""
    total = dict.fromkeys(keys, 0)
    last: dict[tuple[str, str], int] = {}
    for row in rows:
        for key in keys:
            v = int(row.get(key, 0))
            prev = last.get((row["node"], key), 0)
            total[key] += v - prev if v >= prev else v
            last[(row["node"], key)] = v
    return total


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def passed(summary: dict[str, Any]) -> list[str]:
    """The checks that failed ([] = the soak passed)."""
    failed = []
    if summary["wrong_blocks"] or summary["wrong_bytes"]:
        failed.append(
            f"wrong bytes served: {summary['wrong_bytes']} ({summary['wrong_blocks']} blocks)"
        )
    if summary["leaks"]["total"]:
        failed.append(f"leaks after quiesce: {summary['leaks_by_node']}")
    if summary["hangs"]:
        failed.append(f"{summary['hangs']} client calls past their deadline")
    for e in summary["unexpected_exits"]:
        failed.append(f"{e['node']} exited by itself (rc {e['rc']}): {e['log_tail'][-1500:]}")
    if summary["over_cap_samples"]:
        failed.append(f"{summary['over_cap_samples']} samples with a tier above its capacity")
    for kind, f in summary["faults"].items():
        if f["not_converged"]:
            failed.append(f"{kind}: index not converged within {C.CONVERGE_TIMEOUT_S:.0f} s")
        if f["failed"]:
            failed.append(f"{kind}: {f['failed']} injections failed (see fault_log)")
    for r in summary["fault_log"]:
        d = r["detail"]
        if (
            r["kind"] == "sigterm"
            and "probe_blocks_after" in d
            and (d["probe_blocks_after"] < d["probe_blocks_before"])
        ):
            failed.append(
                f"graceful restart of {r['target']} kept {d['probe_blocks_after']} of "
                f"{d['probe_blocks_before']} probe blocks"
            )
    if summary["final_staleness_s"] is None:
        failed.append("index not converged at the end")
    if not summary["loads_ok"]:
        failed.append("no load succeeded")
    return failed


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.minutes = min(args.minutes, 2.0)
    duration_s = args.minutes * 60
    kinds = [k for k in args.faults.split(",") if k]
    unknown = sorted(set(kinds) - set(C.FAULT_KINDS))
    if unknown:
        raise SystemExit(f"--faults: unknown {unknown}; choose from {','.join(C.FAULT_KINDS)}")
    interval_s = args.fault_interval_s or (
        max(8.0, duration_s / (len(kinds) + 1)) if args.quick else 30.0
    )
    block_bytes = args.block_kib * 1024
    out_dir = _common.results_dir(args.results, "soak")
    tmp = Path(tempfile.mkdtemp(prefix="kvsoak-"))
    notes: list[str] = []
    cluster = C.Cluster(
        tmp,
        args.nodes,
        dram_bytes=args.dram_mib << 20,
        disk_bytes=args.disk_mib << 20,
        chunk_bytes=max(block_bytes, 1 << 20),
        lease_ttl_s=args.lease_ttl_s,
        quarantine_s=args.quarantine_s,
        backend=args.indexer,
        redis_url=args.redis_url,
        tmpfs_disk="disk_full" in kinds,
        log_level=args.daemon_log_level,
    )
    if cluster.tmpfs_note:
        notes.append(cluster.tmpfs_note)
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=1000)
    col = Collector(q)
    procs: list[Any] = []
    chaos: C.Chaos | None = None
    mon = Monitor(cluster)
    try:
        cluster.start()
        chaos = C.Chaos(
            cluster,
            seed=args.seed,
            block_bytes=block_bytes,
            block_tokens=args.block_tokens,
            log_path=out_dir / "faults.jsonl",
            on_wrong=col.add_wrong,
        )
        if "netem" in kinds:
            notes.append(chaos.netem_note)
        plan = C.schedule(
            args.seed,
            duration_s,
            kinds,
            [nd.name for nd in cluster.nodes],
            interval_s,
            once=args.quick and not args.fault_interval_s,
        )
        chaos.log("plan", plan=[asdict(p) for p in plan], seed=args.seed)
        t0 = time.time()
        end_s = t0 + duration_s
        for w in range(args.clients):
            wa = SC.WorkerArgs(
                worker=w,
                workers=args.clients,
                nodes=cluster.addresses,
                indexer=cluster.indexer.address,
                seed=args.seed,
                rate_per_s=args.rate / args.clients,
                end_s=end_s,
                block_bytes=block_bytes,
                block_tokens=args.block_tokens,
                max_blocks=args.max_blocks,
                timeout_s=args.timeout_s,
                peer_timeout_s=2.0,
                # past the lease and its quarantine: the slots may be reused by then
                slow_copy_s=args.lease_ttl_s + args.quarantine_s + 0.5,
            )
            p = ctx.Process(target=SC.main, args=(wa, q), daemon=True)
            p.start()
            procs.append(p)
        col.thread.start()
        mon.thread.start()
        print(
            f"soak: {args.nodes} daemons, {args.clients} clients at {args.rate:g} req/s, "
            f"{duration_s:.0f} s, {len(plan)} faults planned; logs in {tmp}",
            file=sys.stderr,
        )
        for p_ in plan:
            wait_s = t0 + p_.at_s - time.time()
            if wait_s > 0:
                time.sleep(wait_s)
            if time.time() >= end_s:
                break
            mon.faulting.add(p_.target)
            try:
                rec = chaos.inject(p_)
            finally:
                mon.faulting.discard(p_.target)
            print(
                f"  t={rec.t_start - t0:6.1f}s {rec.kind:<13} {rec.target:<8} "
                + (
                    f"skipped: {rec.skipped}"
                    if rec.skipped
                    else f"down {rec.down_s:.2f}s recovery {rec.recovery_s:.2f}s "
                    f"staleness {rec.staleness_s}"
                    + (f" error {rec.detail['error']}" if "error" in rec.detail else "")
                ),
                file=sys.stderr,
            )
        for p in procs:
            p.join(max(1.0, end_s - time.time() + 60))
            if p.is_alive():
                col.hangs += 1  # a client that does not finish is a hang
                p.kill()
                p.join(5)
        col.stop()
        mon.stop()
        leaks = quiesce(cluster, block_bytes)
        crashes: dict[str, list[float]] = {}
        for r in chaos.records:
            if r.kind in ("kill9", "peer_kill") and not r.skipped:
                crashes.setdefault(r.target, []).append(r.t_start)
        audit = SC.audit(cluster.addresses, col.acked, block_bytes, args.block_tokens, crashes)
        final = chaos.converge()
        summary = summarize(args, t0, col, chaos, mon, leaks, audit, plan, final, notes)
        failed = passed(summary)
        summary["failed_checks"] = failed
        _common.write_json(out_dir / "soak.json", summary)
        from kvstore_bench import soak_report

        png = (
            None
            if args.no_plot
            else soak_report.timeline_png(out_dir / "timeline.png", t0, col.samples, chaos.records)
        )
        (out_dir / "report.md").write_text(soak_report.markdown(summary, png))
        print(soak_report.markdown(summary, png), file=sys.stderr)
        print(f"soak: results in {out_dir}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if chaos is not None:
            chaos.close()
        cluster.close()
        logs = out_dir / "logs"
        logs.mkdir(exist_ok=True)
        for f in [*tmp.glob("*/*.log"), *tmp.glob("*.log")]:
            with contextlib.suppress(OSError):
                shutil.copy(f, logs / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
