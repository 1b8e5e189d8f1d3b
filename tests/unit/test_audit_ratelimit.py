"""kvstore.audit's rate limit and bounds, on an injected clock."""

from __future__ import annotations

import logging

import pytest

from kvstore.audit import LEASE_NOT_OWNER, TCP_NO_SECRET, AuditLog, tcp_caller


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "kvstore.audit"]  # type: ignore[attr-defined]


def test_one_line_per_who_and_reason_per_interval_with_the_suppressed_count(caplog):
    caplog.set_level(logging.WARNING, "kvstore.audit")
    clock = Clock()
    log = AuditLog(interval_s=10.0, clock=clock)
    for _ in range(50):
        log.denied(
            "ipv4:10.0.0.5:4000",
            "/kvstore.v1.StoreService/GetInline",
            TCP_NO_SECRET,
            key="ipv4:10.0.0.5",
        )
    log.denied("ipv4:10.0.0.6:4000", "/x", TCP_NO_SECRET, key="ipv4:10.0.0.6")  # another who
    log.denied("ipv4:10.0.0.5:4000", "lease 3", LEASE_NOT_OWNER, key="ipv4:10.0.0.5")
    got = lines(caplog)
    assert [(f["who"], f["reason"], f["suppressed"]) for f in got] == [
        ("ipv4:10.0.0.5:4000", TCP_NO_SECRET, 0),
        ("ipv4:10.0.0.6:4000", TCP_NO_SECRET, 0),
        ("ipv4:10.0.0.5:4000", LEASE_NOT_OWNER, 0),
    ]
    clock.now_s += 9.9
    log.denied("ipv4:10.0.0.5:1", "/y", TCP_NO_SECRET, key="ipv4:10.0.0.5")
    assert len(lines(caplog)) == 3
    clock.now_s += 0.1
    log.denied("ipv4:10.0.0.5:2", "/z", TCP_NO_SECRET, key="ipv4:10.0.0.5")
    last = lines(caplog)[-1]
    assert (last["what"], last["suppressed"]) == ("/z", 50)  # 49 + the one at 9.9 s
    assert log.counts()[TCP_NO_SECRET] == 53 and log.counts()[LEASE_NOT_OWNER] == 1


def test_the_key_table_is_bounded_and_fields_are_clipped(caplog):
    caplog.set_level(logging.WARNING, "kvstore.audit")
    log = AuditLog(max_keys=8, clock=Clock())
    for i in range(100):
        log.denied(f"uid {i}", "x" * 10_000, LEASE_NOT_OWNER)
    assert len(lines(caplog)) == 100  # all distinct callers: each logged once
    assert max(len(f["what"]) for f in lines(caplog)) < 300
    assert log.counts()[LEASE_NOT_OWNER] == 100
    assert len(log._keys) == 8


def test_an_unknown_reason_is_a_bug_not_a_new_label():
    with pytest.raises(ValueError, match="unknown audit reason"):
        AuditLog().denied("who", "what", "made_up")


def test_tcp_caller_drops_the_port():
    assert tcp_caller("ipv4:10.0.0.5:4242") == "ipv4:10.0.0.5"
    assert tcp_caller("ipv6:[::1]:4242") == "ipv6:[::1]"
    assert tcp_caller("unix:/tmp/x") == "unix:/tmp/x"
