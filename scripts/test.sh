#!/usr/bin/env bash
# Run the whole test suite (after scripts/install.sh --full): lint, types,
# generated-code freshness, unit and integration tests. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
# Validators and console scripts the tests call (kvstore, kubernetes-validate,
# ruff) live in the venv: without it on PATH their tests would not find them.
export PATH="$PWD/.venv/bin:$PATH"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
# Tests that check our hashes and events against vLLM's own code run vLLM in a
# child interpreter: the one venv here has it.
export KVSTORE_VLLM_PYTHON=${KVSTORE_VLLM_PYTHON:-$PWD/.venv/bin/python}
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] mypy"
.venv/bin/mypy
echo "[test] pytest"
exec "$py" -m pytest -q -ra --durations=15 "$@"
