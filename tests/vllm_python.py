"""Which interpreter has vLLM (CPU build), for tests that run it in a child process."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def vllm_python() -> str | None:
    """$KVSTORE_VLLM_PYTHON, else .venv-vllm, else this interpreter if it has vLLM."""
    for cand in (
        os.environ.get("KVSTORE_VLLM_PYTHON", ""),
        os.path.join(ROOT, ".venv-vllm", "bin", "python"),
    ):
        if cand and os.path.exists(cand):
            return cand
    return sys.executable if importlib.util.find_spec("vllm") is not None else None
