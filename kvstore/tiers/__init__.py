"""Memory tiers of the block store, fastest first.

Values match ``kvstore.v1.Tier`` so the service converts with ``int()``.
"""

from __future__ import annotations

import enum

from kvstore.events.sink import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU


class Tier(enum.IntEnum):
    GPU = 1
    DRAM = 2
    DISK = 3

    @property
    def medium(self) -> str:
        """vLLM's KV-event `medium` for this tier."""
        return {Tier.GPU: MEDIUM_GPU, Tier.DRAM: MEDIUM_CPU, Tier.DISK: MEDIUM_DISK}[self]
