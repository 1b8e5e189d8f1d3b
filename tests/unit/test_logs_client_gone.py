"""A caller that leaves before its answer is sent is not a daemon error: grpc.aio's
ERROR line with a traceback becomes one INFO line (kvstore.logs.ClientGoneFilter).

The record is the one grpc.aio 1.85 emits (logger, message and traceback as seen
in a daemon's log under tests/integration/test_lifetime_property.py, where a
Clear answered just as its caller's random deadline passed); that race cannot be
forced from outside, so the record is logged here as grpc logs it."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvstore.logs import GRPC_AIO_LOGGER, setup_logging

METHOD = "[/kvstore.v1.StoreService/Clear]"


@pytest.fixture
def captured():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def start(fmt: str) -> io.StringIO:
        setup_logging("info", fmt)
        out = io.StringIO()
        root.handlers[0].setStream(out)  # type: ignore[attr-defined]
        return out

    yield start
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _grpc_logs(message: str) -> None:
    try:
        raise RuntimeError('Failed "execute_batch"')  # stands for cygrpc.ExecuteBatchError
    except RuntimeError:
        logging.getLogger(GRPC_AIO_LOGGER).exception(message, METHOD)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_answer_to_a_caller_that_left_is_one_info_line(captured, fmt: str) -> None:  # type: ignore[no-untyped-def]
    out = captured(fmt)
    _grpc_logs("ExecuteBatchError raised in core by servicer method %s")
    text = out.getvalue()
    assert "Traceback" not in text and "ERROR" not in text, text
    assert text.count("\n") == 1
    if fmt == "json":
        entry = json.loads(text)
        assert entry["level"] == "info" and "exc" not in entry
        assert entry["msg"] == f"an answer was not sent: the caller had left {METHOD}"
    else:
        assert (
            f"INFO {GRPC_AIO_LOGGER}: an answer was not sent: the caller had left {METHOD}" in text
        )


def test_other_grpc_errors_keep_their_level_and_traceback(captured) -> None:  # type: ignore[no-untyped-def]
    out = captured("text")
    _grpc_logs("Unexpected [RuntimeError] raised by servicer method %s")
    text = out.getvalue()
    assert f"ERROR {GRPC_AIO_LOGGER}: Unexpected" in text and "Traceback" in text, text


def test_setting_up_twice_adds_one_filter() -> None:
    setup_logging("info", "text")
    setup_logging("info", "text")
    from kvstore.logs import ClientGoneFilter

    n = sum(isinstance(f, ClientGoneFilter) for f in logging.getLogger(GRPC_AIO_LOGGER).filters)
    assert n == 1
