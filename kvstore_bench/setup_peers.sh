#!/usr/bin/env bash
# Creates the virtual environments that `kvstore-bench compare` uses to run the
# systems it compares against, from nothing but pip and apt:
#
#   .venv-lmcache   LMCache 0.5.6 (in-process CPU engine + per-node MP server).
#                   Its own venv: its pins (numpy<=2.2.6, prometheus_client<=0.24.1)
#                   clash with vLLM's. A plain `pip install lmcache` would pull a
#                   multi-GB CUDA stack, so its runtime needs are listed here and
#                   lmcache itself goes in with --no-deps. kvstore goes in too
#                   (editable, --no-deps), for kvstore_connectors/lmcache and its tests.
#   .venv-mooncake  Mooncake Store (mooncake-transfer-engine-non-cuda), which
#                   needs libibverbs1 from apt even without RDMA hardware.
#
# Redis comes from the OS packages (redis-server) and redis-py.
#
# Usage: bash kvstore_bench/setup_peers.sh [--only lmcache|mooncake|redis]
# Idempotent: an existing venv whose import check passes is left as it is.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
ONLY=""
if [[ $# -gt 0 ]]; then
    if [[ "$1" != "--only" || $# -ne 2 || ! "$2" =~ ^(lmcache|mooncake|redis)$ ]]; then
        echo "usage: $0 [--only lmcache|mooncake|redis]" >&2
        exit 2
    fi
    ONLY="$2"
fi

LMCACHE_VERSION="0.5.6"
MOONCAKE_VERSION="0.3.13.post1"
TORCH_VERSION="2.13.0"

want() { [[ -z "$ONLY" || "$ONLY" == "$1" ]]; }

apt_install() {
    # Only when something is missing: apt-get update is slow and needs the network.
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        echo "[setup_peers] apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
}

if want redis; then
    apt_install redis-server
    "$PY" -m pip install -q "redis>=5"
fi

if want lmcache; then
    VENV="$ROOT/.venv-lmcache"
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import lmcache, torch" 2>/dev/null; then
        echo "[setup_peers] $VENV ready"
    else
        echo "[setup_peers] creating $VENV"
        "$PY" -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
        # torch first, pinned: a bare torch requirement would take the CUDA build.
        "$VENV/bin/pip" install -q "torch==${TORCH_VERSION}"
        "$VENV/bin/pip" install -q "torch==${TORCH_VERSION}" "numpy<=2.2.6" numba pyyaml requests \
            "prometheus_client<=0.24.1" py-cpuinfo psutil aiohttp aiofile cachetools \
            sortedcontainers "transformers>=5.4" msgspec "pyzmq>=25" cryptography \
            opentelemetry-api opentelemetry-sdk \
            fastapi uvicorn httptools httpx blake3 \
            aiofiles redis nvtx "setuptools>=77.0.3,<81"
        "$VENV/bin/pip" install -q --no-deps "lmcache==${LMCACHE_VERSION}"
        "$VENV/bin/python" -c "import lmcache, torch; print('[setup_peers] lmcache', lmcache.__file__)"
    fi
    # kvstore itself, for its LMCache connector (kvstore_connectors/lmcache) and the tests'
    # engine driver: its runtime needs (pyproject.toml) within LMCache's pins, then
    # the package with --no-deps (a plain install would re-resolve numpy and
    # prometheus_client past them). protobuf 7: kvstore's generated code needs
    # it; LMCache declares <7 but its own generated code (6.31) loads under 7.
    if ! (cd / && "$VENV/bin/python" -c "import kvstore.client, kvstore_connectors.lmcache.store") 2>/dev/null; then
        echo "[setup_peers] installing kvstore into $VENV"
        "$VENV/bin/pip" install -q "grpcio>=1.60" "grpcio-health-checking>=1.60" \
            "grpcio-reflection>=1.60" "protobuf>=7.35" "msgspec>=0.18" "pyzmq>=25" \
            "xxhash>=3.4" "numpy<=2.2.6" "prometheus_client>=0.19,<=0.24.1"
        "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
        (cd / && "$VENV/bin/python" -c "import kvstore.client, kvstore_connectors.lmcache.remote; print('[setup_peers] kvstore ok')")
    fi
fi

if want mooncake; then
    apt_install libibverbs1
    VENV="$ROOT/.venv-mooncake"
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import mooncake.store" 2>/dev/null; then
        echo "[setup_peers] $VENV ready"
    else
        echo "[setup_peers] creating $VENV"
        "$PY" -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
        "$VENV/bin/pip" install -q numpy "mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}"
        "$VENV/bin/python" -c "import mooncake.store; print('[setup_peers] mooncake ok')"
    fi
fi
echo "[setup_peers] done"
