"""The local index's readiness is re-checked between requests, not inside a decision.

A check reads every followed source's status and the tables' size under the index's
lock (0.2 ms p50, up to 4.5 ms measured in the decision bench); a decision used to pay
it inline whenever the last check was older than 50 ms. Now ``keep_checked`` (a task on
the router's loop) re-checks, and ``ready`` only checks itself once the verdict is older
than its bound, so a decision never acts on an older verdict than that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvstore.router import local_index
from kvstore.router.local_index import LocalIndex


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def index() -> Iterator[tuple[LocalIndex, Clock]]:
    clock = Clock()
    li = LocalIndex(max_bytes=1 << 30, clock=clock)
    li.start()  # the ingestion thread runs (following nothing): only the list is missing
    yield li, clock
    li.close()


def test_a_decision_reads_the_last_verdict_until_it_is_older_than_the_bound(
    index: tuple[LocalIndex, Clock],
) -> None:
    li, clock = index
    assert li.check() == (False, "the indexer's sources are not read yet")
    li.listed_at = clock()  # what refresh() records once the indexer's list is read
    # past the old 50 ms re-check interval but within the bound: the decision path
    # does not check (the old code re-checked here and answered True)
    clock.now += 0.1
    assert li.ready() == (False, "the indexer's sources are not read yet")
    assert li.stale_s == pytest.approx(0.1)
    # an explicit check (what keep_checked does) changes the verdict at once
    assert li.check() == (True, "")
    assert li.ready() == (True, "")
    assert li.stale_s == 0.0
    # past the bound a decision checks itself: never an older verdict than that
    li.dropped = "dropped for the test"
    clock.now += local_index._MAX_AGE_S / 2
    assert li.ready() == (True, "")
    clock.now += local_index._MAX_AGE_S
    assert li.ready() == (False, "dropped for the test")


def test_keep_checked_re_checks_on_the_loop(index: tuple[LocalIndex, Clock]) -> None:
    li, clock = index
    li.check()
    li.listed_at = clock()

    async def run() -> None:
        task = asyncio.create_task(li.keep_checked(interval_s=0.001))
        try:
            # the clock stands still: only the task can change the verdict
            for _ in range(2000):
                if li.ready()[0]:
                    break
                await asyncio.sleep(0.001)
            assert li.ready() == (True, "")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())


def test_following_a_new_set_is_checked_at_the_next_decision(
    index: tuple[LocalIndex, Clock],
) -> None:
    li, clock = index
    li.listed_at = clock()
    assert li.ready() == (True, "")
    li.listed_at = None
    li.follow([])  # a new set: the next decision checks at once, whatever the verdict's age
    assert li.ready() == (False, "the indexer's sources are not read yet")
