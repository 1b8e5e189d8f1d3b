"""The connector's counters reach a real vLLM OpenAI server's /metrics and log line.

One ``python -m vllm.entrypoints.openai.api_server`` (the tiny random Llama of
vllm_model.py) with the connector, prefix caching off so a repeated prompt can
only hit through the connector: the first request stores its 6 full blocks, the
second loads them, and vLLM's own metrics and periodic log show exactly that.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore_bench.ports import free_port
from tests.integration import vllm_model as vm
from tests.vllm_python import vllm_python

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.timeout(600),
]

PROMPT = vm.prompt_ids(5, 200)  # 6 full blocks of 32, and 8 tokens more
FULL_BLOCKS = 6
START_TIMEOUT_S = 400.0


def _wait(cond: Callable[[], bool], timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s:.0f}s:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _up(url: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"vLLM server exited with {proc.returncode}")
    try:
        _get(url + "/health")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
    return True


def _kvstore_samples(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.name: s.value
        for family in text_string_to_metric_families(_get(url + "/metrics"))
        for s in family.samples
        if s.name.startswith(("vllm:kvstore_", "vllm:external_prefix_cache_hits"))
    }


def test_connector_counters_in_vllm_metrics_and_log(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    python = vllm_python()
    assert python is not None
    daemon = daemon_factory("node-a", tcp=False, dram_bytes=128 << 20)
    model = vm.make_tiny_llama(tmp_path / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    cmd = vm.api_server_command(
        model,
        *("--max-num-seqs", "4", "--distributed-executor-backend", "uni"),
        *("--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)),
        *("--kv-transfer-config", json.dumps(vm.kv_transfer_config(daemon.address))),
        python=python,
    )
    env = vm.engine_env({"VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOG_STATS_INTERVAL": "1"})
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=vm.REPO_ROOT, env=env, stdout=out, stderr=out)
    try:
        _wait(lambda: _up(url, proc), START_TIMEOUT_S, "server up", log)
        body = json.dumps(
            {"model": str(model), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        ).encode()
        texts = []
        for _ in range(2):
            request = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                texts.append(json.loads(r.read())["choices"][0]["text"])
        assert texts[0] == texts[1]  # the loaded prefix gives the same greedy tokens

        # The stats of a step travel to the API server with that step's output:
        # wait (bounded) for the last one, then check every count exactly.
        def settled() -> bool:
            return _kvstore_samples(url).get("vllm:kvstore_worker_loaded_blocks_total") == (
                FULL_BLOCKS
            )

        _wait(settled, 30, "loaded blocks on /metrics", log)
        m = _kvstore_samples(url)
        assert m["vllm:kvstore_scheduler_lookups_total"] == 2, m
        assert m["vllm:kvstore_scheduler_hit_blocks_total"] == FULL_BLOCKS, m
        assert m["vllm:kvstore_worker_loaded_blocks_total"] == FULL_BLOCKS, m
        # Request 1 stores its full blocks; request 2 offers the same ones again.
        assert m["vllm:kvstore_worker_saved_blocks_total"] == FULL_BLOCKS, m
        assert m["vllm:kvstore_worker_save_skipped_blocks_total"] == FULL_BLOCKS, m
        for zero in ("worker_load_failed_blocks", "worker_checksum_failures"):
            assert m[f"vllm:kvstore_{zero}_total"] == 0, m
        assert m["vllm:kvstore_scheduler_daemon_failures_total"] == 0, m
        assert m["vllm:kvstore_worker_time_seconds_total"] > 0, m
        assert m["vllm:external_prefix_cache_hits_total"] == FULL_BLOCKS * vm.BLOCK_SIZE, m

        # vLLM's periodic log line carries them, and the connector's INFO lines reach
        # vLLM's log (through its handler and format).
        _wait(lambda: "worker_loaded_blocks=6" in log.read_text(), 30, "KV Transfer log line", log)
        text = log.read_text()
        assert "KV Transfer metrics: " in text
        assert any(
            " INFO " in line and "KVStoreConnector (SCHEDULER): daemon" in line
            for line in text.splitlines()
        ), text[-6000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
