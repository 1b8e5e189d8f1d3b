"""Lookahead block-hash vectors from vLLM 0.33's own hashing code.

    python scripts/vllm_lookahead_vectors.py vllm-0.33.0-...whl tests/fixtures/vllm/lookahead_vectors.json

vLLM 0.33 (a GPU wheel) does not import on the CPU build's environment, but its
block hashing is pure Python: this reads ``vllm/v1/core/kv_cache_utils.py``
from the wheel, runs 0.33's hashing functions (``get_request_block_hasher``
with ``num_hash_lookahead_tokens``, ``hash_block_tokens``, the extra-key
builders, ``init_none_hash``) on top of the installed vLLM's module (for what
they import: ``BlockHash``, the hash functions), over real ``Request`` objects
of the installed vLLM, and writes each case's tokens and digests as JSON.
tests/unit/test_hashing.py checks ``kvstore.hashing.BlockHasher`` against them.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

SOURCE = "vllm/v1/core/kv_cache_utils.py"
FUNCTIONS = (
    "init_none_hash",
    "hash_block_tokens",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "generate_lookahead_block_hash_extra_keys",
    "get_request_block_hasher",
)
BLOCK_SIZE = 16
# Lengths that leave the last full block with all, some, or none of its lookahead.
NUM_TOKENS = (16 * 6 + 5, 16 * 6 + 2, 16 * 6)


def load_033(wheel: Path) -> dict[str, Any]:
    """0.33's hashing functions, executed over the installed vLLM's module globals."""
    from vllm.v1.core import kv_cache_utils as installed

    with zipfile.ZipFile(wheel) as whl:
        text = whl.read(SOURCE).decode()
    tree = ast.parse(text)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS]
    found = {n.name for n in wanted}
    if found != set(FUNCTIONS):
        raise SystemExit(f"not in {SOURCE}: {sorted(set(FUNCTIONS) - found)}")
    ns: dict[str, Any] = dict(vars(installed))
    exec(compile(ast.Module(body=wanted, type_ignores=[]), SOURCE, "exec"), ns)
    return ns


def vectors(ns: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.request import Request

    rng = np.random.default_rng(7)
    all_tokens = rng.integers(0, 150000, max(NUM_TOKENS)).tolist()
    out = []
    for algo, fn in (("sha256", sha256), ("sha256_cbor", sha256_cbor)):
        ns["init_none_hash"](fn)
        for lookahead, salt, n in itertools.product((0, 1, 3), (None, "tenant-1"), NUM_TOKENS):
            tokens = all_tokens[:n]
            hasher = ns["get_request_block_hasher"](BLOCK_SIZE, fn, lookahead)
            req = Request(
                request_id="r",
                prompt_token_ids=list(tokens),
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                cache_salt=salt,
                block_hasher=hasher,
            )
            out.append(
                {
                    "algo": algo,
                    "block_size": BLOCK_SIZE,
                    "lookahead_tokens": lookahead,
                    "cache_salt": salt,
                    "num_tokens": n,
                    "hashes": [bytes(h).hex() for h in req.block_hashes],
                }
            )
    return {"tokens": all_tokens, "cases": out}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if os.environ.get("PYTHONHASHSEED"):
        raise SystemExit("unset PYTHONHASHSEED: the vectors use vLLM's default NONE_HASH seed")
    out = {"source": Path(argv[0]).name, **vectors(load_033(Path(argv[0])))}
    Path(argv[1]).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
