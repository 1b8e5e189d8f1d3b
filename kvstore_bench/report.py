"""Markdown reports and PNG plots for `kvstore-bench agentic` and `compare`.

matplotlib is a bench-only dependency, imported here only; without it the
markdown report is still written and the plots are skipped with a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvstore_bench import _common
from kvstore_bench.causes import CAUSES


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# -- compare -----------------------------------------------------------------


def compare_report(
    results: list[dict[str, Any]], summary: dict[str, Any], out_dir: Path, command: str
) -> str:
    lines = [
        "# kvstore-bench compare",
        "",
        f"Command: `{command}`",
        "",
        "All figures **measured** on this machine in one run. Each system ran in its own",
        "subprocess with the same blocks; `x memcpy` = op time / memcpy time of the same bytes",
        "measured in that process just before (higher is better; 1.0 = as fast as memcpy).",
        "",
        "| system | block | store GB/s | load GB/s | store x memcpy | load x memcpy | "
        "1-block store p50 / p99 | 1-block load p50 / p99 | spread (load p10-p90 / p50) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['system']} | {r['block_bytes']} | error: {r['error'][:120]} | | | | | | |"
            )
            continue
        nbytes = r["block_bytes"] * r["n_blocks"]
        mem = r["memcpy"]["median_s"]
        load = r["load"]
        lines.append(
            f"| {r['system']} | {_size(r['block_bytes'])} | "
            f"{_common.gbps(nbytes, r['store']['median_s']):.2f} | "
            f"{_common.gbps(nbytes, load['median_s']):.2f} | "
            f"{mem / r['store']['median_s']:.2f} | {mem / load['median_s']:.2f} | "
            f"{_us(r['store_one']['median_s'])} / {_us(r['store_one']['p99_s'])} | "
            f"{_us(r['load_one']['median_s'])} / {_us(r['load_one']['p99_s'])} | "
            f"{(load['p90_s'] - load['p10_s']) / load['median_s']:.2f} |"
        )
    lines += ["", "## kvstore vs the best peer (ratios of the x-memcpy figures)", ""]
    for bb, entry in summary.items():
        if "kvstore_load_over_best_peer" in entry:
            lines.append(
                f"- {_size(int(bb))} blocks: loads **{entry['kvstore_load_over_best_peer']:.2f}x** "
                f"the best peer ({entry['best_peer_load']}), stores "
                f"{entry['kvstore_store_over_best_peer']:.2f}x ({entry['best_peer_store']})."
            )
    for bb, entry in summary.items():
        if "kvstore_load_over_best_service_peer" in entry:
            lines.append(
                f"- {_size(int(bb))} blocks, against peers that serve from another process "
                f"(not LMCache's in-process CPU tier): loads "
                f"**{entry['kvstore_load_over_best_service_peer']:.2f}x** the best "
                f"({entry['best_service_peer_load']})."
            )
    for bb, entry in summary.items():
        for other, r in entry.get("lmcache_kvstore_over", {}).items():
            lines.append(
                f"- {_size(int(bb))} chunks, LMCache + kvstore vs {other}: loads "
                f"**{r['load']:.2f}x**, stores {r['store']:.2f}x."
            )
    goal = summary.get(str(2 << 20), {}).get("kvstore_load_over_best_peer")
    if goal is not None:
        lines.append(
            f"- Goal (loads >= 3x the best peer at 2 MiB blocks): "
            f"{'**met**' if goal >= 3 else '**not met**'} ({goal:.2f}x)."
        )
    lines += ["", "## Settings", ""]
    seen = set()
    for r in results:
        if "settings" in r and r["system"] not in seen:
            seen.add(r["system"])
            lines.append(
                f"- {r['system']}: " + "; ".join(f"{k}: {v}" for k, v in r["settings"].items())
            )
    plot = _compare_plot(results, out_dir)
    if plot:
        lines += ["", f"![load latency CDF]({plot.name})"]
    md = "\n".join(lines) + "\n"
    (out_dir / "report.md").write_text(md)
    return md


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 0.01 else f"{s * 1e3:.1f} ms"


def _compare_plot(results: list[dict[str, Any]], out_dir: Path) -> Path | None:
    plt = _plt()
    ok = [r for r in results if "error" not in r]
    if plt is None or not ok:
        return None
    sizes = sorted({r["block_bytes"] for r in ok})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, bb in zip(axes[0], sizes, strict=True):
        for r in ok:
            if r["block_bytes"] != bb:
                continue
            samples = np.sort(np.asarray(r["raw"]["load_one_s"])) * 1e6
            ax.plot(samples, np.linspace(0, 1, len(samples)), label=r["system"])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("one-block load latency (µs, log)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{_size(bb)} blocks")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "load_latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- agentic -----------------------------------------------------------------

TIERS = ("gpu", "dram", "disk", "peer", "recompute")


def agentic_report(result: dict[str, Any], out_dir: Path, command: str) -> str:
    strategies = result["strategies"]
    lines = [
        f"# kvstore-bench agentic — preset `{result['preset']}`",
        "",
        f"Command: `{command}`",
        "",
        f"Trace: {result['trace']['requests']} requests, {result['trace']['agents']} agents "
        f"(incl. subagents), median input {result['trace']['input_tokens_median']:.0f} tokens, "
        f"{_pct(result['trace']['reuse_ge_90_share'])} of requests reuse >= 90% of an earlier "
        f"input; at most {_pct(result['trace']['prefix_reuse_bound'])} of input tokens can come "
        "from any prefix cache (the rest is new tool output and first sight of a task).",
        "",
        f"Cluster: {result['cluster']['nodes']} nodes, each a real `kvstore serve` daemon "
        f"(DRAM {result['cluster']['dram_blocks']} blocks"
        + (
            f", disk {result['cluster']['disk_blocks']} blocks"
            if result["cluster"]["disk_blocks"]
            else ""
        )
        + f") + a modelled engine GPU cache of {result['cluster']['gpu_blocks']} blocks; "
        f"block = {result['cluster']['block_tokens']} tokens, stored as "
        f"{result['cluster']['block_bytes']} real bytes (a real block would be "
        f"{result['cluster']['real_block_bytes'] / 2**20:.0f} MiB). Indexer: "
        f"{result['cluster']['indexer']}. Peer pulls: {result['cluster']['peers']}.",
        "",
        "**Measured** (against the real daemons and indexer): where each input token came from,",
        "hit rates, blocks moved and verified. **Modelled** (kvstore_bench/costmodel.py, parameters below):",
        "TTFT and throughput.",
        "",
        "| strategy | local prefix hit | GPU hit | from some tier | "
        + " | ".join(f"{t}" for t in TIERS)
        + " | recomputed tokens | TTFT p50 / p90 (modelled) | throughput tok/s (modelled) |",
        "|---|---:|---:|---:|" + "---:|" * len(TIERS) + "---:|---:|---:|",
    ]
    for name, s in strategies.items():
        shares = s["token_shares"]
        lines.append(
            f"| {name} | {_pct(s['local_prefix_hit_rate'])} | {_pct(shares['gpu'])} | "
            f"{_pct(s['cached_share'])} | "
            + " | ".join(_pct(shares[t]) for t in TIERS)
            + f" | {s['tokens_recomputed']:,} | {s['ttft_s']['p50']:.2f} s / {s['ttft_s']['p90']:.2f} s"
            f" | {s['throughput_tokens_per_s']:,.0f} |"
        )
    lines += _recompute_breakdown(strategies)
    goals = result.get("goals")
    if goals:
        lines += ["", "## Goals (CyberGym-like preset; published reference in brackets)", ""]
        if result.get("settings", {}).get("quick") or result.get("settings", {}).get("agents"):
            lines += [
                "The goals are defined on the full preset; this run used a smaller "
                "shape, so these lines only show the mechanics.",
                "",
            ]
        for g in goals:
            lines.append(
                f"- {g['what']}: {g['value']} — {'met' if g['met'] else '**not met**'} "
                f"(goal {g['goal']}) [{g['reference']}]"
            )
        if result.get("limits"):
            lines += ["", "What limits them:", ""] + [f"- {x}" for x in result["limits"]]
    lines += ["", "## Measured run facts", ""]
    for name, s in strategies.items():
        peer = s.get("peer", {})
        pulls = (
            f"{peer.get('fetches', 0):,} FetchFromPeer calls ({peer.get('failures', 0)} failed, "
            f"transport {_transports(peer.get('transports', {}))}, p50 "
            f"{peer.get('fetch_s_p50', 0.0) * 1e3:.1f} ms) fetched "
            f"{peer.get('fetched_blocks', 0):,} blocks ({peer.get('fetched_bytes', 0) / 2**20:.1f} "
            f"MiB, {peer.get('corrupt_blocks', 0)} corrupt), of which "
            f"{s['blocks_pulled']:,} extended the prefix and were served"
        )
        lines.append(
            f"- {name}: {s['blocks_loaded']:,} blocks loaded from daemons and "
            f"{s['blocks_stored']:,} stored ({s.get('blocks_refused', 0):,} refused: no room); "
            f"{pulls}; daemon counters {s.get('daemon_counters') or '-'}; nodes holding "
            f"each distinct block (mean over the run) {s.get('daemon_copies_per_block', 0.0):.2f}; "
            f"bytes verified: {s['verified_blocks']:,} blocks, {s['verify_failures']} failures; "
            f"wall {s['wall_s']:.1f} s; indexer Score p50 {s['score_latency_s']['p50'] * 1e3:.2f} ms."
        )
    lines += ["", "## Cost model parameters (modelled figures only)", "", "```"]
    lines += [f"{k} = {v}" for k, v in result["cost_model"].items()]
    lines += ["```"]
    plots = agentic_plots(result, out_dir)
    if plots:
        lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    md = "\n".join(lines) + "\n"
    (out_dir / "report.md").write_text(md)
    return md


def _transports(t: dict[str, int]) -> str:
    if not t:
        return "-"
    out = ", ".join(f"{k} x {v}" for k, v in sorted(t.items()))
    return out + (" **(NOT NIXL: fallback)**" if set(t) - {"nixl"} else "")


# Causes in report order, with their labels (kvstore_bench.causes.CAUSES).
def _recompute_breakdown(strategies: dict[str, Any]) -> list[str]:
    """Each strategy's recomputed tokens by cause, as shares of all input tokens."""
    have = [s for s in strategies.values() if "recompute_causes" in s]
    if not have:
        return []
    used = [c for c in CAUSES if any(s["recompute_causes"].get(c) for s in have)]
    lines = [
        "",
        "## Why tokens were recomputed (measured; share of all input tokens)",
        "",
        "| strategy | recomputed | " + " | ".join(used) + " | pooled-LRU reference |",
        "|---|---:|" + "---:|" * len(used) + "---:|",
    ]
    for name, s in strategies.items():
        if "recompute_causes" not in s:
            continue
        sh = s["recompute_cause_shares"]
        lines.append(
            f"| {name} | {_pct(s['token_shares']['recompute'])} | "
            + " | ".join(_pct(sh.get(c, 0.0)) for c in used)
            + f" | {_pct(1.0 - s.get('pooled_lru_cached_share', 0.0))} |"
        )
    lines += [""] + [f"- `{c}`: {CAUSES[c]}" for c in used]
    lines.append(
        "- pooled-LRU reference: the share a single LRU as large as the whole cluster's "
        "daemon tiers (GPU caches for approximate-gpu-only), fed the same requests in the "
        "same order and never holding a block twice, would have recomputed (computed in "
        "the same run): what capacity alone costs."
    )
    return lines


