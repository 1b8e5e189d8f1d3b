"""A real SGLang server with HiCache on kvstore (needs CUDA and a full SGLang install).

Skipped without CUDA. The SGLang environment is ``$KVSTORE_SGLANG_GPU_PYTHON``
(an interpreter with ``pip install sglang==0.5.23`` and its CUDA kernels), else
.venv-sglang. A tiny random Llama (tests/integration/vllm_model.py) is served
with ``--hicache-storage-backend dynamic`` pointing at kvstore_connectors.sglang; the
same prompt is sent, the GPU and host caches flushed, and sent again: the
second answer must be the same, its prefix loaded from kvstore (the daemon's
loaded_blocks grows) and the pages stored must appear in the daemon's events.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVSTORE_SGLANG_GPU_PYTHON") or str(
    ROOT / ".venv-sglang" / "bin" / "python"
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _post(url: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text}


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"SGLang server died:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"SGLang server not healthy in {timeout_s}s:\n{log.read_text()[-4000:]}")


def test_sglang_server_serves_a_flushed_prefix_from_kvstore(daemon_factory, tmp_path):
    check = subprocess.run(
        [PYTHON, "-c", "import sglang, sgl_kernel, flashinfer"], capture_output=True, text=True
    )
    if check.returncode:
        pytest.fail(f"CUDA is here but {PYTHON} has no full SGLang install: {check.stderr[-800:]}")
    from kvstore.client import Client
    from kvstore_bench.ports import free_port
    from tests.integration.vllm_model import make_tiny_llama, prompt_ids

    daemon = daemon_factory(dram_bytes=512 << 20)
    model = make_tiny_llama(tmp_path / "model")
    port = free_port()
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore_connectors.sglang.backend",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1,
        "kvstore_address": daemon.address,
    }
    log = tmp_path / "sglang.log"
    cmd = [
        PYTHON, "-m", "sglang.launch_server", "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--page-size", "16",
        "--mem-fraction-static", "0.2", "--disable-cuda-graph", "--dtype", "float16",
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-write-policy", "write_through",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log)
        prompt = prompt_ids(3, 320)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        first = _post(base + "/generate", body)
        with Client(daemon.address) as c:
            deadline = time.monotonic() + 60
            while c.stats().stored_blocks < 320 // 16 - 1:  # write-through reaches L3
                assert time.monotonic() < deadline, "no pages reached kvstore"
                time.sleep(0.5)
            loaded_before = c.stats().loaded_blocks
        _post(base + "/flush_cache")  # GPU and host tiers dropped; L3 (kvstore) kept
        second = _post(base + "/generate", body)
        assert second["output_ids"] == first["output_ids"]
        with Client(daemon.address) as c:
            # direct loads tell the daemon in a message it does not wait for
            deadline = time.monotonic() + 10
            while c.stats().loaded_blocks <= loaded_before:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
        assert second["meta_info"].get("cached_tokens", 0) >= 16
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
