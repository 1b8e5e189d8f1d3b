"""Hit rate of the eviction policies on an agentic trace (``kvstore-bench policy``).

The trace models what the daemon sees from coding agents: every request re-sends
its agent's whole context (one of a few long shared system prompts, then the
agent's own history) plus a few new blocks, agents interleave, and now and then
a one-shot job (a repository scan, a batch summarisation) streams a long unique
context that is never seen again. Each request walks its blocks in order: a
resident block is a hit (``touch``), a missing one is stored (``insert``), and
when the tier is full the coldest unpinned blocks go first, exactly as the
manager drives a policy.

Reported per cache size (a fraction of the trace's distinct blocks), over
several seeds: block hit rate and prefix hit rate (blocks served as part of the
request's longest resident prefix: what actually skips prefill), for each
policy, and each policy's ratio to LRU measured on the same trace in the same
run (median and min..max across seeds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import numpy as np

from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.lru import LRUPolicy
from kvstore.eviction.s3fifo import S3FIFOPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


@dataclass(frozen=True)
class TraceSpec:
    agents: int = 48
    turns: int = 12
    system_prompts: int = 3
    system_blocks: int = 120  # ~15k tokens at 128 tokens per block
    context_blocks: tuple[int, int] = (40, 400)  # an agent's history at its first turn
    turn_blocks: tuple[int, int] = (1, 12)  # new blocks per turn (tool output, reply)
    scan_probability: float = 0.15  # share of requests that are one-shot jobs
    scan_blocks: tuple[int, int] = (300, 1500)


def agentic_trace(spec: TraceSpec, seed: int) -> list[list[Hashable]]:
    """Requests, each the ordered list of its block keys."""
    rng = np.random.default_rng(seed)
    serial = iter(range(1 << 62))
    prompts = [
        [("sys", p, i) for i in range(spec.system_blocks)] for p in range(spec.system_prompts)
    ]
    contexts: list[list[Hashable]] = []
    for agent in range(spec.agents):
        prompt = prompts[int(rng.integers(spec.system_prompts))]
        history = [
            ("agent", agent, next(serial)) for _ in range(int(rng.integers(*spec.context_blocks)))
        ]
        contexts.append(prompt + history)
    turns_left = [spec.turns] * spec.agents
    requests: list[list[Hashable]] = []
    while any(turns_left):
        if rng.random() < spec.scan_probability:
            requests.append(
                [("scan", next(serial)) for _ in range(int(rng.integers(*spec.scan_blocks)))]
            )
            continue
        live = [a for a, left in enumerate(turns_left) if left]
        agent = live[int(rng.integers(len(live)))]
        turns_left[agent] -= 1
        new = [("agent", agent, next(serial)) for _ in range(int(rng.integers(*spec.turn_blocks)))]
        contexts[agent] = contexts[agent] + new
        requests.append(list(contexts[agent]))
    return requests


@dataclass
class Outcome:
    accesses: int = 0
    hits: int = 0
    prefix_hits: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.accesses if self.accesses else 0.0


def simulate(policy: EvictionPolicy, requests: list[list[Hashable]], capacity: int) -> Outcome:
    resident: set[Hashable] = set()
    out = Outcome()
    started = time.perf_counter()
    for request in requests:
        in_prefix = True
        # Blocks the request hit are leased while it loads them: never its victims.
        # Blocks it stores are committed (unpinned) as they arrive, as in the daemon.
        pinned = set()
        for key in request:
            out.accesses += 1
            if key in resident:
                out.hits += 1
                out.prefix_hits += in_prefix
                policy.touch(key)
                pinned.add(key)
                continue
            in_prefix = False
            if len(resident) >= capacity:
                victim = _first_unpinned(policy.victims(), pinned)
                if victim is None:
                    continue  # everything resident is this request's: not stored
                policy.remove(victim)
                resident.discard(victim)
            policy.insert(key)
            resident.add(key)
    out.seconds = time.perf_counter() - started
    return out


def _first_unpinned(victims: Iterator[Hashable], pinned: set[Hashable]) -> Hashable | None:
    for key in victims:
        if key not in pinned:
            return key
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies", default="lru,s3fifo", help="comma-separated; lru is the reference"
    )
    parser.add_argument("--seeds", type=int, default=3, help="traces per cache size")
    parser.add_argument(
        "--cache-fractions",
        default="0.05,0.1,0.2,0.4",
        help="cache sizes as fractions of the trace's distinct blocks",
    )
    parser.add_argument("--agents", type=int, default=TraceSpec.agents)
    parser.add_argument("--turns", type=int, default=TraceSpec.turns)
    parser.add_argument("--scan-probability", type=float, default=TraceSpec.scan_probability)


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or "lru" not in names:
        print(
            f"policies must include lru and be among {sorted(POLICIES)}: {names}", file=sys.stderr
        )
        return 2
    fractions = [float(f) for f in args.cache_fractions.split(",")]
    spec = TraceSpec(agents=args.agents, turns=args.turns, scan_probability=args.scan_probability)
    traces = [agentic_trace(spec, seed) for seed in range(args.seeds)]
    distinct = [len({k for r in t for k in r}) for t in traces]
    accesses = [sum(map(len, t)) for t in traces]
    print(
        f"agentic trace: {spec.agents} agents x {spec.turns} turns, {spec.system_prompts} shared "
        f"system prompts of {spec.system_blocks} blocks, scans p={spec.scan_probability}; "
        f"{args.seeds} seeds, median {statistics.median(accesses):.0f} block accesses, "
        f"{statistics.median(distinct):.0f} distinct blocks"
    )
    print(
        f"{'cache':>6} {'policy':>7} {'hit':>7} {'prefix hit':>10} {'hit/LRU (min..max)':>22} "
        f"{'prefix/LRU (min..max)':>24} {'us/access':>9}"
    )
    for fraction in fractions:
        results: dict[str, list[Outcome]] = {n: [] for n in names}
        for trace, n_distinct in zip(traces, distinct, strict=True):
            capacity = max(1, int(fraction * n_distinct))
            for name in names:
                results[name].append(simulate(POLICIES[name](), trace, capacity))
        for name in names:
            rows = results[name]
            hit = statistics.median(o.hit_rate for o in rows)
            prefix = statistics.median(o.prefix_hit_rate for o in rows)
            ratios = [
                o.hit_rate / max(r.hit_rate, 1e-12)
                for o, r in zip(rows, results["lru"], strict=True)
            ]
            pratios = [
                o.prefix_hit_rate / max(r.prefix_hit_rate, 1e-12)
                for o, r in zip(rows, results["lru"], strict=True)
            ]
            us = statistics.median(o.seconds / o.accesses * 1e6 for o in rows)
            print(
                f"{fraction:>6.2f} {name:>7} {hit:>7.1%} {prefix:>10.1%} "
                f"{_ratio(ratios):>22} {_ratio(pratios):>24} {us:>9.2f}"
            )
    return 0


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}..{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench policy", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
