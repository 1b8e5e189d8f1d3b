"""sd_notify against a real Unix datagram socket standing in for systemd's manager end."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.sdnotify import MAX_STATUS_CHARS, SdNotifier


class Listener:
    """The manager's side: a bound datagram socket and the messages it got."""

    def __init__(self, address: str) -> None:
        self.env_value = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)

    def recv(self, timeout_s: float = 2.0) -> dict[str, str]:
        self.sock.settimeout(timeout_s)
        data = self.sock.recv(4096).decode()
        assert data.endswith("\n"), data
        return dict(line.split("=", 1) for line in data.splitlines())

    def pending(self) -> list[dict[str, str]]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(4096).decode()
                out.append(dict(line.split("=", 1) for line in data.splitlines()))
        except BlockingIOError:
            return out


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
    else:
        address = f"@kvstore-test-{uuid.uuid4().hex}"
    lst = Listener(address)
    yield lst
    lst.sock.close()


def test_ready_status_stopping_arrive_as_systemd_reads_them(listener: Listener) -> None:
    with SdNotifier.from_env({"NOTIFY_SOCKET": listener.env_value}) as notifier:
        assert notifier.enabled
        assert notifier.ready(status="serving on 127.0.0.1:50051")
        assert listener.recv() == {"READY": "1", "STATUS": "serving on 127.0.0.1:50051"}
        assert notifier.status("draining\n 3 calls")
        assert listener.recv() == {"STATUS": "draining 3 calls"}
        assert notifier.stopping()
        assert listener.recv() == {"STOPPING": "1"}
        assert notifier.extend_timeout(2.5)
        assert listener.recv() == {"EXTEND_TIMEOUT_USEC": "2500000"}
        assert notifier.watchdog()
        assert listener.recv() == {"WATCHDOG": "1"}


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = SdNotifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert notifier.ready() is False
    assert notifier.watchdog() is False


def test_watchdog_interval_is_half_the_period_and_respects_watchdog_pid(listener: Listener) -> None:
    env = {"NOTIFY_SOCKET": listener.env_value, "WATCHDOG_USEC": "3000000"}
    assert SdNotifier.from_env(env).watchdog_interval_s == pytest.approx(1.5)
    ours = SdNotifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())})
    assert ours.watchdog_interval_s == pytest.approx(1.5)
    # Armed for another process (a parent): this one must not ping.
    other = SdNotifier.from_env({**env, "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval_s is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NOTIFY_SOCKET": "relative/notify.sock"}, "absolute path or an @abstract"),
        ({"NOTIFY_SOCKET": "vsock:2:1234"}, "absolute path or an @abstract"),
        ({"NOTIFY_SOCKET": "/" + "x" * 107}, "too long"),
        ({"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "soon"}, "WATCHDOG_USEC is not an integer"),
        ({"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "0"}, "WATCHDOG_USEC must be > 0"),
        (
            {"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "10", "WATCHDOG_PID": "me"},
            "WATCHDOG_PID is not an integer",
        ),
    ],
)
def test_malformed_environment_is_a_precise_config_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SdNotifier.from_env(env)


def test_longest_abstract_name_is_accepted_and_delivered() -> None:
    name = ("kvstore-" + uuid.uuid4().hex + "x" * 107)[:107]  # 1 NUL + 107 = all of sun_path
    lst = Listener("@" + name)
    try:
        assert SdNotifier(f"@{name}").ready()
        assert lst.recv() == {"READY": "1"}
    finally:
        lst.sock.close()


def test_multiline_field_is_refused_and_status_is_bounded(listener: Listener) -> None:
    notifier = SdNotifier(listener.env_value)
    with pytest.raises(ValueError, match="one line"):
        notifier.notify(STATUS="a\nREADY=1")
    assert listener.pending() == []  # nothing half-sent
    notifier.status("y" * (MAX_STATUS_CHARS * 3))
    assert len(listener.recv()["STATUS"]) == MAX_STATUS_CHARS
    with pytest.raises(ValueError):
        notifier.extend_timeout(0)


def test_send_to_a_missing_socket_returns_false_without_raising(tmp_path: Path) -> None:
    notifier = SdNotifier(str(tmp_path / "gone.sock"))
    assert notifier.ready() is False
    assert notifier.watchdog() is False


def test_full_receiver_queue_never_blocks_the_sender(listener: Listener) -> None:
    notifier = SdNotifier(listener.env_value)
    started = time.monotonic()
    results = [notifier.status("z" * 1000) for _ in range(5000)]
    elapsed_s = time.monotonic() - started
    assert results[0] is True
    assert results.count(False) > 0, "the unread queue never filled; test proves nothing"
    assert elapsed_s < 5.0
    delivered = listener.pending()
    assert len(delivered) == results.count(True)


async def _pings_within(listener: Listener, want: int, timeout_s: float) -> list[dict[str, str]]:
    """The pings that arrived once ``want`` of them have (or the deadline passed)."""
    pings: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout_s
    while len(pings) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        pings += listener.pending()
    return pings


async def test_watchdog_loop_pings_at_half_the_period(listener: Listener) -> None:
    notifier = SdNotifier(listener.env_value, watchdog_usec=200_000)  # ping every 0.1 s
    assert notifier.watchdog_interval_s == 0.1
    started = time.monotonic()
    task = asyncio.create_task(notifier.watchdog_loop())
    pings = await _pings_within(listener, 4, timeout_s=10.0)
    elapsed_s = time.monotonic() - started
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pings += listener.pending()
    assert all(p == {"WATCHDOG": "1"} for p in pings)
    # Ticks at 0, 0.1, 0.2, 0.3 s at the earliest (a loaded machine only delays
    # them): four took at least 0.3 s, and no more came than the time allows.
    assert len(pings) >= 4 and elapsed_s >= 0.29, (pings, elapsed_s)
    assert len(pings) <= elapsed_s / 0.1 + 2, (pings, elapsed_s)


async def test_watchdog_loop_skips_pings_while_unhealthy(listener: Listener) -> None:
    healthy = False
    notifier = SdNotifier(listener.env_value, watchdog_usec=100_000)
    task = asyncio.create_task(notifier.watchdog_loop(lambda: healthy))
    await asyncio.sleep(0.25)
    assert listener.pending() == []
    healthy = True
    pings = await _pings_within(listener, 2, timeout_s=10.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(pings) >= 2, pings


async def test_watchdog_loop_returns_at_once_when_not_armed(listener: Listener) -> None:
    notifier = SdNotifier(listener.env_value)
    await asyncio.wait_for(notifier.watchdog_loop(), timeout=1.0)
    assert listener.pending() == []
