"""EAGLE and MTP speculative decoding through the KVStore connector on CUDA (needs
vLLM's GPU build; skipped without CUDA, fails where CUDA is but vLLM is not).

The same models, steps and assertions as the CPU build's run of them
(tests/integration/test_vllm_spec_drafters.py; the models and checks are in
tests/integration/vllm_spec_models.py), on the GPU paths: float16 with vLLM's CUDA
attention backend, CUDA graphs off (the runner's ``enforce_eager``), async
scheduling as vLLM's GPU default sets it, the connector's CUDA copier.

Written against the source of vLLM 0.32 (the installed CPU build) and the 0.33
interface; not run where it was written (no GPU engine there). On the device
machine: ``bash scripts/gpu_check.sh --only vllm-spec --budget-s 560`` where
vLLM's GPU build is installed.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from tests.integration import vllm_spec_models as sm  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]


def _need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "CUDA is here but this interpreter has no vLLM: install vLLM's GPU build "
            "(pip install vllm==0.33.0) to run the EAGLE/MTP tests"
        )


def test_eagle_on_cuda_hits_same_tokens_and_stores_only_readable_blocks(tmp_path):
    _need_vllm()
    target, head = sm.make_llama_and_eagle_head(tmp_path / "models")
    spec = sm.eagle_config(head)
    reference = sm.run(tmp_path, "eagle_ref", target, spec, connector=False, gpu=True)
    out = sm.run(tmp_path, "eagle", target, spec, connector=True, gpu=True)
    sm.check(out, reference)


def test_mtp_on_cuda_hits_same_tokens_and_stores_only_readable_blocks(tmp_path):
    _need_vllm()
    target = sm.make_ernie_with_mtp(tmp_path / "models")
    reference = sm.run(tmp_path, "mtp_ref", target, sm.MTP_CONFIG, connector=False, gpu=True)
    out = sm.run(tmp_path, "mtp", target, sm.MTP_CONFIG, connector=True, gpu=True)
    sm.check(out, reference)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_accepted_drafts_on_cuda_are_stored_and_read_back(tmp_path, method):
    """A drafter that agrees with its target (vllm_spec_models, ``agreeing``)."""
    _need_vllm()
    if method == "eagle":
        target, head = sm.make_llama_and_eagle_head(tmp_path / "models", agreeing=True)
        spec = sm.eagle_config(head)
    else:
        target, spec = sm.make_ernie_with_mtp(tmp_path / "models", agreeing=True), sm.MTP_CONFIG
    reference = sm.run(tmp_path, f"{method}_ref", target, spec, connector=False, gpu=True)
    out = sm.run(tmp_path, method, target, spec, connector=True, gpu=True)
    sm.check(out, reference, accepted=True)
