"""Which asyncio event loop a process runs: asyncio's own or uvloop (libuv's).

One place for the daemon (``server.event_loop``) and the router
(``router.event_loop``): the choice, its error when uvloop is missing, and the
policy set before ``asyncio.run``."""

from __future__ import annotations

import asyncio

from kvstore.errors import ConfigError


def use_event_loop(choice: str, setting: str) -> str:
    """Set the loop policy for ``choice`` ("asyncio", "uvloop", "auto": uvloop when
    installed); returns the loop chosen. ``setting`` names the config field in the
    error when "uvloop" is asked for and not installed."""
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                f'{setting} = "uvloop" but uvloop is not installed'
                " (pip install 'kvstore[router]')"
            ) from None
        return "asyncio"
    # libuv's loop: fewer Python frames per read and write than asyncio's selector
    # loop, which is most of what a small local call or a proxied request costs
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"
