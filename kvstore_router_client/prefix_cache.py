"""Incremental block hashing for re-sent contexts: hash only the new tail.

An agent's next turn re-sends 90%+ of the previous one. Hashing 192k tokens
costs ~13 ms on the build machines (more than the indexer's Score), but the
chain of the previous turn is a prefix of this one's: the digests up to the
first changed block are the same. ``PrefixHashCache`` keeps the chains of
recent requests (their tokens and digests) in an LRU bounded by total tokens,
finds the longest stored chain that prefixes a new request (candidates share
the first block: same salt, same first tokens), and hashes only past it.

Finding it is a vectorised compare of the two token arrays (~0.1 ms for 195k
tokens), not a hash. Each entry also remembers the node its request was sent
to: that is the conversation's previous turn, for session affinity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.hashing import BlockHasher, to_int_hashes

# At most this many chains share one first-block key (a parent and its subagents);
# the least recently used one goes first.
MAX_CHAINS_PER_KEY = 16


# eq=False: chains are told apart by identity (``list.remove`` of a parent); a
# generated __eq__ would compare the token arrays and raise on their truth value.
@dataclass(eq=False)
class _Chain:
    tokens: np.ndarray  # int64, the full blocks only
    digests: list[bytes]
    ints: np.ndarray  # uint64 (the KV-event / kvstore form)
    node: str = ""


@dataclass(frozen=True)
class Hashed:
    hashes: np.ndarray
    """uint64 block hashes of every full block, as the engine computes them."""
    reused_blocks: int
    """Blocks whose digests came from a stored chain (not hashed again)."""
    previous_node: str
    """Where the request whose chain was reused went ("" = none recorded)."""
    chain: _Chain | None = None
    """The stored chain (pass the whole ``Hashed`` to ``PrefixHashCache.routed``)."""


class PrefixHashCache:
    """Bounded LRU of recent prefix hash chains. Not thread-safe: one per router loop."""

    def __init__(self, hasher: BlockHasher, max_tokens: int = 8 << 20) -> None:
        if max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0; got {max_tokens}")
        self.hasher = hasher
        self.max_tokens = max_tokens
        self._chains: OrderedDict[tuple[Any, ...], list[_Chain]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0
        self.reused_blocks = 0
        self.hashed_blocks = 0

    @property
    def stored_tokens(self) -> int:
        return self._tokens

    def hash(
        self,
        token_ids: Any,
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        remember: bool = True,
        owned: bool = False,
    ) -> Hashed:
        """Block hashes of ``token_ids``; stores the chain (LRU) unless ``remember`` is off.

        ``owned``: the caller hands an int64 array over and never changes it (the
        router's parsed prompts), so the chain keeps it instead of a copy: copying
        195k ids into fresh memory costs ~1 ms of page faults, most of a re-sent
        context's hashing."""
        bs = self.hasher.block_size
        # A list (a parsed JSON prompt) becomes an array this cache owns: fromiter
        # is the cheapest conversion (~2x asarray for 195k ints); an array the
        # caller passed is copied when stored (the caller may change it) unless owned.
        if isinstance(token_ids, list):
            owned = True
            try:
                tok = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
            except (TypeError, ValueError, OverflowError) as e:
                raise InvalidRequest(f"token ids must be integers: {e}") from None
        else:
            tok = np.asarray(token_ids)
            if tok.ndim != 1 or (tok.size and tok.dtype.kind not in "iu"):
                # the hasher raises the precise error
                self.hasher.hash_tokens(token_ids, cache_salt=cache_salt, lora=lora)
            tok = tok.astype(np.int64, copy=False)
        n_blocks = tok.size // bs
        if n_blocks == 0:
            return Hashed(np.zeros(0, dtype=np.uint64), 0, "")
        key = (cache_salt or "", lora, tok[:bs].tobytes())
        best, best_blocks = self._longest(key, tok, n_blocks)
        if best is None:
            self.misses += 1
            digests = self.hasher.hash_tokens(tok, cache_salt=cache_salt, lora=lora)
            ints = to_int_hashes(digests)
            previous = ""
        else:
            self.hits += 1
            tail = tok[best_blocks * bs : n_blocks * bs]
            # Extra keys after the first block: only a LoRA's (the salt is on block 0).
            more = self.hasher.hash_tokens(
                tail, parent=best.digests[best_blocks - 1], cache_salt=None, lora=lora
            )
            digests = best.digests[:best_blocks] + more
            ints = np.concatenate([best.ints[:best_blocks], to_int_hashes(more)])
            previous = best.node
        self.reused_blocks += best_blocks
        self.hashed_blocks += n_blocks - best_blocks
        chain = None
        if remember:
            kept = tok[: n_blocks * bs]
            chain = _Chain(kept if owned else kept.copy(), digests, ints)
            self._store(key, chain, best, best_blocks)
        return Hashed(ints, best_blocks, previous, chain)

    @staticmethod
    def routed(hashed: Hashed, node: str) -> None:
        """Record where the request ``hashed`` came from went (the next turn's affinity)."""
        if hashed.chain is not None:
            hashed.chain.node = node

    def _longest(
        self, key: tuple[Any, ...], tok: np.ndarray, n_blocks: int
    ) -> tuple[_Chain | None, int]:
        chains = self._chains.get(key)
        if not chains:
            return None, 0
        self._chains.move_to_end(key)
        bs = self.hasher.block_size
        best, best_blocks = None, 0
        for c in chains:
            m = min(c.tokens.size, n_blocks * bs)
            diff = np.flatnonzero(c.tokens[:m] != tok[:m])
            same = int(diff[0]) if diff.size else m
            blocks = same // bs
            if blocks > best_blocks:
                best, best_blocks = c, blocks
        return best, best_blocks

    def _store(
        self, key: tuple[Any, ...], chain: _Chain, parent: _Chain | None, parent_blocks: int
    ) -> None:
        chains = self._chains.setdefault(key, [])
        self._chains.move_to_end(key)
        if parent is not None and parent_blocks * self.hasher.block_size == parent.tokens.size:
            # The new chain extends the old one entirely: the old one is redundant.
            chains.remove(parent)
            self._tokens -= parent.tokens.size
            chain.node = parent.node
        chains.append(chain)
        self._tokens += chain.tokens.size
        while len(chains) > MAX_CHAINS_PER_KEY:
            self._tokens -= chains.pop(0).tokens.size
        while self._tokens > self.max_tokens and self._chains:
            k, old = next(iter(self._chains.items()))
            if k == key and len(self._chains) == 1 and len(old) == 1:
                break  # the one we just stored, alone and larger than the cap: keep it
            self._tokens -= old.pop(0).tokens.size
            if not old:
                del self._chains[k]
