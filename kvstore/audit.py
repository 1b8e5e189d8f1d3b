"""The audit log of denied requests: who, what, when, rate-limited.

Every refusal at a trust boundary calls ``denied()``: a TCP call without the
cluster secret (``kvstore.auth``), a peer call with a wrong secret, a lean
channel connection from a foreign uid, a lease used by a caller that does not
own it, a file another user owns, a KV events subscriber refused by CURVE
(``kvstore.events.curve``). Each is one structured WARNING line on the
``kvstore.audit`` logger (fields ``audit=denied who what reason``; the record's
timestamp is the when), and one count in ``kvstore_denied_requests_total``
(read at scrape time from ``counts()``, see ``kvstore.metrics``).

A flood must not become a log flood: per (who, reason), one line per
``interval_s``; the denials in between are counted, and the next line says how
many were not logged (``suppressed``). The counter counts every one. The table
of keys is bounded (``max_keys``; a full table forgets the least recently
logged key, whose suppressed count then stays only in the counter).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvstore.audit")

# Reasons (the metric's label values): a fixed set, so the label cannot grow.
TCP_NO_SECRET = "tcp_no_secret"  # a data call over TCP to a daemon without a secret
TCP_WRONG_SECRET = "tcp_wrong_secret"  # a data call over TCP without the right secret
PEER_WRONG_SECRET = "peer_wrong_secret"  # a PeerService call without the right secret
LOCAL_UID = "local_uid"  # a lean-channel connection from a uid that may not use it
LEASE_NOT_OWNER = "lease_not_owner"  # a lease committed/released by another caller
FOREIGN_FILE = "foreign_file"  # a daemon file owned by another user
INDEXER_WRONG_SECRET = "indexer_wrong_secret"  # Register/UnregisterNode without the secret
INDEXER_NODE_REFUSED = "indexer_node_refused"  # another caller's node, or a configured one
PULL_TICKET_REFUSED = "pull_ticket_refused"  # a forged ticket, or one of another namespace
# Identities (kvstore.identity), with principals configured:
NO_IDENTITY = "no_identity"  # no credential, or one no principal has
TENANT_DENIED = "tenant_denied"  # a namespace (tenant, model) the principal may not use
ROLE_DENIED = "role_denied"  # a call of a role (admin, node, router) the principal lacks
EVENTS_CURVE_DENIED = "events_curve_denied"  # a KV events subscriber whose CURVE key is not allowed
# a KV events connection whose handshake failed (no CURVE, or the wrong server key)
EVENTS_HANDSHAKE_FAILED = "events_handshake_failed"
REASONS = (
    TCP_NO_SECRET,
    TCP_WRONG_SECRET,
    PEER_WRONG_SECRET,
    LOCAL_UID,
    LEASE_NOT_OWNER,
    FOREIGN_FILE,
    INDEXER_WRONG_SECRET,
    INDEXER_NODE_REFUSED,
    PULL_TICKET_REFUSED,
    NO_IDENTITY,
    TENANT_DENIED,
    ROLE_DENIED,
    EVENTS_CURVE_DENIED,
    EVENTS_HANDSHAKE_FAILED,
)

MAX_FIELD_CHARS = 200  # who/what come from callers: clipped, as errors clip identifiers


def _clip(value: str) -> str:
    if len(value) <= MAX_FIELD_CHARS:
        return value
    return f"{value[:MAX_FIELD_CHARS]}...({len(value)} characters)"


class _Key:
    __slots__ = ("logged_at_s", "suppressed")

    def __init__(self, logged_at_s: float) -> None:
        self.logged_at_s = logged_at_s
        self.suppressed = 0


class AuditLog:
    def __init__(
        self,
        interval_s: float = 10.0,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[tuple[str, str], _Key] = OrderedDict()
        self._counts = dict.fromkeys(REASONS, 0)
        # Called from the event loop and from other threads (file checks, tier
        # workers): a lock keeps the counts exact.
        self._lock = threading.Lock()

    def denied(self, who: str, what: str, reason: str, key: str | None = None) -> None:
        """Record one refusal. ``key``: who, for rate limiting, when ``who`` varies
        per call for one caller (a TCP peer's port)."""
        if reason not in self._counts:
            raise ValueError(f"unknown audit reason {reason!r} (known: {', '.join(REASONS)})")
        now_s = self._clock()
        with self._lock:
            self._counts[reason] += 1
            k = (key if key is not None else who, reason)
            entry = self._keys.get(k)
            if entry is not None and now_s - entry.logged_at_s < self.interval_s:
                entry.suppressed += 1
                return
            suppressed = 0
            if entry is None:
                while len(self._keys) >= self.max_keys:
                    self._keys.popitem(last=False)
                self._keys[k] = _Key(now_s)
            else:
                suppressed = entry.suppressed
                entry.logged_at_s, entry.suppressed = now_s, 0
                self._keys.move_to_end(k)
        log.warning(
            "denied %s: %s (%s)",
            _clip(who),
            _clip(what),
            reason,
            extra={
                "fields": {
                    "audit": "denied",
                    "who": _clip(who),
                    "what": _clip(what),
                    "reason": reason,
                    "suppressed": suppressed,
                }
            },
        )

    def tracked_keys(self) -> int:
        """(who, reason) pairs currently rate-limited: at most ``max_keys``."""
        with self._lock:
            return len(self._keys)

    def counts(self) -> dict[str, int]:
        """Denials so far by reason, logged or not."""
        with self._lock:
            return dict(self._counts)


# The process's audit log: a daemon is one process (tests start daemons as children).
AUDIT = AuditLog()


def denied(who: str, what: str, reason: str, key: str | None = None) -> None:
    AUDIT.denied(who, what, reason, key)


def tcp_caller(peer: str) -> str:
    """A TCP peer without its port ("ipv4:10.0.0.5"): one caller across connections."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return kind + ":" + rest.rsplit(":", 1)[0]
    return peer


class AuditCollector(Collector):
    """Denied requests by reason (kvstore.audit counts every one, logged or not)."""

    def __init__(self, log: AuditLog | None = None) -> None:
        self.log = log if log is not None else AUDIT

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "kvstore_denied_requests",
            "Requests refused at a trust boundary, by reason (see the kvstore.audit log).",
            labels=["reason"],
        )
        for reason, count in self.log.counts().items():
            family.add_metric([reason], count)
        yield family
