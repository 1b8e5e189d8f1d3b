"""`kvstore-bench trace`: write a generated trace to JSONL and print its statistics."""

from __future__ import annotations

import argparse

from kvstore_bench import trace as T


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(T.PRESETS), default="cybergym")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="the smaller CI shape of the preset")
    p.add_argument("--agents", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--tasks", type=int)
    p.add_argument("--stats", metavar="FILE", help="print statistics of an existing trace file")
    p.add_argument("-o", "--output", default="", help="write the trace here (JSONL)")


def run(args: argparse.Namespace) -> int:
    if args.stats:
        trace = T.read(args.stats)
    else:
        params = T.preset_params(
            args.preset, args.quick, agents=args.agents, turns=args.turns, tasks=args.tasks
        )
        trace = T.generate(params, args.seed, args.preset)
        if args.output:
            T.write(trace, args.output)
            print(f"wrote {len(trace.requests)} requests to {args.output}")
    print(T.to_json(T.stats(trace)))
    return 0
