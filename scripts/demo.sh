#!/usr/bin/env bash
# Install the daemon into ./.venv (seconds) and run `kvstore demo`: a real daemon
# plus an agentic conversation through it (hash, lookup, load, store, verify).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kvstore demo "$@"
