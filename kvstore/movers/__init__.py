"""Movers of the block store: they decide which blocks move between the storage
media (``kvstore.tiers``) and do the I/O, and report every change of where a
block lives to ``kvstore.placement.Placement``; they never import the manager.

- ``disk``: demotion DRAM -> disk and promotion disk -> DRAM (``DiskLayer``).
- ``gpu``: moves between the GPU pool and DRAM (``GpuLayer``).
- ``warm``: warm restart of the DRAM tier (the manifest written on drain).

They sit above ``kvstore.placement`` and below ``kvstore.manager`` (see
tests/unit/test_layers.py and docs/architecture.md).
"""
