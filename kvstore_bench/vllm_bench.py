"""`kvstore-bench vllm`: a real vLLM (CPU build) with and without the KVStore connector.

On a CPU these figures show the connector's *overhead*, not the GPU speed-up:
a tiny model's prefill on a CPU is cheap next to a real model's on a GPU, so
restoring from the daemon saves little here. What must hold everywhere is
that the connector adds little when it cannot help.

Measured (the tiny random Llama of tests/integration/vllm_model.py, run from
a repository checkout, in child processes with the vLLM environment):

1. Time to first token (``max_tokens=1``) for prompts filling most of the
   context, in one engine with the connector:
   - cold: new prompts (no hit anywhere; the connector stores them),
   - vLLM prefix cache: the same prompts again (vLLM's own local hit),
   - restored: the same prompts after ``reset_prefix_cache()`` (only the
     daemon has them: the connector loads every full block).
   Interleaved per prompt, so the machine's swings hit all three alike.
2. Decode steps with nothing to hit: an engine without the connector vs one
   with it, same prompts, several rounds each; plus the connector's own time
   inside its hooks per step (timed in-process), as a share of step time
   (goal: <= 2%).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstore_bench._common import (
    env_python,
    needs_checkout,
    results_dir,
    summarize,
    write_json,
)

CPU_NOTE = (
    "NOTE: CPU build of vLLM with a tiny random model: these figures show the connector's "
    "overhead, not the GPU speed-up (restoring a prefix saves far more prefill time on a GPU "
    "with a real model)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--python",
        default=None,
        help="python of the vLLM environment (default: $KVSTORE_BENCH_VLLM_PYTHON, .venv-vllm, or this one)",
    )
    p.add_argument("--prompts", type=int, default=6, help="distinct prompts for the TTFT part")
    p.add_argument("--prompt-tokens", type=int, default=900, help="tokens per TTFT prompt")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--decode-prompts", type=int, default=8, help="concurrent requests in the decode part"
    )
    p.add_argument(
        "--decode-tokens", type=int, default=64, help="tokens generated per decode request"
    )
    p.add_argument("--rounds", type=int, default=4, help="decode rounds per engine")
    p.add_argument("--results", default="results", help="folder for the JSON report")
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")


def _ttft_spec(
    model_dir: Path, address: str, prompts: list[list[int]], max_model_len: int
) -> dict[str, Any]:
    from tests.integration import vllm_model as vm

    steps: list[dict[str, Any]] = []
    for ids in prompts:
        one = {"prompts": [{"ids": ids}], "max_tokens": 1}
        steps += [
            {**one, "label": "cold"},
            {**one, "label": "vllm_prefix_cache"},
            {**one, "label": "restored", "reset_prefix_cache": True},
        ]
    # A warm-up prompt first: the first forward of an engine pays one-off costs.
    warm = {"prompts": [{"ids": vm.prompt_ids(999, 64)}], "max_tokens": 1, "label": "warmup"}
    return {
        "model_dir": str(model_dir),
        "max_model_len": max_model_len,
        "kv_transfer_config": vm.kv_transfer_config(address),
        "steps": [warm, *steps],
    }


def _decode_spec(
    model_dir: Path, address: str | None, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    from tests.integration import vllm_model as vm

    steps = []
    for r in range(args.rounds + 1):  # round 0 warms up
        prompts = [
            {"ids": vm.prompt_ids(seed + 1000 * r + i, 64)} for i in range(args.decode_prompts)
        ]
        steps.append({"prompts": prompts, "max_tokens": args.decode_tokens, "label": f"round{r}"})
    spec: dict[str, Any] = {
        "model_dir": str(model_dir),
        "steps": steps,
        "max_num_seqs": args.decode_prompts,
    }
    if address is not None:
        spec["kv_transfer_config"] = vm.kv_transfer_config(address)
    return spec


def _run(tmp: Path, name: str, spec: dict[str, Any], python: str | None) -> dict[str, Any]:
    from tests.integration import vllm_model as vm

    spec_path = vm.write_spec(tmp / f"{name}.spec.json", spec)
    out, log = tmp / f"{name}.out.json", tmp / f"{name}.log"
    proc = vm.start_run(spec_path, out, log, python=python)
    return vm.finish_run(proc, out, log, timeout_s=900)


def _fmt_ms(s: Any) -> str:
    return (
        f"{s.median_s * 1e3:8.2f} ms  (p10 {s.p10_s * 1e3:.2f} .. p90 {s.p90_s * 1e3:.2f}, n={s.n})"
    )


def run(args: argparse.Namespace) -> int:
    if not needs_checkout("vllm"):
        return 2
    from kvstore.process import DaemonProcess
    from tests.integration import vllm_model as vm

    if args.quick:
        args.prompts, args.prompt_tokens, args.max_model_len = 3, 480, 512
        args.decode_prompts, args.decode_tokens, args.rounds = 4, 32, 2
    args.python = args.python or env_python("vllm")
    print(CPU_NOTE)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "model"
        subprocess.run(
            [
                args.python or sys.executable,
                "-m",
                "tests.integration.vllm_model",
                "make-model",
                str(model_dir),
            ],
            cwd=vm.REPO_ROOT,
            env=vm.engine_env(),
            check=True,
            timeout=600,
        )
        daemon = DaemonProcess(
            tmp / "daemon", tcp=False, dram_bytes=512 << 20, chunk_bytes=16 << 20
        )
        daemon.start()
        try:
            prompts = [vm.prompt_ids(7000 + i, args.prompt_tokens) for i in range(args.prompts)]
            ttft = _run(
                tmp,
                "ttft",
                _ttft_spec(model_dir, daemon.address, prompts, args.max_model_len),
                args.python,
            )
            plain = _run(
                tmp, "decode_plain", _decode_spec(model_dir, None, args, 20000), args.python
            )
            with_conn = _run(
                tmp,
                "decode_conn",
                _decode_spec(model_dir, daemon.address, args, 30000),
                args.python,
            )
        finally:
            daemon.stop()

    spec_steps = _ttft_spec(model_dir, "unused", prompts, args.max_model_len)["steps"]
    by_label: dict[str, list[float]] = {}
    loaded: list[int] = []
    for step_spec, step in zip(spec_steps, ttft["steps"], strict=True):
        by_label.setdefault(step_spec["label"], []).append(step["elapsed_s"])
        if step_spec["label"] == "restored":
            loaded.append(step["connector"].get("worker_loaded_blocks", 0))
    cold = summarize(by_label["cold"])
    local = summarize(by_label["vllm_prefix_cache"])
    restored = summarize(by_label["restored"])
    full_blocks = (args.prompt_tokens - 1) // vm.BLOCK_SIZE

    def step_times(out: dict[str, Any]) -> tuple[list[float], list[float]]:
        per_step, share = [], []
        for step in out["steps"][1:]:  # round 0 is warm-up
            c = step["connector"]
            steps = c.get("worker_steps") or (args.decode_tokens + 1)
            per_step.append(step["elapsed_s"] / steps)
            if "worker_time_ns" in c:
                hook_s = (c["worker_time_ns"] + c.get("scheduler_time_ns", 0)) / 1e9
                share.append(hook_s / step["elapsed_s"])
        return per_step, share

    plain_steps, _ = step_times(plain)
    conn_steps, shares = step_times(with_conn)
    plain_s, conn_s = summarize(plain_steps), summarize(conn_steps)
    share = summarize(shares) if shares else None

    print(
        f"\nTime to first token, {args.prompts} prompts of {args.prompt_tokens} tokens (block {vm.BLOCK_SIZE}):"
    )
    print(f"  cold (computed, stored)       {_fmt_ms(cold)}")
    print(
        f"  vLLM prefix cache (local)     {_fmt_ms(local)}   {local.median_s / cold.median_s:.2f}x cold"
    )
    print(
        f"  restored from kvstore         {_fmt_ms(restored)}   {restored.median_s / cold.median_s:.2f}x cold, "
        f"{restored.median_s / local.median_s:.2f}x local"
    )
    print(
        f"  blocks loaded per restored prompt: {sorted(set(loaded))} (full blocks: {full_blocks})"
    )
    print(
        f"\nDecode, {args.decode_prompts} requests x {args.decode_tokens} tokens, nothing to hit, "
        f"{args.rounds} rounds per engine (separate engines: compare medians, mind the spread):"
    )
    print(f"  without connector, per step   {_fmt_ms(plain_s)}")
    print(
        f"  with connector, per step      {_fmt_ms(conn_s)}   {conn_s.median_s / plain_s.median_s:.3f}x"
    )
    if share is not None:
        ok = "within" if share.median_s <= 0.02 else "ABOVE"
        print(
            f"  time inside the connector's hooks: {share.median_s * 100:.2f}% of step time "
            f"(p10 {share.p10_s * 100:.2f} .. p90 {share.p90_s * 100:.2f}%): {ok} the 2% goal"
        )
    print("\n" + CPU_NOTE)
    report = {
        "note": CPU_NOTE,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "ttft_s": {"cold": cold, "vllm_prefix_cache": local, "restored": restored},
        "restored_loaded_blocks": loaded,
        "decode_step_s": {"without_connector": plain_s, "with_connector": conn_s},
        "connector_hook_share": share,
        "startup_s": {
            "ttft": ttft["startup_s"],
            "plain": plain["startup_s"],
            "connector": with_conn["startup_s"],
        },
    }
    path = results_dir(args.results, "vllm") / "vllm.json"
    write_json(path, report)
    print(f"report: {path}")
    return 0
