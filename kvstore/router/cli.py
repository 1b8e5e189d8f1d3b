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

    loop = config.router.event_loop
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ConfigError(
                    'router.event_loop = "uvloop" but uvloop is not installed '
                    "(pip install 'kvstore[router]')"
                ) from None
        else:
            # libuv's loop: fewer Python frames per read/write than asyncio's
            # selector loop, which is most of what the proxy itself costs
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(main())
    return 0
