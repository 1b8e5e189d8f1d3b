"""`kvstore-bench`: one entry point, one subcommand per benchmark.

Each subcommand lives in its own module of ``kvstore_bench/`` exposing
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their subcommand runs, so a benchmark whose optional dependencies are
missing (vLLM, NIXL, LMCache...) does not break the others.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "local": ("kvstore_bench.local", "store/load throughput of one daemon through the client"),
    "tiers": ("kvstore_bench.tiers", "DRAM/disk tier throughput, demotion and promotion"),
    "gpu": ("kvstore_bench.gpu", "GPU tier moves (HBM <-> pinned DRAM) vs a torch copy"),
    "policy": ("kvstore_bench.policy", "eviction policies compared on a trace"),
    "indexer": ("kvstore_bench.indexer", "indexer event ingest and Score latency"),
    "p2p": ("kvstore_bench.p2p", "peer-to-peer block transfer (NIXL) between daemons"),
    "vllm": ("kvstore_bench.vllm_bench", "vLLM (CPU build) with and without the KVStore connector"),
    "agentic": (
        "kvstore_bench.agentic",
        "agentic trace replayed on a cluster of daemons, per routing strategy",
    ),
    "router": (
        "kvstore_bench.router_bench",
        "kvstore router: decision cost for 195k-token contexts, proxy overhead on vLLM CPU",
    ),
    "compare": ("kvstore_bench.compare", "store/load vs Redis, LMCache and Mooncake, same blocks"),
    "sglang": (
        "kvstore_bench.sglang_bench",
        "SGLang HiCache storage: the kvstore backend vs SGLang's file backend, same pages",
    ),
    "soak": (
        "kvstore_bench.soak",
        "a cluster under agentic load with faults injected: wrong bytes, leaks, recovery",
    ),
    "trace": (
        "kvstore_bench.trace_cli",
        "generate an agentic trace file (JSONL) and print its statistics",
    ),
}


def _load(name: str):
    module_name = SUBCOMMANDS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore-bench",
        description="kvstore benchmarks. Figures are ratios to references measured in the same run.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported (they pull heavy deps).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = _load(name)
            if module is not None:
                module.add_arguments(p)
            else:
                p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # Python dies on SIGTERM without unwinding: the daemons, indexers and
    # regions a bench started would be left behind. Exiting through SystemExit
    # runs their clean-up (the benches stop what they start in finally blocks).
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    module = _load(args.command)
    if module is None:
        print(
            f"kvstore-bench {args.command}: module {SUBCOMMANDS[args.command][0]} is not "
            "available in this installation",
            file=sys.stderr,
        )
        return 2
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
