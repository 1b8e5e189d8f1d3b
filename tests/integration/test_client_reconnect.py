"""A client outlives its daemon's restart and is served again at once (found by
`kvstore-bench soak`: gRPC's reconnect backoff and its process-wide connection
pool kept clients failing after the daemon was back)."""

from __future__ import annotations

import time

import pytest

from kvstore import errors
from kvstore.client import RECONNECT_BACKOFF_MAX_MS, Client
from kvstore.process import DaemonProcess


def _call_while_down(c: Client, down_s: float) -> int:
    """Keep calling a dead daemon (as an engine does); how many calls failed."""
    failed = 0
    end = time.monotonic() + down_s
    while time.monotonic() < end:
        try:
            c.stats()
        except errors.Unavailable:
            failed += 1
        time.sleep(0.05)
    return failed


@pytest.mark.slow
def test_a_client_that_lived_through_an_outage_is_served_soon_after_the_restart(
    daemon_factory,
) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = daemon_factory(tcp=False)
    c = Client(d.address)
    c.stats()
    d.kill()
    # 20 s of failures: gRPC's default backoff has grown to ~10 s by then (the old
    # client then waited >= 3 s after the restart; the bound is 1 s, +20% jitter).
    assert _call_while_down(c, 20.0) > 10
    d.start()
    ready = time.monotonic()
    while True:
        try:
            c.stats()
            break
        except errors.Unavailable:
            assert time.monotonic() - ready < 2 * RECONNECT_BACKOFF_MAX_MS / 1000, (
                "the client still fails 2 backoff periods after the daemon came back"
            )
            time.sleep(0.02)
    c.close()


def test_a_new_client_after_a_restart_does_not_inherit_another_ones_backoff(
    daemon_factory,
) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = daemon_factory(tcp=False)
    old = Client(d.address)
    d.kill()
    assert _call_while_down(old, 3.0) > 0  # this client's connection is in backoff now
    d.start()
    with Client(d.address) as fresh:  # Hello on its first connection: no retry needed
        assert fresh.stats().node_id == d.name
    old.close()
