"""Loopback TCP ports for the processes a bench or a test starts.

A port must be chosen before the process that binds it starts (peers and
restarts need it in advance), so there is always a window in which something
else can take it (in CI a daemon of the soak failed with "Address already in
use"). Ports bound to 0 and released could be lost in that window two ways:

- The kernel hands out a port bound to 0 from the ephemeral range, the same
  range every outgoing connection (a client, a Redis readiness probe, gRPC)
  draws its local port from. Ports here come from just below that range,
  where no connection is given one.
- A port closed after the check can be handed out again by the next check in
  the same process (the soak's indexer and Redis choose theirs after the
  daemons'). A process never hands out the same port twice.

Within the band a port is drawn at random (seeded from os.urandom, so two
processes drawing at once rarely meet) and checked free by binding it.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

BAND_PORTS = 12000  # how far below the ephemeral range ports are drawn from
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default ip_local_port_range starts here
_MIN_PORT = 1024  # never a privileged port

_lock = threading.Lock()
_handed: set[int] = set()  # every port this process has handed out
_rng = random.Random()  # seeded from os.urandom: processes draw differently


def band() -> tuple[int, int]:
    """[low, high) of the ports drawn from: below the ephemeral range."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = _DEFAULT_EPHEMERAL_LOW
    high = max(ephemeral_low, _MIN_PORT + 1000)
    return max(_MIN_PORT, high - BAND_PORTS), high


def _bindable(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now, never handed out before by this process.

    Raises RuntimeError when the band holds fewer than n free ports.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    low, high = band()
    held: list[socket.socket] = []  # held open together: the n ports differ
    try:
        with _lock:
            tries = 0
            while len(held) < n:
                tries += 1
                if tries > 20 * (high - low):
                    raise RuntimeError(
                        f"no {n} free loopback ports in {low}..{high - 1} "
                        f"({len(_handed)} already handed out by this process)"
                    )
                port = _rng.randrange(low, high)
                if port in _handed:
                    continue
                s = _bindable(port)
                if s is not None:
                    held.append(s)
                    _handed.add(port)
            return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """One port as free_ports gives them."""
    return free_ports(1)[0]


def dead_address() -> str:
    """host:port nothing listens on (a connection there is refused at once)."""
    return f"127.0.0.1:{free_port()}"
