"""What the scheduler side tells the workers each step (vLLM pickles it across processes).

    StepPlan
      loads: LoadSpec per request with an external hit: vLLM block ids to fill,
             and the block hashes to fetch, prefix order
      saves: SaveSpec per request with newly computed full blocks: vLLM block
             ids to copy out, their hashes, the hash before the first one and
             their token ids (for the daemon's KV events)
      deferred: requests that finished with blocks not saved yet (saves above):
             vLLM keeps their blocks until the workers report them done

Hashes travel as uint64 numpy arrays and token ids as int32 arrays: compact
to pickle, and what the daemon's packed wire format wants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class LoadSpec:
    req_id: str
    tenant: str
    block_ids: np.ndarray  # int64, vLLM block ids to fill, in prefix order
    block_hashes: np.ndarray  # uint64, same length

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.block_hashes), "one hash per block"


@dataclass(slots=True)
class SaveSpec:
    req_id: str
    tenant: str
    block_ids: np.ndarray  # int64
    block_hashes: np.ndarray  # uint64, same length
    parent_block_hash: int | None  # hash of the block before block_hashes[0]; None = first block
    token_ids: np.ndarray  # int32, block_size tokens per block

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.block_hashes), "one hash per block"


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.deferred)


# The plan of every step with nothing to load, save or hand back (the scheduler's
# quiet steps: most decode steps), one object for all of them, so neither side
# builds anything for such a step: the connector hands vLLM one metadata object
# for it and the worker knows it by identity. Nothing writes to a plan after the
# scheduler built it, and this one is never built on. (Pickled to a worker in
# another process it arrives as an empty plan, which the worker checks as any.)
IDLE_PLAN = StepPlan()
