"""Tiny random target + drafter models for EAGLE and MTP speculative decoding, and
the steps and checks the connector is held to under them (used by
tests/integration/test_vllm_spec_drafters.py on the CPU build and by
tests/gpu/test_vllm_spec_decode.py on CUDA).

The steps and assertions are the ngram test's (test_vllm_engines.py):

1. generate from distinct prompts (no two share a block: each stored block is one
   hash) with speculation on;
2. the same prompts again, vLLM's own prefix cache emptied: their full blocks hit
   through the connector (loaded from the daemon);
3. each prompt + its answer + three tokens, cache emptied: every block step 1
   stored is loaded back, as many loads as distinct stored blocks, so no block was
   stored that could never be read (a rejected draft's KV stored under an
   accepted hash, or a block stored past what vLLM hashed, would break the count
   or the tokens);

and every step's tokens equal those of the same engine (same speculation)
without the connector.

Models are drawn at test time (no model hub), with the word-level tokenizer of
vllm_model.py:

- EAGLE: a 2-layer Llama target and a 1-layer EAGLE-1 head in the layout of
  vLLM's ``EagleLlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle.py``:
  ``fc`` over [embedding, hidden], layer 0 without ``input_layernorm``, the
  target's lm_head shared; ``EAGLEConfig`` turns the draft's ``LlamaForCausalLM``
  into it).
- MTP: a 2-layer dense Ernie 4.5 (``Ernie4_5_MoeForCausalLM`` with no MoE layer:
  standard attention, one KV cache group, as the connector requires) with one
  ``num_nextn_predict_layers`` layer under the checkpoint names vLLM's ``ErnieMTP``
  reads (``model.mtp_emb_norm.0``, ``mtp_hidden_norm.0``, ``mtp_linear_proj.0``,
  ``mtp_block.0``); ``SpeculativeConfig`` maps ``ernie4_5_moe`` to
  ``ErnieMTPModel``. (MiMo's MTP, the other dense-attention family, was not
  taken: vLLM rewrites its draft to ``num_hidden_layers = 0``, which as read from
  the source names its layer like the target's layer 0.)

Random draft heads rarely agree with the target: their drafts are proposed and
rejected (the path that must not store a rejected token's KV), and the tokens
depend on every loaded block. ``agreeing=True`` builds pairs whose drafter
proposes exactly what the target picks (a silent-layer target: its next token
is a function of the current one), so drafts are accepted and the blocks of
accepted tokens are stored and read back too; their tokens do not depend on the
KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.integration import vllm_model as vm

BS = vm.BLOCK_SIZE  # 32: a multiple of every GPU attention backend's block size
VOCAB = vm.VOCAB_SIZE
HIDDEN = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS  # 64: FlashAttention 2 and 3 both take it
INTERMEDIATE = 2 * HIDDEN
NUM_LAYERS = 2
INIT_STD = 0.2  # as the CPU model: spread logits, no near-ties for greedy to flip
# On CUDA: float16 (FlashAttention, vLLM's CUDA default, takes no float32; float16
# keeps more mantissa than bfloat16 for the token comparison); on the CPU float32.
GPU_DTYPE = "float16"
GPU_MEMORY_UTILIZATION = 0.2  # two engines one after the other; tiny models

_PERIOD = vm.prompt_ids(9, 24)
# Distinct per prompt (token 5), so no two requests share a block.
PROMPTS = [
    [*p[:5], 400 + i, *p[6:]] for i, p in enumerate((_PERIOD * 4)[: 90 + 7 * i] for i in range(3))
]
GEN_TOKENS = 40


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * INIT_STD


def _attention_and_mlp(
    g: torch.Generator, prefix: str, *, input_norm: bool, silent: bool = False
) -> dict:
    """One decoder layer's weights; ``silent``: its attention and MLP add nothing to
    the residual stream (o_proj, down_proj zero; its K and V are still computed
    and cached)."""
    w = {
        f"{prefix}.self_attn.q_proj.weight": _rand(g, NUM_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": _rand(g, NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": _rand(g, NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": _rand(g, HIDDEN, NUM_HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": _rand(g, INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": _rand(g, INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": _rand(g, HIDDEN, INTERMEDIATE),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
    }
    if input_norm:
        w[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN)
    if silent:
        w[f"{prefix}.self_attn.o_proj.weight"].zero_()
        w[f"{prefix}.mlp.down_proj.weight"].zero_()
    return w


def _take_first_half() -> torch.Tensor:
    """[I | 0]: a projection of cat(a, b) that keeps a."""
    return torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)


def _common_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _save(model_dir: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    vm.write_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    return model_dir


def make_llama_and_eagle_head(
    root: Path, seed: int = 0, *, agreeing: bool = False
) -> tuple[Path, Path]:
    """A tiny Llama target and a 1-layer EAGLE-1 head for it (see the module doc).

    ``agreeing``: every layer silent (the target's next token is a function of
    its current one: argmax of lm_head . embed(t), the final RMSNorm only scales)
    and the head's fc keeps the input token's embedding, so the head proposes
    exactly what the target will pick: drafts are accepted. The tokens then do
    not depend on the KV cache; the random pair is the one whose tokens do."""
    g = torch.Generator().manual_seed(seed)
    embed = _rand(g, VOCAB, HIDDEN)
    target: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": _rand(g, VOCAB, HIDDEN),
    }
    for i in range(NUM_LAYERS):
        target.update(_attention_and_mlp(g, f"model.layers.{i}", input_norm=True, silent=agreeing))
    llama = {
        **_common_config(),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": NUM_LAYERS,
        "rope_theta": 10000.0,
    }
    # EagleLlamaForCausalLM.load_weights prefixes "model." to every name but
    # lm_head's; its layer 0 has no input_layernorm; it has no lm_head of its own
    # (the target's is shared), so none is written.
    head: dict[str, torch.Tensor] = {
        "embed_tokens.weight": embed.clone(),
        # EAGLE's LlamaModel: fc(cat(embed(token), target hidden))
        "fc.weight": _take_first_half() if agreeing else _rand(g, HIDDEN, 2 * HIDDEN),
        **_attention_and_mlp(g, "layers.0", input_norm=False, silent=agreeing),
    }
    eagle = {**llama, "num_hidden_layers": 1}
    tag = "-agreeing" if agreeing else ""
    return (
        _save(root / f"llama{tag}", llama, target),
        _save(root / f"eagle{tag}", eagle, head),
    )


def make_ernie_with_mtp(root: Path, seed: int = 1, *, agreeing: bool = False) -> Path:
    """A tiny dense Ernie 4.5 with one MTP layer in its checkpoint (see the module doc).

    ``agreeing``: as for EAGLE, layers silent and the MTP layer's projection keeping
    the (normed) input token's embedding: it proposes what the target picks."""
    g = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _rand(g, VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": _rand(g, VOCAB, HIDDEN),
        "model.mtp_emb_norm.0.weight": torch.ones(HIDDEN),
        "model.mtp_hidden_norm.0.weight": torch.ones(HIDDEN),
        # ErnieMultiTokenPredictorLayer: proj(cat(normed embed(token), normed hidden))
        "model.mtp_linear_proj.0.weight": (
            _take_first_half() if agreeing else _rand(g, HIDDEN, 2 * HIDDEN)
        ),
        **_attention_and_mlp(g, "model.mtp_block.0", input_norm=True, silent=agreeing),
    }
    for i in range(NUM_LAYERS):
        weights.update(_attention_and_mlp(g, f"model.layers.{i}", input_norm=True, silent=agreeing))
    config = {
        **_common_config(),
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "num_hidden_layers": NUM_LAYERS,
        "rope_theta": 500000.0,
        "use_bias": False,
        # No MoE layer (start past the last layer): dense MLPs, loaded as above.
        "moe_num_experts": 4,
        "moe_num_shared_experts": 0,
        "moe_intermediate_size": HIDDEN,
        "moe_k": 2,
        "moe_layer_start_index": NUM_LAYERS,
        "moe_layer_end_index": NUM_LAYERS - 1,
        "moe_layer_interval": 1,
        "num_nextn_predict_layers": 1,
    }
    return _save(root / ("ernie-agreeing" if agreeing else "ernie"), config, weights)


