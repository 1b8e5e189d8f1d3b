"""`kvstore-bench agentic`'s model of an engine: its GPU prefix cache, publishing
vLLM-format KV events (medium GPU) as a vLLM engine does."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvstore_bench.agentic_cluster import MODEL


class GpuCacheModel:
    """An engine's GPU prefix cache: LRU over block hashes, fixed capacity.
    Publishes BlockStored/BlockRemoved (medium GPU) like a vLLM engine."""

    def __init__(self, node: str, capacity_blocks: int, endpoint: str, block_tokens: int) -> None:
        from kvstore.events.publisher import ZmqEventPublisher

        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pub = ZmqEventPublisher(node, endpoint, None)
        self._ns = _NsRef(block_tokens)

    def prefix(self, hashes: np.ndarray) -> int:
        n = 0
        for h in hashes.tolist():
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: np.ndarray) -> None:
        new = []
        for h in hashes.tolist():
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                new.append(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if new:
            self.pub.blocks_stored(self._ns, new, "GPU", None, None)
        if evicted:
            self.pub.blocks_removed(self._ns, evicted, "GPU")

    def close(self) -> None:
        self.pub.close()


@dataclass(frozen=True)
class _NsRef:
    block_size_tokens: int
    namespace_id: str = "agentic"
    model: str = MODEL
    tenant: str = ""
