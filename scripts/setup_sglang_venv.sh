#!/usr/bin/env bash
# Creates .venv-sglang: SGLang 0.5.23's Python code on the CPU torch, for the
# tests and the bench that drive connectors/sglang with SGLang's own classes
# (HiCacheStorage, HiCacheStorageConfig, the MHA/MLA host pools, HiCacheFile).
#
# Its own venv: SGLang pins torch==2.14.1 (a CUDA build) and transformers 5.19,
# which would break vLLM's in .venv. So sglang goes in with --no-deps, on
# torch==2.13.0 (CPU), with only the modules its storage path imports.
#
# torchvision is deliberately NOT installed: nothing on this path needs it,
# transformers only probes for it (is_torchvision_available), and the PyPI
# build does not load against the CPU torch ("operator torchvision::nms does
# not exist"); absent, transformers skips it. The check below fails if some
# package pulled it in anyway.
#
# Usage: bash scripts/setup_sglang_venv.sh     (idempotent; ~1-2 min from nothing)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-sglang"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
CHECK="import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.pool_host.mha, \
sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.storage.backend_factory, grpc, zmq, pytest"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
    echo "[setup_sglang] $VENV ready"
    exit 0
fi
echo "[setup_sglang] creating $VENV"
"$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: a bare torch requirement takes a multi-GB CUDA build.
pip install -q "torch==${TORCH_VERSION}"
# What sglang.srt's storage path imports (found by importing it), plus kvstore's
# own needs and pytest. torch stays pinned in the same resolve.
pip install -q "torch==${TORCH_VERSION}" numpy msgspec orjson psutil pybase64 requests \
    packaging pillow starlette typing_extensions "triton==3.9.0" pydantic tqdm ipython \
    aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" sentencepiece \
    compressed-tensors gguf \
    "grpcio>=1.60" "grpcio-health-checking>=1.60" "grpcio-reflection>=1.60" "protobuf>=4.25" \
    prometheus-client "pyzmq>=25" "xxhash>=3.4" "pytest>=8" "pytest-timeout>=2.3"
pip install -q --no-deps "sglang==${SGLANG_VERSION}"
if "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
    echo "[setup_sglang] torchvision got installed; it breaks transformers on CPU torch" >&2
    exit 1
fi
"$VENV/bin/python" -c "$CHECK; import torch, sglang; print('[setup_sglang] sglang', sglang.__version__, 'torch', torch.__version__)"
