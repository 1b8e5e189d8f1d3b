"""Flow control: priority classes and tenants when every engine is saturated.

The fleet has ``slots`` concurrent requests for this router (engines x
``backend_capacity``, less what the engines run for others: other router
replicas, direct clients). Below that, a request goes at once. At it, requests wait in one bounded FIFO
per (class, tenant); a freed slot goes to the most important class that has
waiters and, within it, to the tenant with the least weighted service so far
(weighted fair share: a tenant of weight 2 gets twice the slots of one of
weight 1 while both wait). A waiter of the lowest class that has not got a
slot within ``low_max_wait_s`` is shed (429 + Retry-After); so is any
request whose queue is full, except the highest class's, which only waits
(its queue is bounded too: a full one is a 503, never a shed of high work to
make room for low).

Single event loop: no locks; every queue and map is bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Tenants remembered for fair share; the least recently seen is forgotten.
MAX_TENANTS = 4096


class Shed(Exception):
    """The request is refused: ``status`` 429 (shed) or 503 (highest class, queue full)."""

    def __init__(self, status: int, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    since: float


@dataclass
class _Tenant:
    served: float = 0.0
    queues: dict[int, deque[_Waiter]] = field(default_factory=dict)


class FlowControl:
    def __init__(
        self,
        *,
        classes: Sequence[str],
        slots: int,
        queue_max: int,
        low_max_wait_s: float,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if not classes:
            raise ValueError("at least one priority class")
        self.classes = list(classes)  # most important first
        self.rank = {c: i for i, c in enumerate(self.classes)}
        self.slots = max(1, slots)
        self.queue_max = queue_max
        self.low_max_wait_s = low_max_wait_s
        self.weights = dict(weights or {})
        self.busy = 0
        self._tenants: dict[str, _Tenant] = {}
        self.waiting = [0] * len(self.classes)
        self.shed = [0] * len(self.classes)

    def set_slots(self, slots: int, floor: int = 1) -> None:
        """The fleet changed (engines up or down, or others' work on them); at least
        ``floor`` (0: every engine is full of work that is not this router's)."""
        self.slots = max(floor, slots)
        self._wake()

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            if len(self._tenants) >= MAX_TENANTS:
                idle = next((k for k, v in self._tenants.items() if not v.queues), None)
                if idle is not None:
                    del self._tenants[idle]
            t = self._tenants[name] = _Tenant()
        return t

    async def acquire(self, klass: str, tenant: str = "") -> None:
        """Wait for a slot; raises Shed. Pair with ``release`` (also after a cancel)."""
        rank = self.rank[klass]
        t = self._tenant(tenant)
        if self.busy < self.slots and not any(self.waiting[: rank + 1]):
            self._grant(t, self.weights.get(tenant, 1.0))
            return
        lowest = rank == len(self.classes) - 1 and len(self.classes) > 1
        q = t.queues.setdefault(rank, deque())
        if self.waiting[rank] >= self.queue_max:
            if rank == 0:
                raise Shed(503, f"the {klass} queue is full ({self.queue_max})", 1.0)
            self.shed[rank] += 1
            raise Shed(429, f"every engine is busy; the {klass} queue is full", 1.0)
        w = _Waiter(asyncio.get_running_loop().create_future(), time.monotonic())
        q.append(w)
        self.waiting[rank] += 1
        try:
            if lowest:
                try:
                    await asyncio.wait_for(asyncio.shield(w.future), self.low_max_wait_s)
                except TimeoutError:
                    if not w.future.done():
                        self.shed[rank] += 1
                        raise Shed(
                            429,
                            f"every engine is busy: {klass} requests waited "
                            f"{self.low_max_wait_s:g} s and are shed",
                            max(1.0, self.low_max_wait_s),
                        ) from None
            else:
                await w.future
        except BaseException:
            if w.future.done() and not w.future.cancelled():
                self.release()  # granted while we were giving up: hand it on
            else:
                w.future.cancel()
            raise
        finally:
            if not w.future.done() or w.future.cancelled():
                self._drop(t, rank, w)

    def release(self) -> None:
        self.busy -= 1
        self._wake()

    def _grant(self, t: _Tenant, tenant_weight: float = 1.0) -> None:
        self.busy += 1
        t.served += 1.0 / tenant_weight

    def _drop(self, t: _Tenant, rank: int, w: _Waiter) -> None:
        q = t.queues.get(rank)
        if q is not None and w in q:
            q.remove(w)
            self.waiting[rank] -= 1
            if not q:
                del t.queues[rank]

    def _wake(self) -> None:
        while self.busy < self.slots:
            rank = next((r for r, n in enumerate(self.waiting) if n), None)
            if rank is None:
                return
            # Fair share within the class: the tenant served least (weighted).
            name, t = min(
                ((n, t) for n, t in self._tenants.items() if t.queues.get(rank)),
                key=lambda nt: (nt[1].served, nt[0]),
            )
            q = t.queues[rank]
            w = q.popleft()
            self.waiting[rank] -= 1
            if not q:
                del t.queues[rank]
            if w.future.done():
                continue
            self._grant(t, self.weights.get(name, 1.0))
            w.future.set_result(None)
