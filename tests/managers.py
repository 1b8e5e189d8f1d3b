"""In-process BlockManagers over temporary DRAM regions, for placement and tier tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstore.config import load_config
from kvstore.manager import BlockManager
from kvstore.tiers.dram import Region
from tests.sinks import RecordingSink


@contextlib.contextmanager
def managers(tmp_path: Path, *defaults: str) -> Iterator[Callable[..., BlockManager]]:
    """``make(*settings)``: a manager configured by ``defaults`` then ``settings``
    ("key=value"), each on a region file of its own (not prefaulted, no huge
    pages) under ``tmp_path``, recording its events; the regions go at exit."""
    made: list[Region] = []

    def make(*settings: str) -> BlockManager:
        assignments = [*defaults, f"dram.path={tmp_path}/r{len(made)}", *settings]
        config = load_config(environ={}, assignments=assignments)
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        made.append(region)
        return BlockManager(config, region, RecordingSink())

    try:
        yield make
    finally:
        for r in made:
            r.close(unlink=True)
