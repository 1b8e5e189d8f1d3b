"""EAGLE and MTP speculative decoding through the KVStore connector, on the vLLM CPU
build (0.32 runs both proposers on the CPU: its CPU platform registers C++
fallbacks for the EAGLE kernels). Tiny random target + drafter models drawn at
test time; the steps and assertions are in tests/integration/vllm_spec_models.py
(the ngram test's: restored prefixes hit, tokens identical to the same engine
without the connector, every stored block is read back). The CUDA run of the
same is tests/gpu/test_vllm_spec_decode.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_spec")


def _both(workdir: Path, name: str, model: Path, spec: dict[str, Any]):
    from tests.integration import vllm_spec_models as sm

    reference = sm.run(workdir, f"{name}_ref", model, spec, connector=False, gpu=False)
    out = sm.run(workdir, name, model, spec, connector=True, gpu=False)
    return out, reference


def test_eagle_hits_same_tokens_and_stores_only_readable_blocks(workdir):
    from tests.integration import vllm_spec_models as sm

    target, head = sm.make_llama_and_eagle_head(workdir / "models")
    sm.check(*_both(workdir, "eagle", target, sm.eagle_config(head)))


def test_mtp_hits_same_tokens_and_stores_only_readable_blocks(workdir):
    from tests.integration import vllm_spec_models as sm

    target = sm.make_ernie_with_mtp(workdir / "models")
    sm.check(*_both(workdir, "mtp", target, sm.MTP_CONFIG))


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_accepted_drafts_are_stored_and_read_back(workdir, method):
    """A drafter that agrees with its target: most drafts accepted, and the blocks
    that accepted tokens complete are stored once and all read back, tokens equal."""
    from tests.integration import vllm_spec_models as sm

    if method == "eagle":
        target, head = sm.make_llama_and_eagle_head(workdir / "models", agreeing=True)
        spec = sm.eagle_config(head)
    else:
        target, spec = sm.make_ernie_with_mtp(workdir / "models", agreeing=True), sm.MTP_CONFIG
    sm.check(*_both(workdir, f"{method}_agreeing", target, spec), accepted=True)
