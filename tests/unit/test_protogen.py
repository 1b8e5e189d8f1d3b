"""The committed generated code must match the protos (regenerate: python -m kvstore.protogen)."""

from __future__ import annotations

import pytest

from kvstore import protogen


def test_generated_code_is_fresh():
    pytest.importorskip("grpc_tools")
    assert protogen.main(["--check"]) == 0
