"""Storage media of the block store: the DRAM region, the disk file, the GPU
pool, and the slab pool that DRAM and the GPU pool share. ``Tier`` (defined in
kvstore.namespace, beside ``Block``) is re-exported here.

Values match ``kvstore.v1.Tier`` so the service converts with ``int()``.
"""

from __future__ import annotations

from kvstore.namespace import Tier

__all__ = ["Tier"]
