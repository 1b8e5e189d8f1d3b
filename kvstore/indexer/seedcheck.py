"""Do the engines hash token ids the way this indexer does?

vLLM seeds the first block hash of every chain from ``PYTHONHASHSEED`` (else a
fixed string) and hashes with ``--prefix-caching-hash-algo``: engines and an
indexer that differ in either never share a block, silently. A ``BlockStored``
that starts a chain (no parent) and carries its token ids tells: hash its
first block as this indexer would and compare. vLLM's own events carry their
extra keys (LoRA, cache salt), so the check is exact for them; a daemon's
events carry none, so a tenant's ``cache_salt`` also makes its first blocks
differ, which is why a mismatch is reported (counted per model, warned about
loudly) and never used to reject requests.

The same check learns each model's hash scheme (``schemes``): the algorithm
(this indexer's, else whichever of vLLM's cryptographic ones reproduces the
block) and vLLM 0.33's lookahead L (an engine's event carries the L tokens
past each block, ``lookahead_token_ids``). Only a scheme that reproduces a
block exactly is learned, so a router hashing token ids with it computes what
the engines compute.

Bounded: at most one check per model per ``min_interval_s``, models capped.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from kvstore.errors import KVStoreError
from kvstore.events.wire import block_hash_to_int
from kvstore.hashing import BlockHasher, HashScheme

log = logging.getLogger(__name__)

_MAX_MODELS = 4_096
_MAX_HASHERS = 16
_NO_RAW = msgspec.Raw()
# tried after this indexer's own algorithm (the seeded ones need the seed)
_OTHER_ALGOS = ("sha256", "sha256_cbor")


class SeedVerdict(msgspec.Struct, frozen=True):
    checked: int = 0
    mismatched: int = 0


class SeedChecker:
    def __init__(
        self,
        algo: str = "sha256",
        seed: str | None = None,
        *,
        min_interval_s: float = 0.5,
        warn_interval_s: float = 60.0,
    ) -> None:
        self._algo = algo
        self._seed = seed
        self._min_interval_s = min_interval_s
        self._warn_interval_s = warn_interval_s
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        self._last: dict[str, float] = {}
        self._warned: dict[str, float] = {}
        self.verdicts: dict[str, SeedVerdict] = {}
        # model -> the scheme its engines' first blocks were last reproduced with
        self.schemes: dict[str, HashScheme] = {}

    def _hasher(self, block_size: int, algo: str) -> BlockHasher:
        h = self._hashers.get((block_size, algo))
        if h is None:
            if len(self._hashers) >= _MAX_HASHERS:
                self._hashers.clear()
            h = self._hashers[(block_size, algo)] = BlockHasher(block_size, algo, self._seed)
        return h

    def offer(
        self,
        model: str,
        first_hash: int | bytes,
        block_size: int,
        token_ids: msgspec.Raw,
        extra_keys: msgspec.Raw,
        lora_name: str | None,
        lookahead_token_ids: msgspec.Raw = _NO_RAW,
    ) -> None:
        """A chain's first BlockStored: check it unless one was checked just now."""
        now = time.monotonic()
        if now - self._last.get(model, -1e18) < self._min_interval_s or lora_name:
            return  # a LoRA's path is not in the event: its hash cannot be redone
        if model not in self._last and len(self._last) >= _MAX_MODELS:
            return
        self._last[model] = now
        try:
            tokens = msgspec.msgpack.decode(token_ids)
            keys: Any = msgspec.msgpack.decode(extra_keys) if len(extra_keys) else None
            if not isinstance(tokens, list) or len(tokens) < block_size:
                return
            ahead: Any = (
                msgspec.msgpack.decode(lookahead_token_ids) if len(lookahead_token_ids) else None
            )
            block = tokens[:block_size]
            kw: dict[str, Any] = {}
            if isinstance(ahead, list) and ahead and isinstance(ahead[0], list) and ahead[0]:
                # the first block's hash also covers the L tokens after it
                block = block + ahead[0]
                kw["lookahead_tokens"] = len(ahead[0])
            if keys:
                kw["extra_keys"] = [tuple(k) if isinstance(k, list) else k for k in keys[:1]]
            want = block_hash_to_int(first_hash)
            matched = ""
            for algo in (self._algo, *(a for a in _OTHER_ALGOS if a != self._algo)):
                got = self._hasher(block_size, algo).hash_tokens_int(block, **kw)
                if got.size == 1 and int(got[0]) == want:
                    matched = algo
                    break
        except (KVStoreError, ValueError, TypeError, msgspec.DecodeError, RecursionError):
            return  # not ours to judge: the event was odd; the decoder counts that
        if matched:
            self.schemes[model] = HashScheme(matched, kw.get("lookahead_tokens", 0))
        v = self.verdicts.get(model, SeedVerdict())
        bad = matched != self._algo
        v = SeedVerdict(v.checked + 1, v.mismatched + int(bad))
        self.verdicts[model] = v
        if bad and now - self._warned.get(model, -1e18) >= self._warn_interval_s:
            self._warned[model] = now
            log.warning(
                "model %r: a chain's first block does not hash as this indexer hashes token "
                "ids (hash_algo=%s, hash_seed=%s; %d of %d checked differ). Engines run "
                "with another PYTHONHASHSEED or --prefix-caching-hash-algo never match a "
                "Score sent as token ids (a tenant's cache_salt also differs here)",
                model,
                self._algo,
                "PYTHONHASHSEED or default" if self._seed is None else repr(self._seed),
                v.mismatched,
                v.checked,
            )
