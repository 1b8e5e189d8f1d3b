"""`kvstore-bench soak`'s report: markdown figures and a PNG timeline of the
faults against throughput and p99 load latency (matplotlib, the bench extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_bench.chaos import FaultRecord
from kvstore_bench.soak_client import Sample

WINDOW_S = 5.0
COLORS = {
    "kill9": "tab:red",
    "sigstop": "tab:orange",
    "sigterm": "tab:green",
    "indexer_kill": "tab:purple",
    "client_kill": "tab:brown",
    "peer_kill": "tab:pink",
    "disk_full": "tab:gray",
    "event_chaos": "tab:cyan",
    "netem": "tab:olive",
}


def timeline_png(
    path: Path, t0: float, samples: Sequence[Sample], records: Sequence[FaultRecord]
) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    loads = [s for s in samples if s.op == "load"]
    if not loads:
        return None
    t = np.asarray([s.t_s - t0 for s in loads])
    lat = np.asarray([s.latency_s for s in loads])
    ok = np.asarray([not s.error for s in loads])
    nbytes = np.asarray([s.nbytes for s in loads])
    edges = np.arange(0.0, float(t.max()) + WINDOW_S, WINDOW_S)
    mid = edges[:-1] + WINDOW_S / 2
    idx = np.digitize(t, edges) - 1
    rps, mbps, p99, errs = [], [], [], []
    for i in range(len(mid)):
        sel = idx == i
        rps.append(np.count_nonzero(sel & ok) / WINDOW_S)
        errs.append(np.count_nonzero(sel & ~ok) / WINDOW_S)
        mbps.append(nbytes[sel & ok].sum() / WINDOW_S / 1e6)
        p99.append(float(np.percentile(lat[sel & ok], 99)) * 1e3 if (sel & ok).any() else np.nan)
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(12, 8), sharex=True)
    a1.plot(mid, rps, label="loads ok /s")
    a1.plot(mid, errs, label="loads failed /s", color="tab:red")
    a1b = a1.twinx()
    a1b.plot(mid, mbps, label="MB/s loaded", color="tab:cyan", alpha=0.6)
    a1.set_ylabel("requests / s")
    a1b.set_ylabel("MB / s")
    a1.legend(loc="upper left", fontsize=8)
    a2.plot(mid, p99, color="black")
    a2.set_ylabel(f"p99 load ms ({WINDOW_S:g} s windows)")
    a2.set_yscale("log")
    seen: set[str] = set()
    for r in records:
        if r.skipped:
            continue
        start = r.t_start - t0
        end = max((r.t_serving or r.t_start) - t0, start + 0.3)
        color = COLORS.get(r.kind, "tab:blue")
        for ax in (a1, a2):
            ax.axvspan(start, end, color=color, alpha=0.25)
        a3.barh(
            r.kind, end - start, left=start, color=color, label=None if r.kind in seen else r.kind
        )
        if r.staleness_s:
            a3.barh(r.kind, r.staleness_s, left=end, color=color, alpha=0.35, hatch="//")
        seen.add(r.kind)
    a3.set_xlabel("seconds since the load started (hatched: index staleness after recovery)")
    a3.set_ylabel("fault")
    fig.suptitle("kvstore-bench soak: faults vs throughput and p99 load latency")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _p(d: dict[str, Any] | None, key: str, scale: float = 1.0, unit: str = " s") -> str:
    if not d or d.get(key) is None:
        return "-"
    return f"{d[key] * scale:.3g}{unit}"


def markdown(s: dict[str, Any], png: Path | None) -> str:
    lat = s["load_latency_s"]
    audit = s["audit"]
    lines = [
        "# kvstore-bench soak",
        "",
        f"Command: `{s['command']}`; load average at the end {s['load_average']}; "
        f"{s['duration_s']:.0f} s of load.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests (loads) / succeeded | {s['requests']} / {s['loads_ok']} |",
        f"| bytes served (loaded) | {s['loaded_bytes'] / 1e6:.1f} MB ({s['loaded_blocks']} blocks) |",
        f"| bytes stored | {s['stored_bytes'] / 1e6:.1f} MB ({s['stored_blocks']} blocks) |",
        f"| peer pulls (blocks pulled) | {s['peer_pulls']} ({s['peer_pulled_blocks']}) |",
        f"| **wrong bytes served** | **{s['wrong_bytes']}** ({s['wrong_blocks']} blocks) |",
        f"| **leaks after quiesce** (leases + pins + orphan slot bytes) | **{s['leaks']['total']}** |",
        f"| acknowledged blocks / audited | {s['acked_blocks']} / {audit['blocks']} |",
        f"| audited: present / missing / wrong | {audit['present']} / {audit['missing']} / "
        f"{audit['wrong_blocks']} |",
        f"| missing: node crashed after the ack / no crash (evicted or lost) | "
        f"{audit['missing_after_crash']} / {audit['missing_no_crash']} |",
        f"| client calls past deadline (hangs) | {s['hangs']} |",
        f"| two-phase copies past their lease, discarded (loads / stores) | "
        f"{s['late_copies_discarded']} / {s['late_stores_released']} |",
        "| daemons' evicted / demoted / promoted blocks, expired leases | "
        + " / ".join(str(v) for v in s["daemon_counters"].values())
        + " |",
        f"| tier-above-capacity samples | {s['over_cap_samples']} |",
        f"| p99 load latency, no fault / under faults | {_p(lat['calm'], 'p99', 1e3, ' ms')} / "
        f"{_p(lat['under_fault'], 'p99', 1e3, ' ms')} |",
        f"| index staleness at the end | {s['final_staleness_s']} |",
        "",
        "| fault | injected | skipped | down p50/p99 | recovery p50/p99 | staleness p50/p99 |",
        "|---|---|---|---|---|---|",
    ]
    for kind, f in s["faults"].items():
        lines.append(
            f"| {kind} | {f['injected']} | {f['skipped']} | "
            f"{_p(f['down_s'], 'p50')} / {_p(f['down_s'], 'p99')} | "
            f"{_p(f['recovery_s'], 'p50')} / {_p(f['recovery_s'], 'p99')} | "
            f"{_p(f['staleness_s'], 'p50')} / {_p(f['staleness_s'], 'p99')} |"
        )
    if s["client_errors"]:
        lines += [
            "",
            "Client errors (op:error count, all retried or reported): "
            + ", ".join(f"{k} {v}" for k, v in sorted(s["client_errors"].items())),
        ]
    for u in s["unreachable_after_ready"]:
        lines.append(
            f"\nFinding: {u['target']} ({u['kind']}) printed its ready line but did not answer "
            f"for {u['s']:.2f} s: {u['error']}"
        )
    for note in s["notes"]:
        lines.append(f"\nNote: {note}")
    skipped = {k: f["skip_reason"] for k, f in s["faults"].items() if f["skip_reason"]}
    for kind, why in skipped.items():
        lines.append(f"\nSkipped {kind}: {why}")
    if s.get("failed_checks"):
        lines += ["", "**FAILED:**"] + [f"- {x}" for x in s["failed_checks"]]
    else:
        lines += ["", "All checks passed."]
    if png is not None:
        lines += ["", f"![timeline]({png.name})"]
    return "\n".join(lines) + "\n"
