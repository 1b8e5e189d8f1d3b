"""Why an input token was recomputed: the causes `kvstore-bench agentic` attributes
every recomputed token to, with their report labels (shared by the replay and the report)."""

from __future__ import annotations

# Why a recomputed input token was not served from any cache (see class Diagnosis in
# kvstore_bench/agentic_diagnosis.py).
CAUSES: dict[str, str] = {
    "new": "new in the trace (first sight: tool output, a task's first read)",
    "partial_block": "partial last block (caches hold whole blocks) and the last token",
    "in_flight": "being computed by a concurrent request, not finished (stored) yet",
    "evicted_dram": "evicted before reuse: from DRAM, on every node that held it",
    "evicted_disk": "evicted before reuse: from disk, on every node that held it",
    "evicted_gpu": "evicted before reuse from every engine's GPU cache (no kvstore)",
    "evicted_unseen": "evicted before reuse (the removal event was not seen yet)",
    "store_refused": "refused at store time (no room: the tier was full of pinned blocks)",
    "split_across_nodes": "held by another node than the chosen one and the peer pulled from",
    "not_found_by_index": "held by another node, but the index showed no peer to pull from",
    "peers_off": "held by another node's daemon (peer pulls off)",
    "other_node_gpu_only": "in another engine's GPU cache (no kvstore to reach it)",
    "local_not_loaded": "held by the chosen node's daemon but not loaded (a bug or a race)",
    "peer_pull_short": "held by the pulled peer but the pull stopped before it",
    "never_stored": "computed before but never offered to a daemon (a bug)",
}
