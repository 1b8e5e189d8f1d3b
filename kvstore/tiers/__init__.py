"""Storage media of the block store (the DRAM region, the disk file, the GPU
pool, and ``pool.SlabPool``, the slot bookkeeping under DRAM and the GPU pool
alike). They sit below ``kvstore.placement``; the movers between them are in
``kvstore.movers`` (see tests/unit/test_layers.py).
``Tier`` (defined in kvstore.namespace, beside ``Block``) is re-exported here.

Values match ``kvstore.v1.Tier`` so the service converts with ``int()``.
"""

from __future__ import annotations

from kvstore.namespace import Tier

__all__ = ["Tier"]
