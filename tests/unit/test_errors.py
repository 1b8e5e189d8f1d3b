"""The error table: each class its own stable reason and a status."""

from __future__ import annotations

import gc

import grpc
import pytest

from kvstore import errors


def all_classes() -> list[type[errors.KVStoreError]]:
    seen: list[type[errors.KVStoreError]] = []
    todo: list[type[errors.KVStoreError]] = [errors.KVStoreError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_class_has_its_own_reason_and_a_status():
    classes = all_classes()
    assert len(classes) == 16  # a new class is added here and to the docstring's drawing
    reasons = [cls.reason for cls in classes]
    assert len(set(reasons)) == len(reasons), reasons
    assert all("reason" in cls.__dict__ for cls in classes)  # none inherits its base's
    assert {cls.reason: cls for cls in classes} == errors.BY_REASON
    for cls in classes:
        assert isinstance(cls.status, grpc.StatusCode)
        assert cls.reason.isascii() and cls.reason.replace("_", "").isalpha()
        assert cls.reason in (errors.__doc__ or ""), f"{cls.__name__} is not drawn"
        if cls is not errors.KVStoreError:
            assert cls.status is not grpc.StatusCode.UNKNOWN, cls
    # the statuses users see, as before this table: the same bad inputs, the same codes
    assert errors.InvalidRequest.status is grpc.StatusCode.INVALID_ARGUMENT
    assert errors.ConfigError.status is grpc.StatusCode.INVALID_ARGUMENT
    assert errors.LeaseExpired.status is grpc.StatusCode.NOT_FOUND
    assert errors.CapacityExhausted.status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.DeadlineExceeded.status is grpc.StatusCode.DEADLINE_EXCEEDED
    assert errors.BackendError.status is grpc.StatusCode.INTERNAL


def test_a_class_without_its_own_reason_is_refused():
    with pytest.raises(AssertionError, match="own reason"):

        class Vague(errors.NotFound):  # would cross the wire as NotFound
            pass

    gc.collect()  # the half-made class leaves NotFound.__subclasses__() now
    assert len(all_classes()) == 16