def steps() -> list[dict[str, Any]]:
    """As test_vllm_engines._spec_steps: generate; the prompts again (hits from the
    daemon only); each prompt + its answer + more (reads every stored block)."""
    return [
        {"prompts": [{"ids": p} for p in PROMPTS], "max_tokens": GEN_TOKENS},
        {
            "prompts": [{"ids": [], "repeat_step": 0} for _ in PROMPTS],
            "max_tokens": GEN_TOKENS,
            "reset_prefix_cache": True,
        },
        {
            "prompts": [{"ids": [3, 4, 5], "follow_up": True} for _ in PROMPTS],
            "max_tokens": 4,
            "reset_prefix_cache": True,
        },
    ]


def run(
    tmp: Path,
    name: str,
    model_dir: Path,
    speculative: dict[str, Any],
    *,
    connector: bool,
    gpu: bool,
) -> dict[str, Any]:
    """One engine through the steps, with or without the connector (on its own daemon)."""
    from kvstore.client import Client
    from kvstore.process import DaemonProcess

    spec: dict[str, Any] = {
        "model_dir": str(model_dir),
        "steps": steps(),
        "speculative_config": speculative,
    }
    if gpu:
        spec.update(dtype=GPU_DTYPE, gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    if not connector:
        return vm.run_once(tmp, name, spec)
    daemon = DaemonProcess(tmp / f"d_{name}", tcp=False, dram_bytes=256 << 20)
    daemon.start()
    try:
        spec["kv_transfer_config"] = vm.kv_transfer_config(daemon.address)
        out = vm.run_once(tmp, name, spec)
        with Client(daemon.address, map_region=False) as c:
            out["stored_blocks"] = c.stats().stored_blocks
    finally:
        daemon.stop()
        daemon.remove_region()
    return out


def check(out: dict[str, Any], reference: dict[str, Any], *, accepted: bool = False) -> None:
    """The ngram test's assertions (test_vllm_engines.py). ``accepted``: the drafter
    agrees with the target (``agreeing`` models): most draft tokens are accepted."""
    run = out
    gen, again, follow = run["steps"]
    log = run["kvstore_log"]
    c = gen["connector"]
    # Speculation ran: drafts proposed and verified.
    assert c.get("spec_decode_num_drafts", 0) > 0, c
    assert c.get("spec_decode_num_draft_tokens", 0) > 0, c
    if accepted:
        assert c["spec_decode_num_accepted_tokens"] * 2 > c["spec_decode_num_draft_tokens"], c
    # Token-identical to the same engine (same speculation) without the connector.
    assert [s["tokens"] for s in run["steps"]] == [s["tokens"] for s in reference["steps"]]
    # Stores: every full block of each prompt + its accepted tokens, once.
    blocks = [(len(p) + GEN_TOKENS - 1) // BS for p in PROMPTS]
    assert gen["connector"]["worker_saved_blocks"] == sum(blocks) == run["stored_blocks"], log
    # Restored prefixes hit.
    hits = [(len(p) - 1) // BS for p in PROMPTS]
    assert again["num_cached_tokens"] == [h * BS for h in hits], log
    assert again["connector"]["worker_loaded_blocks"] == sum(hits), log
    assert again["connector"]["worker_saved_blocks"] == 0, log
    # No block stored that is never read: each prompt + its answer loads all of its
    # blocks (distinct hashes), as many loads as blocks stored.
    assert follow["num_cached_tokens"] == [b * BS for b in blocks], log
    assert follow["connector"]["worker_loaded_blocks"] == run["stored_blocks"], log
    for step in run["steps"]:
        assert step["connector"]["worker_load_failed_blocks"] == 0, log


def eagle_config(head: Path) -> dict[str, Any]:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}


# ErnieMTP predicts one token per step (its forward asserts spec_step_idx == 0).
MTP_CONFIG: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 1}
