"""A client of LMCache's MP server (kvstore_bench.compare_lmcache.LMCacheMPSystem: the
engine-driven shared-memory path a vLLM worker takes); runs in .venv-lmcache.

    python -m tests.lmcache.mp_driver URL BLOCK_BYTES

One JSON command per stdin line, one "@@ {json}" answer per line:

    {"op": "store", "name": "a", "chunks": n}  -> stored
    {"op": "load", "name": "a", "chunks": n}   -> exact (or error: not all found)

Chunk bytes are a function of (name, index), so any process can check them.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

from kvstore_bench.compare_lmcache import LMCacheMPSystem


def blocks_of(name: str, n: int, block_bytes: int) -> np.ndarray:
    seed = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def main() -> None:
    url, block_bytes = sys.argv[1], int(sys.argv[2])
    system = LMCacheMPSystem({"url": url, "block_bytes": block_bytes})
    print("@@ " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            keys = [f"{cmd['name']}-{i}" for i in range(cmd["chunks"])]
            want = blocks_of(cmd["name"], cmd["chunks"], block_bytes)
            if cmd["op"] == "store":
                system.store(keys, want)
                reply = {"stored": len(keys)}
            else:
                out = np.zeros_like(want)
                system.load(keys, out)
                reply = {"exact": bool(np.array_equal(out, want))}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print("@@ " + json.dumps(reply), flush=True)
    system.close()


if __name__ == "__main__":
    main()
