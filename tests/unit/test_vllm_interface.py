"""The connector's vLLM interface check (kvstore_connectors.vllm.compat), against vLLM 0.33.0's
source and the installed 0.32.0.

tests/fixtures/vllm/0.33.0.json was written by ``scripts/vllm_interface_fixture.py``
from the vllm-0.33.0 wheel (``pip download vllm==0.33.0 --no-deps``; a GPU build,
so it is read, not installed): the members of its ``KVConnectorBase_V1`` and the
fields of its KV event structs. The extractor itself is checked against the live
0.32.0 class, where both can run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvstore.errors import ConfigError
from kvstore.events import wire
from kvstore_connectors.vllm import compat

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "vllm" / "0.33.0.json"
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


def _fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _script() -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import vllm_interface_fixture

        return vllm_interface_fixture
    finally:
        sys.path.pop(0)


# The members the connector defines (tests below check KVStoreConnector defines them).
IMPLEMENTED = set(compat.REQUIRED) | set(compat.OPTIONAL)


def test_033_base_class_matches_what_the_connector_relies_on():
    fx = _fixture()
    assert fx["vllm_version"] == "0.33.0"
    base = fx["KVConnectorBase_V1"]
    assert compat.interface_problems(base, IMPLEMENTED) == []
    assert set(compat.REQUIRED_INIT_ATTRIBUTES) <= set(fx["init_attributes"])
    # 0.33's sleep-mode hooks are there, with the parameters the connector takes.
    for name, (kind, params) in compat.OPTIONAL.items():
        assert base[name]["kind"] == kind and tuple(base[name]["params"]) == params, name
    compat.check_vllm(base, "0.33.0", IMPLEMENTED)  # listed: no error


def test_033_block_stored_fields_are_kvstores():
    """kvstore publishes BlockStored in vLLM's format: same fields, same order, the
    same ones optional (0.33 adds lookahead_token_ids, optional and last)."""
    events = _fixture()["events"]
    for ours, name in (
        (wire.BlockStored, "BlockStored"),
        (wire.BlockRemoved, "BlockRemoved"),
        (wire.AllBlocksCleared, "AllBlocksCleared"),
        (wire.EventBatch, "EventBatch"),
    ):
        theirs = events[name]["fields"]
        assert list(ours.__struct_fields__) == [f["name"] for f in theirs], name
        num_defaults = len(ours.__struct_defaults__)
        optional = [f["name"] for f in theirs if f["has_default"]]
        assert list(ours.__struct_fields__[len(ours.__struct_fields__) - num_defaults :]) == (
            optional
        ), name
    tagged = events["KVCacheEvent"]["options"]
    config = wire.BlockStored.__struct_config__
    assert tagged["tag"] is True and config.tag == "BlockStored"
    assert tagged["omit_defaults"] is True and config.omit_defaults
    batch = events["EventBatch"]["options"]
    assert batch["array_like"] is True and wire.EventBatch.__struct_config__.array_like
    # A 0.33 engine's store event with lookahead tokens decodes here, and back.
    ev = wire.BlockStored([1], None, [5] * 4, 4, None, None, None, lookahead_token_ids=[[7, 8]])
    data = msgspec.msgpack.encode(ev)
    assert msgspec.msgpack.decode(data, type=wire.BlockStored) == ev
    assert b"lookahead_token_ids" not in msgspec.msgpack.encode(
        wire.BlockStored([1], None, [5] * 4, 4, None, None, None)
    )


def test_a_changed_interface_fails_naming_what_is_missing():
    base = dict(_fixture()["KVConnectorBase_V1"])
    del base["get_block_ids_with_load_errors"]
    base["build_connector_meta"] = {
        "kind": "method",
        "params": ["scheduler_output", "step"],
        "abstract": True,
    }
    base["new_abstract_hook"] = {"kind": "method", "params": [], "abstract": True}
    with pytest.raises(ConfigError) as err:
        compat.check_vllm(base, "0.99.0", IMPLEMENTED)
    msg = str(err.value)
    assert "vLLM 0.99.0" in msg
    assert "get_block_ids_with_load_errors is missing" in msg
    assert "build_connector_meta(scheduler_output, step) takes other parameters" in msg
    assert "new_abstract_hook is abstract" in msg
    assert "0.32.0" in msg


def test_an_untested_matching_version_warns_once_naming_the_tested_ones(caplog):
    base = _fixture()["KVConnectorBase_V1"]
    with caplog.at_level(logging.WARNING, logger="kvstore_connectors.vllm.compat"):
        compat.check_vllm(base, "0.34.1", IMPLEMENTED)
        compat.check_vllm(base, "0.34.1", IMPLEMENTED)
        compat.check_vllm(base, "0.32.0", IMPLEMENTED)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "0.34.1" in warnings[0] and "0.32.0" in warnings[0] and "0.33.0" in warnings[0]


@pytest.mark.vllm
@needs_vllm
def test_script_on_the_installed_032_gives_the_fixtures_form(tmp_path):
    """The script run on the installed 0.32.0 tree: the fixture's format, and the
    difference from 0.33 is what the 0.33 release notes say (three hooks, one field)."""
    import vllm

    site = Path(vllm.__file__).resolve().parents[1]
    out = tmp_path / "0.32.json"
    assert _script().main([str(site), str(out)]) == 0
    old, new = json.loads(out.read_text()), _fixture()
    assert set(old) == set(new)
    assert old["vllm_version"] == vllm.__version__.split("+")[0]
    added = set(new["KVConnectorBase_V1"]) - set(old["KVConnectorBase_V1"])
    assert added == set(compat.OPTIONAL)
    fields = [[f["name"] for f in fx["events"]["BlockStored"]["fields"]] for fx in (old, new)]
    assert fields[1] == [*fields[0], "lookahead_token_ids"]


@pytest.mark.vllm
@needs_vllm
def test_extractor_agrees_with_the_live_032_class():
    """What the script reads from source is what Python sees, on the version installed."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as base_module

    script = _script()
    members, init_attrs = script.describe_base(Path(base_module.__file__).read_text())
    live = compat.describe_class(base_module.KVConnectorBase_V1)
    assert members == live
    assert set(compat.REQUIRED_INIT_ATTRIBUTES) <= set(init_attrs)
    assert compat.interface_problems(live, IMPLEMENTED) == []
    assert vllm.__version__ in compat.TESTED_VLLM_VERSIONS


@pytest.mark.vllm
@needs_vllm
def test_connector_defines_the_listed_members_with_those_signatures():
    from kvstore_connectors.vllm.connector import KVStoreConnector

    ours = compat.describe_class(KVStoreConnector)
    for name, (kind, params) in {**compat.REQUIRED, **compat.OPTIONAL}.items():
        if name == "_get_connector_metadata":
            continue  # the base class's, called by the connector
        assert name in vars(KVStoreConnector), name
        assert ours[name]["kind"] == kind, name
        if kind != "property":
            assert tuple(ours[name]["params"]) == params, name
    assert not KVStoreConnector.__abstractmethods__
