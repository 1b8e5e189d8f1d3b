#!/usr/bin/env bash
# Creates .venv-sglang: SGLang 0.5.23's Python code on a CPU-only machine, for the
# tests and the bench that drive kvstore_connectors/sglang with SGLang's own classes
# (HiCacheStorage, HiCacheStorageConfig, the MHA/MLA host pools, HiCacheFile).
#
# Its own venv: SGLang pins torch==2.14.1 and transformers 5.19, which would
# break vLLM's CPU build in .venv. sglang itself goes in with --no-deps, with
# only the modules its storage path imports.
#
# torch is SGLang's own pin, torch==2.14.1, the PyPI (CUDA 13) build, which
# runs on a CPU-only machine; with torchvision 0.29.1, its match. Why not the
# CPU torch 2.13 of .venv: SGLang's host pools import sglang.srt.configs, whose
# nano_nemotron_vl config imports torchvision.transforms at module level
# (sglang/srt/multimodal/internvl_utils.py), and PyPI's torchvision for torch
# 2.13 links libtorch_cuda/libc10_cuda, so on the CPU torch its ops never
# register ("operator torchvision::nms does not exist"); the CPU torchvision
# lives only on download.pytorch.org, which these machines cannot reach.
# No import stubs: every module SGLang imports is the real one.
#
# Usage: bash scripts/setup_sglang_venv.sh     (idempotent; a few minutes and ~6 GB from nothing)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-sglang"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.14.1"
TORCHVISION_VERSION="0.29.1"
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
pip install -q "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"
# What sglang.srt's storage path imports (found by importing it), plus kvstore's
# own needs and pytest. torch stays pinned in the same resolve. setuptools < 81:
# SGLang builds its page-hash C++ extension with torch.utils.cpp_extension at
# first use (g++ and libssl headers), which needs setuptools.Command.
pip install -q "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" numpy msgspec orjson psutil pybase64 requests \
    packaging pillow starlette typing_extensions pydantic tqdm ipython \
    aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" sentencepiece \
    compressed-tensors gguf \
    "setuptools>=77.0.3,<81" \
    "grpcio>=1.60" "grpcio-health-checking>=1.60" "grpcio-reflection>=1.60" "protobuf>=4.25" \
    prometheus-client "pyzmq>=25" "xxhash>=3.4" "pytest>=8" "pytest-timeout>=2.3"
pip install -q --no-deps "sglang==${SGLANG_VERSION}"
"$VENV/bin/python" -c "$CHECK; import torch, sglang; print('[setup_sglang] sglang', sglang.__version__, 'torch', torch.__version__)"
