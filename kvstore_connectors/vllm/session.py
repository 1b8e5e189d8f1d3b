"""The connector's link to the daemon: deadlines, one warning, automatic reconnect.

An inference request must never fail because of the cache. Every daemon call
goes through ``DaemonSession.call``, which returns ``None`` instead of raising
when the daemon is unreachable, slow past ``timeout_s`` or answers with an
error; callers then treat it as "no hit" / "not stored". When the link breaks
the session reconnects at once (a new client: new channel, region mapped
again, namespaces declared again) and retries the call, so a daemon restarted
while the engine was idle costs one warning and nothing else. If that fails
too, it logs one warning for the outage, and while the daemon is down calls
cost nothing (no connection attempt) until a doubling retry wait has passed;
the first call after it reconnects and logs that it did.

A restarted daemon may hand out offsets into a different shared-memory file
than the one this process mapped. The session watches the gRPC channel: once
its connection drops, the next call starts a fresh client (gRPC alone would
reconnect silently to whatever daemon now owns the socket), and
``region_is_current`` turns false, so a data path refuses to commit bytes it
may have written into a stale mapping.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore import errors
from kvstore.client import Client, Namespace
from kvstore.namespace import NamespaceSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean the link (or the daemon's state) is gone: reconnect. A lease
# that expired is not one of them: the daemon is fine and said so (LeaseExpired).
_LINK_ERRORS = (errors.Unavailable, errors.NamespaceNotFound, errors.LeaseNotFound)


def _breaks_link(exc: errors.KVStoreError) -> bool:
    return isinstance(exc, _LINK_ERRORS) and not isinstance(exc, errors.LeaseExpired)


class DaemonSession:
    """One client to the daemon, recreated after failures; not thread-safe."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float,
        retry_initial_s: float,
        retry_max_s: float,
        map_region: bool = True,
        map_presence: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        local_channel: bool = True,
        token: str = "",
    ) -> None:
        self.address = address
        self.local_channel = local_channel
        self.token = token  # "" = the Client's own default ($KVSTORE_TOKEN...)
        self._denied_logged = False
        self.timeout_s = timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.map_region = map_region
        self.map_presence = map_presence  # None: as map_region (Client's default)
        self._clock = clock
        self._client: Client | None = None
        self._link = _LinkWatch(None)
        self._namespaces: dict[NamespaceSpec, Namespace] = {}
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._retry_wait_s = retry_initial_s
        self._region_identity: tuple[int, int] | None = None
        self._gpu_identity: tuple[int, int] | None = None  # host-mode GPU pool file
        self._broken_by: str | None = None  # why the link broke, until reconnected
        self.generation = 0  # bumped on every (re)connect: region views must be rebuilt
        self.failures = 0
        self.reconnects = 0

    # ------------------------------------------------------------ state

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def region(self) -> np.ndarray | None:
        """The daemon's shared region as uint8, or None (down, or not mappable here)."""
        return self._client.region if self._client is not None else None

    def client(self) -> Client | None:
        """The live client, connecting first when allowed; None while the daemon is down."""
        if self._client is not None:
            if not self._link.reset and not self._client.local_channel_lost:
                return self._client
            # The connection dropped since the last call (gRPC would silently
            # reconnect, possibly to a restarted daemon with another region; the
            # client would go on over gRPC without its lean channel): start over
            # with a fresh client, at once.
            self.failures += 1
            self._broken_by = "the connection was reset"
            self.disconnect()
        now = self._clock()
        if now < self._retry_at:
            return None
        try:
            client = Client(
                self.address,
                timeout_s=self.timeout_s,
                map_region=self.map_region,
                map_presence=self.map_presence,
                local_channel=self.local_channel,
                token=self.token or None,
            )
        except (errors.KVStoreError, OSError, ValueError) as exc:
            self.failures += 1
            self._note_failure("connect", exc)
            return None
        self._client = client
        self._link = _LinkWatch(client)
        self._namespaces.clear()
        self._region_identity = _identity(client.info.region_path) if client.mapped else None
        self.generation += 1
        self._retry_wait_s = self.retry_initial_s
        if self._down_since is not None:
            self.reconnects += 1
            logger.warning(
                "kvstore: reconnected to %s after %.1fs; the cache is back in use",
                self.address,
                now - self._down_since,
            )
            self._down_since = None
        elif self._broken_by is not None:
            self.reconnects += 1
            logger.warning(
                "kvstore: connection to the daemon at %s broke (%s); reconnected",
                self.address,
                self._broken_by,
            )
        self._broken_by = None
        return client

    def gpu_pool(self) -> Any:
        """The daemon's GPU pool (a CUDA tensor, or numpy in host mode), or None."""
        client = self._client
        if client is None:
            return None
        try:
            pool = client.gpu_pool()
        except errors.KVStoreError as exc:
            self._note_failure("map the GPU pool", exc)
            return None
        if client.info.gpu_region_path and self._gpu_identity is None:
            self._gpu_identity = _identity(client.info.gpu_region_path)
        return pool

    def region_is_current(self) -> bool:
        """Whether the mapped region is still the file the daemon serves offsets of."""
        client = self._client
        if client is None or not client.mapped or self._link.reset:
            return False
        if self._gpu_identity is not None and (
            _identity(client.info.gpu_region_path) != self._gpu_identity
        ):
            return False
        return _identity(client.info.region_path) == self._region_identity

    # ------------------------------------------------------------ calls

    def call(self, what: str, fn: Callable[[Client], T], *, retry: bool = True) -> T | None:
        """``fn(client)``, or None when the daemon is down or the call failed.

        The first link failure of an outage reconnects at once and retries
        (``retry``): a daemon restarted while this process was idle costs
        nothing. Only idempotent calls may retry (not commits).
        """
        for attempt in range(2 if retry else 1):
            client = self.client()
            if client is None:
                return None
            try:
                return fn(client)
            except errors.KVStoreError as exc:
                if not _breaks_link(exc):
                    # The daemon is up but refused this request (full, bad
                    # size...): go on without the cache; keep the link.
                    self.failures += 1
                    if isinstance(exc, errors.PermissionDenied) and not self._denied_logged:
                        # a missing or wrong token: without this the cache is silently off
                        self._denied_logged = True
                        logger.warning(
                            "kvstore: %s denied (token / tenant; logged once): %s", what, exc
                        )
                    logger.debug("kvstore: %s refused: %s", what, exc)
                    return None
                self.failures += 1
                fresh_outage = self._down_since is None
                self.disconnect()
                if retry and attempt == 0 and fresh_outage:
                    self._broken_by = f"{what} failed: {exc}"
                    continue
                self._note_failure(what, exc)
                return None
        return None

    def call_in(
        self, what: str, spec: NamespaceSpec, fn: Callable[[Client, Namespace], T]
    ) -> T | None:
        """``fn(client, namespace)`` with ``spec`` declared on the current daemon first."""
        return self.call(what, lambda c: fn(c, self._declared(c, spec)))

    def namespace(self, spec: NamespaceSpec) -> Namespace | None:
        """The namespace for ``spec``, declared on the current daemon (once per connection)."""
        return self.call_in("declare namespace", spec, lambda c, ns: ns)

    def _declared(self, client: Client, spec: NamespaceSpec) -> Namespace:
        ns = self._namespaces.get(spec)
        if ns is None:
            ns = self._namespaces[spec] = client.declare_namespace(spec)
        return ns

    def disconnect(self) -> None:
        client, self._client = self._client, None
        self._link.close()
        self._link = _LinkWatch(None)
        self._namespaces.clear()
        self._region_identity = None
        self._gpu_identity = None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing a dead channel must not fail the step
                logger.debug("kvstore: closing the client failed: %s", exc)

    def close(self) -> None:
        self.disconnect()

    # ------------------------------------------------------------ failures

    def _note_failure(self, what: str, exc: BaseException) -> None:
        self._broken_by = None
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
            logger.warning(
                "kvstore: daemon at %s unusable (%s failed: %s); running without the cache, "
                "reconnecting in the background",
                self.address,
                what,
                exc,
            )
        self._retry_at = now + self._retry_wait_s
        self._retry_wait_s = min(self._retry_wait_s * 2, self.retry_max_s)


class _LinkWatch:
    """Notices when a client's connection to the daemon drops (gRPC reports it at once)."""

    def __init__(self, client: Client | None) -> None:
        self.reset = False
        self._ready_seen = False
        self._unsubscribe = client.watch_connection(self._on_state) if client is not None else None

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        # Runs on a gRPC thread; a bool flip needs no lock.
        if state == grpc.ChannelConnectivity.READY:
            self._ready_seen = True
        elif self._ready_seen:
            self.reset = True

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
