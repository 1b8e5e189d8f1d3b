"""`kvstore router`: run the OpenAI-compatible proxy (config: the [router] section)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file with a [router] table (also KVSTORE_CONFIG)")
    p.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="router.KEY=VALUE",
        help="override one config field; repeatable (e.g. --set router.backends.node-a="
        "http://10.0.0.1:8000)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the merged config as TOML and exit"
    )


def run(args: argparse.Namespace) -> int:
    from kvstore.config import load_config, to_toml
    from kvstore.errors import ConfigError
    from kvstore.event_loop import use_event_loop
    from kvstore.logs import setup_logging

    config = load_config(args.config, assignments=args.assignments)
    if args.print_config:
        sys.stdout.write(to_toml(config))
        return 0
    if not config.router.backends and not config.router.backends_from_indexer:
        raise ConfigError(
            "router.backends is empty: give at least one node id -> engine URL"
            " (or router.backends_from_indexer = true)"
        )
    setup_logging(config.log.level, config.log.format)
    from kvstore.router.proxy import serve

    async def main() -> None:
        task = asyncio.ensure_future(serve(config.router))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    use_event_loop(config.router.event_loop, "router.event_loop")
    asyncio.run(main())
    return 0
