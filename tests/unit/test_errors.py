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


def _raw_status_calls(source: str, filename: str) -> list[str]:
    """Calls that fail an RPC with a status of their own choosing: ``x.abort(...)``
    given a ``StatusCode``, any ``x.set_code(...)``/``x.set_details(...)``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        args = [*node.args, *(k.value for k in node.keywords)]
        names_a_status = any("StatusCode" in ast.unparse(a) for a in args)
        if name in ("set_code", "set_details") or (name == "abort" and names_a_status):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_only_the_error_table_sets_a_status():
    """Every servicer (store, peer, indexer, router) fails a call through
    ``errors.abort``/``abort_sync``: the class's status and its reason code. A raw
    ``context.abort(StatusCode...)`` would send a status with no reason, which
    clients could only read by its message."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    packages = [p.parent for p in root.glob("*/__init__.py") if p.parent.name != "tests"]
    assert any(p.name == "kvstore" for p in packages)
    found = []
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == "kvstore/errors.py" or "/v1/" in rel:
                continue
            found += _raw_status_calls(path.read_text(), rel)
    assert not found, "status set outside kvstore/errors.py:\n" + "\n".join(found)
    # the check itself sees both forms
    assert (
        len(
            _raw_status_calls(
                "async def f(context):\n"
                "    await context.abort(grpc.StatusCode.NOT_FOUND, 'x')\n"
                "    context.set_code(code)\n"
                "    placement.abort(block)\n",
                "probe.py",
            )
        )
        == 2
    )