def agentic_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _plt()
    if plt is None:
        return []
    strategies = result["strategies"]
    names = list(strategies)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    local = [strategies[n]["local_prefix_hit_rate"] * 100 for n in names]
    cached = [strategies[n]["cached_share"] * 100 for n in names]
    x = np.arange(len(names))
    ax.bar(x - 0.2, local, 0.4, label="local prefix hit")
    ax.bar(x + 0.2, cached, 0.4, label="from some tier")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("% of input tokens (measured)")
    ax.set_ylim(0, 100)
    ax.legend()
    ax.set_title("Hit rate per routing strategy")
    fig.tight_layout()
    paths.append(out_dir / "hit_rate.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = np.zeros(len(names))
    for tier in TIERS:
        vals = np.array([strategies[n]["token_shares"][tier] * 100 for n in names])
        ax.bar(names, vals, bottom=bottom, label=tier)
        bottom += vals
    ax.set_ylabel("% of input tokens (measured)")
    ax.set_title("Where input tokens came from")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "tier_shares.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        samples = np.sort(np.asarray(strategies[n]["ttft_samples_s"]))
        if len(samples):
            ax.plot(samples, np.linspace(0, 1, len(samples)), label=n)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("TTFT (s, modelled, log)")
    ax.set_ylabel("CDF")
    ax.set_title("TTFT per routing strategy (modelled)")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
