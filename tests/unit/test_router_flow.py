"""The router's flow control: priority order, fair share between tenants,
shedding only the lowest class, and no slot lost to a cancelled waiter."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.router.flow import FlowControl, Shed

CLASSES = ["high", "normal", "low"]


async def _served_order(flow: FlowControl, requests: list[tuple[str, str]]) -> list[int]:
    order: list[int] = []

    async def one(i: int, klass: str, tenant: str) -> None:
        await flow.acquire(klass, tenant)
        order.append(i)

    tasks = [asyncio.create_task(one(i, k, t)) for i, (k, t) in enumerate(requests)]
    await asyncio.sleep(0)  # all queued
    for _ in requests:
        await asyncio.sleep(0)
        flow.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


async def test_a_freed_slot_goes_to_the_most_important_class_then_fairly_between_tenants():
    flow = FlowControl(classes=CLASSES, slots=1, queue_max=8, low_max_wait_s=60)
    await flow.acquire("normal", "x")  # the one slot is busy
    order = await _served_order(
        flow,
        [("low", "a"), ("normal", "a"), ("normal", "a"), ("normal", "b"), ("high", "c")],
    )
    # high first; then normal alternating a, b (b has had nothing); low last
    assert order == [4, 1, 3, 2, 0]


async def test_weighted_fair_share():
    flow = FlowControl(
        classes=CLASSES, slots=1, queue_max=16, low_max_wait_s=60, weights={"big": 2.0}
    )
    await flow.acquire("normal", "other")
    reqs = [("normal", "big")] * 6 + [("normal", "small")] * 6
    order = await _served_order(flow, reqs)
    first_six = ["big" if i < 6 else "small" for i in order[:6]]
    assert first_six.count("big") == 4  # twice the share while both wait


async def test_only_the_lowest_class_is_shed_and_the_highest_never_for_room():
    flow = FlowControl(classes=CLASSES, slots=1, queue_max=1, low_max_wait_s=0.05)
    await flow.acquire("high")
    with pytest.raises(Shed) as low:
        await flow.acquire("low")  # waited its bound, no slot: shed
    assert low.value.status == 429 and low.value.retry_after_s >= 1
    waiting_normal = asyncio.create_task(flow.acquire("normal"))
    await asyncio.sleep(0)
    with pytest.raises(Shed) as full:
        await flow.acquire("normal")  # its queue (1) is full
    assert full.value.status == 429
    waiting_high = asyncio.create_task(flow.acquire("high"))
    await asyncio.sleep(0)
    with pytest.raises(Shed) as high_full:
        await flow.acquire("high")
    assert high_full.value.status == 503  # a full high queue is never a 429 shed
    flow.release()
    await waiting_high  # high before the waiting normal
    assert not waiting_normal.done()
    flow.release()
    await waiting_normal
    assert flow.shed == [0, 1, 1]


async def test_a_cancelled_waiter_loses_no_slot():
    flow = FlowControl(classes=CLASSES, slots=1, queue_max=4, low_max_wait_s=60)
    await flow.acquire("normal")
    gone = asyncio.create_task(flow.acquire("normal"))
    await asyncio.sleep(0)
    gone.cancel()  # the client disconnected while queued
    with pytest.raises(asyncio.CancelledError):
        await gone
    flow.release()
    assert flow.busy == 0 and flow.waiting == [0, 0, 0]
    await asyncio.wait_for(flow.acquire("low"), 1.0)  # the slot is free
