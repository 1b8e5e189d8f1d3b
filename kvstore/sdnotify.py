"""systemd's readiness and watchdog protocol (sd_notify), written out in full.

A service started with ``Type=notify`` gets ``NOTIFY_SOCKET`` in its
environment: a Unix datagram socket, given as a path (``/run/systemd/notify``)
or, when it starts with ``@``, as a Linux abstract address. The service sends
newline-separated ``KEY=VALUE`` assignments to it, one datagram each call:

    READY=1                 startup finished: systemd starts the units ordered after it
    STATUS=text             one line shown by ``systemctl status``
    WATCHDOG=1              keep-alive; systemd kills the service if it stops coming
    STOPPING=1              shutdown began (SIGTERM received, draining)
    EXTEND_TIMEOUT_USEC=N   startup or shutdown needs N more microseconds

``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, when set, naming the process it is
meant for) says that the watchdog is armed; the service pings at half that
period so one late tick does not get it killed.

Nothing here depends on libsystemd: the whole protocol is one ``sendto``.
Without ``NOTIFY_SOCKET`` (run by hand, in a container, in tests) every call
is a no-op returning False, so the daemon calls it unconditionally.

Sends never block: the socket is non-blocking, and a full receive queue or a
vanished receiver makes the call return False (logged once) instead of
stalling the event loop that the watchdog is there to watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

from kvstore.errors import ConfigError

log = logging.getLogger(__name__)

# The manager reads one datagram of at most this many bytes per message; a
# STATUS line longer than this is cut rather than the whole datagram refused.
MAX_STATUS_CHARS = 1024


class SdNotifier:
    """A sender of sd_notify messages to one socket address (or none).

    ``notifier = SdNotifier.from_env()`` once at start; ``notifier.ready()``
    once the service answers; ``await notifier.watchdog_loop(...)`` as a task;
    ``notifier.stopping()`` on SIGTERM; ``notifier.close()`` at exit.
    """

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        """``address`` is NOTIFY_SOCKET's value (``None`` = disabled).

        ``watchdog_usec`` is the armed watchdog period in microseconds, or None.
        """
        self._address = _socket_address(address) if address else None
        if watchdog_usec is not None and watchdog_usec <= 0:
            raise ConfigError(f"watchdog period must be > 0 microseconds, got {watchdog_usec}")
        self._watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SdNotifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID from the environment.

        Raises ConfigError when they are set but malformed: a unit that arms
        the watchdog and a daemon that silently ignores it would be killed.
        """
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        watchdog_usec: int | None = None
        raw_usec = env.get("WATCHDOG_USEC", "")
        if raw_usec:
            try:
                watchdog_usec = int(raw_usec)
            except ValueError:
                raise ConfigError(f"WATCHDOG_USEC is not an integer: {raw_usec!r}") from None
            if watchdog_usec <= 0:
                raise ConfigError(f"WATCHDOG_USEC must be > 0, got {watchdog_usec}")
            raw_pid = env.get("WATCHDOG_PID", "")
            if raw_pid:
                try:
                    pid = int(raw_pid)
                except ValueError:
                    raise ConfigError(f"WATCHDOG_PID is not an integer: {raw_pid!r}") from None
                if pid != os.getpid():
                    # Inherited from a parent that systemd watches: not ours to ping.
                    watchdog_usec = None
        return cls(address, watchdog_usec=watchdog_usec)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to notify."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half the armed period; None when not armed or disabled."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram. True when the datagram was sent."""
        if self._address is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value)
            if "\n" in text:
                raise ValueError(f"sd_notify field {key} must be one line, got {text!r}")
            lines.append(f"{key}={text}")
        payload = ("\n".join(lines) + "\n").encode()
        try:
            sock = self._socket()
            sock.sendto(payload, self._address)
        except OSError as exc:
            # Includes BlockingIOError (receiver's queue full) and a receiver that
            # is gone: never stall or crash the service over a notification.
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %s failed: %s", self._display_address(), exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Startup is done: the service answers requests now."""
        return self.notify(**_with_status({"READY": 1}, status))

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began; systemd now waits up to TimeoutStopSec for the exit."""
        return self.notify(**_with_status({"STOPPING": 1}, status))

    def status(self, text: str) -> bool:
        """One free-form line for ``systemctl status``."""
        return self.notify(STATUS=_one_line(text))

    def watchdog(self) -> bool:
        """One keep-alive ping."""
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start (or stop) timeout fires.

        For long steps with a known end, e.g. pre-faulting a large DRAM region.
        """
        if seconds <= 0:
            raise ValueError(f"extend_timeout needs seconds > 0, got {seconds}")
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    async def watchdog_loop(self, healthy: Callable[[], bool] | None = None) -> None:
        """Ping every ``watchdog_interval_s`` until cancelled; return at once if unarmed.

        Runs on the event loop on purpose: a wedged loop stops the pings and
        systemd restarts the service, which is what the watchdog is for. When
        ``healthy()`` returns False the ping is skipped for that tick.
        """
        interval_s = self.watchdog_interval_s
        if interval_s is None:
            return
        while True:
            if healthy is None or healthy():
                self.watchdog()
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        """Close the sending socket (sending again reopens it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SdNotifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            self._sock = sock
        return self._sock

    def _display_address(self) -> str:
        address = self._address or b""
        if address.startswith(b"\0"):
            return "@" + address[1:].decode(errors="replace")
        return address.decode(errors="replace")


def _socket_address(value: str) -> bytes:
    """NOTIFY_SOCKET -> the sockaddr_un path bytes; '@name' is the abstract 'NUL name'."""
    if value.startswith("@"):
        address = b"\0" + value[1:].encode()
    elif value.startswith("/"):
        address = value.encode()
    else:
        # systemd >= 253 also passes vsock:CID:PORT to VMs; a daemon on a host
        # never gets one, and guessing would leave the unit hanging in start.
        raise ConfigError(
            f"NOTIFY_SOCKET must be an absolute path or an @abstract name, got {value!r}"
        )
    # sun_path is 108 bytes on Linux, including the terminating NUL of a path.
    if len(address) > 107 + (1 if address.startswith(b"\0") else 0):
        raise ConfigError(f"NOTIFY_SOCKET address is too long ({len(address)} bytes): {value!r}")
    return address


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_STATUS_CHARS]


def _with_status(fields: dict[str, str | int], status: str | None) -> dict[str, str | int]:
    if status is not None:
        fields["STATUS"] = _one_line(status)
    return fields
