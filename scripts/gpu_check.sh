#!/usr/bin/env bash
# One command for the GPU machine: every CUDA path of kvstore once, figures in one summary.
#
#   bash scripts/gpu_check.sh --fetch     CPU machine with the package index: download the
#                                         wheels the GPU machine lacks into .whl/, size check
#   bash scripts/gpu_check.sh             CPU half (wheel list, size check), then the GPU
#                                         half if this machine has CUDA, else one line saying so
#   bash scripts/gpu_check.sh --gpu       GPU half: install .whl/ (no index), run every step
#   bash scripts/gpu_check.sh --host      the GPU half's steps without CUDA (host mode, small)
#
# Options: --wheels DIR (default .whl), --out DIR (default $OUT, else results/gpu-check-<time>),
# --budget-s N (default 420: all steps together, each with its own limit too),
# --no-wheels (the GPU half uses what is installed: a GPU machine with network, docs/gpu.md),
# --install (with --host: install the carried wheels first, as --gpu does),
# --only STEPS (comma-separated step names of kvstore_bench/gpu_check.py; e.g. vllm-spec: the
# EAGLE/MTP engine tests, minutes, where vLLM's GPU build is installed).
# The GPU machine: Python 3.12 with torch/cupy/CUDA 13, no network; what travels (tree +
# wheels) must fit 64 MiB and the whole call 10 minutes. See docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=auto wheels=.whl out=${OUT:-} budget=420 use_wheels=1 host_install=0 only=
while [ $# -gt 0 ]; do
    case "$1" in
        --fetch) mode=fetch ;;
        --check) mode=check ;;
        --gpu) mode=gpu ;;
        --host) mode=host ;;
        --no-wheels) use_wheels=0 ;;
        --install) host_install=1 ;;
        --wheels) wheels=$2; shift ;;
        --out) out=$2; shift ;;
        --budget-s) budget=$2; shift ;;
        --only) only=$2; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)"; exit 2 ;;
    esac
    shift
done
[ -n "$out" ] || out=results/gpu-check-$(date -u +%Y%m%d-%H%M%S)
# The CPU half needs only the standard library: any python3 (the venv's if there).
cpu_py=${PYTHON:-}
[ -n "$cpu_py" ] || { [ -x .venv/bin/python ] && cpu_py=.venv/bin/python || cpu_py=python3; }
# The GPU half runs the interpreter that has torch (on the GPU machine: python3).
gpu_py=${GPU_PYTHON:-python3}

cpu_half() {
    "$cpu_py" scripts/gpu_wheels.py "$1" --wheels "$wheels"
}

has_cuda() {
    "$gpu_py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

gpu_half() {  # $1: gpu | host
    local extra=()
    [ "$1" = host ] && extra=(--host)
    [ -n "$only" ] && extra+=(--only "$only")
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if { [ "$1" = gpu ] && [ "$use_wheels" = 1 ]; } || [ "$host_install" = 1 ]; then
        local site=${KVSTORE_GPU_SITE:-/tmp/kvstore-gpu-site}
        local ver
        ver=$("$gpu_py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        if [ "$ver" != 3.12 ]; then
            echo "gpu_check: the carried wheels are for Python 3.12; $gpu_py is $ver: install kvstore's dependencies (docs/gpu.md) and pass --no-wheels"
            return 4
        fi
        if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
            echo "gpu_check: no wheels in $wheels (carry the folder, or --no-wheels where the dependencies are installed)"
            return 4
        fi
        echo "gpu_check: installing $(ls "$wheels"/*.whl | wc -l) carried wheels into $site (no index)"
        if ! PIP_ROOT_USER_ACTION=ignore timeout 90 "$gpu_py" -m pip install -q --no-index --no-deps --no-compile \
                --no-cache-dir --upgrade --disable-pip-version-check --target "$site" "$wheels"/*.whl; then
            echo "gpu_check: installing the carried wheels failed (pip's message above)"
            return 4
        fi
        # In front of the image's own packages: the carried grpcio/protobuf are the
        # versions the generated code needs (scripts/gpu_wheels.py).
        export PYTHONPATH="$PWD:$site"
    fi
    export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
    timeout $(( ${budget%.*} + 30 )) "$gpu_py" -m kvstore_bench.gpu_check --out "$out" --budget-s "$budget" ${extra[@]+"${extra[@]}"}
}

case $mode in
    fetch) cpu_half fetch ;;
    check) cpu_half check ;;
    gpu)
        if ! has_cuda; then
            echo "gpu_check: GPU half skipped: $gpu_py sees no CUDA device (torch absent or no GPU)"
            exit 3
        fi
        gpu_half gpu ;;
    host) gpu_py=${GPU_PYTHON:-$cpu_py}; gpu_half host ;;
    auto)
        cpu_half check || exit 1
        if has_cuda; then
            gpu_half gpu
        else
            echo "gpu_check: GPU half skipped: no CUDA device here ($gpu_py: torch absent or torch.cuda.is_available() is false)"
        fi ;;
esac
