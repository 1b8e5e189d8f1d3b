"""A tiny randomly initialised Llama, and a vLLM runner for it, for end-to-end tests.

Nothing comes from a model hub: the weights are drawn with ``transformers``
from a fixed seed and the tokenizer is a word-level ``tokenizers`` model whose
words are ``w0 .. w{vocab-3}``, so a prompt of N words is exactly N tokens.

vLLM runs in a child process (``python -m tests.integration.vllm_model SPEC
OUT``) so a test can restart it, run two at once, or kill the daemon under
it; the child runs a list of steps (optionally waiting for a file first,
writing one when done) and writes per-prompt results as JSON.

Settings that keep a CPU run short (see docs/vllm.md): single-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``),
``dtype="float32"`` (bf16 + an externally loaded prefix hits SIGILL on AMX
CPUs), a 1 GiB KV cache, block size 32 (CPU kernels need multiples of 32).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
NUM_LAYERS = 2
HIDDEN = 128
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS  # 32: a CPU attention head size
MAX_POSITIONS = 1024
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
RUN_TIMEOUT_S = 240.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a child that runs vLLM on the CPU, quickly and offline."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
            ),
        }
    )
    if extra:
        env.update(extra)
    return env


def write_tokenizer(model_dir: Path) -> None:
    """The word-level tokenizer (``w0 .. w{vocab-3}``, ids 2..) into ``model_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1}
    vocab.update({f"w{i}": i + 2 for i in range(VOCAB_SIZE - 2)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(model_dir)


def make_tiny_llama(model_dir: Path, seed: int = 0) -> Path:
    """Write a random tiny Llama + word-level tokenizer to ``model_dir``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir.mkdir(parents=True, exist_ok=True)
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        return model_dir
    write_tokenizer(model_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        # A wide init spreads the logits, so greedy picks are not near-ties that
        # float reassociation (prefix loaded vs computed in one pass) could flip.
        initializer_range=0.2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def prompt_ids(seed: int, num_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
    """Deterministic token ids (never EOS), appended to ``prefix``."""
    import random

    rng = random.Random(seed)
    body = [rng.randrange(2, VOCAB_SIZE) for _ in range(num_tokens - len(prefix))]
    return [*prefix, *body]


def kv_transfer_config(address: str, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config for the kvstore connector (see docs/vllm.md)."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address, **extra},
    }


def api_server_command(model_dir: Path, *extra: str, python: str | None = None) -> list[str]:
    """The OpenAI server on the tiny model as the tests run it (``vllm serve`` fails
    under the vllm-cpu distribution name): float32, greedy-reproducible, the
    test block size and length; ``extra`` adds the caller's flags."""
    return [
        python or sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(model_dir), "--dtype", "float32", "--seed", "0", "--enforce-eager"),
        *("--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN)),
        *extra,
    ]


def write_spec(path: Path, spec: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(spec))
    return path


def start_run(
    spec_path: Path, out_path: Path, log_path: Path, python: str | None = None
) -> subprocess.Popen[bytes]:
    """Start the runner child; its stdout+stderr go to ``log_path``."""
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child's lifetime
    try:
        return subprocess.Popen(
            [
                python or sys.executable,
                "-m",
                "tests.integration.vllm_model",
                str(spec_path),
                str(out_path),
            ],
            cwd=REPO_ROOT,
            env=engine_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


def finish_run(
    proc: subprocess.Popen[bytes], out_path: Path, log_path: Path, timeout_s: float = RUN_TIMEOUT_S
) -> dict[str, Any]:
    """Wait for a runner child; its JSON results, or an error carrying the log tail."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"vLLM run timed out after {timeout_s}s:\n{_tail(log_path)}") from None
    if rc != 0 or not out_path.exists():
        raise AssertionError(f"vLLM run failed (rc={rc}):\n{_tail(log_path)}")
    out = json.loads(out_path.read_text())
    # The connector's own log lines, for assertion messages when a count is off.
    out["kvstore_log"] = [
        line for line in _tail(log_path, 200_000).splitlines() if "kvstore" in line.lower()
    ][-40:]
    return out


def run_once(tmp: Path, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    spec_path = write_spec(tmp / f"{name}.spec.json", spec)
    out, log = tmp / f"{name}.out.json", tmp / f"{name}.log"
    return finish_run(start_run(spec_path, out, log), out, log)


def _tail(path: Path, nbytes: int = 6000) -> str:
    try:
        return path.read_bytes()[-nbytes:].decode(errors="replace")
    except OSError:
        return "(no log)"


# ----------------------------------------------------------------- the child


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {path}")
        time.sleep(0.05)


def _connector_counters(llm: Any) -> dict[str, int]:
    """Counters of the in-process kvstore connector (both roles), when there is one."""
    counters: dict[str, int] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            counters.update(get_kv_transfer_group().counters())
    except (ImportError, AttributeError):
        pass
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        if sched.connector is not None:
            counters.update(sched.connector.counters())
    except AttributeError:
        pass
    return counters


def _spec_counters(llm: Any, spec: Mapping[str, Any]) -> dict[str, int]:
    """vLLM's speculative-decoding counters (drafts proposed, accepted), when on."""
    if not spec.get("speculative_config"):
        return {}
    from vllm.v1.metrics.reader import Counter

    return {
        m.name.removeprefix("vllm:"): int(m.value)
        for m in llm.get_metrics()
        if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode")
    }


def _force_async_scheduling() -> None:
    """Keep ``async_scheduling=True`` on the CPU build, as on a default GPU vLLM.

    vLLM's CPU platform hook turns async scheduling off ("not required on CPU")
    after the engine arguments are read; the scheduler and model runner paths it
    selects are the platform-independent ones, so re-enabling it after the hook
    runs the GPU default's scheduling on the CPU.
    """
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    hook = platform_cls.check_and_update_config  # bound to the class

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        hook(vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    platform_cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def _drain(llm: Any, max_steps: int = 16) -> None:
    """Run the engine's steps left after ``generate`` returned: a connector that
    saves a finished request's last blocks a step later holds them until then (a
    server's engine loop runs that step at once; the offline ``generate`` stops
    when the last request finished)."""
    try:
        core = llm.llm_engine.engine_core.engine_core  # the in-process engine core
    except AttributeError:
        return
    for _ in range(max_steps):
        if not core.scheduler.has_requests():
            return
        llm.llm_engine.step()


def run_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run the steps of ``spec`` in one vLLM engine; results per step and prompt."""
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    kwargs: dict[str, Any] = {
        "model": spec["model_dir"],
        "dtype": spec.get("dtype", "float32"),
        "max_model_len": spec.get("max_model_len", MAX_MODEL_LEN),
        "block_size": spec.get("block_size", BLOCK_SIZE),
        "distributed_executor_backend": "uni",
        "enforce_eager": True,
        "seed": 0,
        "enable_prefix_caching": spec.get("enable_prefix_caching", True),
        "max_num_seqs": spec.get("max_num_seqs", 8),
    }
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("gpu_memory_utilization"):  # GPU runs (tests/gpu): a share, not 90%
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
        kwargs["disable_log_stats"] = False  # for the spec_decode counters
    if spec.get("async_scheduling"):
        _force_async_scheduling()
        kwargs["async_scheduling"] = True
    llm = LLM(**kwargs)
    if spec.get("async_scheduling"):
        sched_config = llm.llm_engine.vllm_config.scheduler_config
        assert sched_config.async_scheduling, "async scheduling did not stay on"
    startup_s = time.monotonic() - t0
    results = []
    for step in spec["steps"]:
        if step.get("wait_for"):
            _wait_for(step["wait_for"], step.get("wait_timeout_s", 120.0))
        time.sleep(step.get("delay_s", 0.0))
        registered = None
        if step.get("connector_calls") and spec.get("kv_transfer_config"):
            # Hooks vLLM calls around sleep mode (0.33+), called here directly on
            # the worker's connector: 0.32 has no caller for them.
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            group = get_kv_transfer_group()
            for name in step["connector_calls"]:
                getattr(group, name)()
            registered = group.kv_caches_registered
        if step.get("reset_prefix_cache"):
            # Forget vLLM's own prefix cache: the next hit can only come from the connector.
            llm.reset_prefix_cache()
        params = SamplingParams(
            temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True
        )
        prompts = []
        for i, p in enumerate(step["prompts"]):
            ids = list(p["ids"])
            if p.get("follow_up"):
                # A next turn: the previous step's prompt i and its answer, then ids.
                prev = results[-1]
                ids = [*prev["prompt_ids"][i], *prev["tokens"][i], *ids]
            elif p.get("repeat_step") is not None:
                ids = list(results[p["repeat_step"]]["prompt_ids"][i])
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if p.get("cache_salt"):
                prompt["cache_salt"] = p["cache_salt"]
            prompts.append(prompt)
        if step.get("kill_pid"):
            # A crash of the daemon at a known moment inside this generation.
            killer = threading.Timer(
                step.get("kill_after_s", 0.05), os.kill, (step["kill_pid"], signal.SIGKILL)
            )
            killer.start()
        before = {**_connector_counters(llm), **_spec_counters(llm, spec)}
        t = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        _drain(llm)
        elapsed_s = time.monotonic() - t
        after = {**_connector_counters(llm), **_spec_counters(llm, spec)}
        results.append(
            {
                "prompt_ids": [p["prompt_token_ids"] for p in prompts],
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
                "connector": {k: after[k] - before.get(k, 0) for k in after},
                "elapsed_s": elapsed_s,
                "kv_caches_registered": registered,
            }
        )
        if step.get("done_file"):
            Path(step["done_file"]).write_text("done")
    return {"startup_s": startup_s, "steps": results}


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "make-model":  # for callers without transformers (the bench)
        make_tiny_llama(Path(argv[1]))
        return 0
    spec = json.loads(Path(argv[0]).read_text())
    result = run_spec(spec)
    tmp = Path(argv[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(argv[1])
    # vLLM's teardown can hang on a busy 2-core box; results are on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
