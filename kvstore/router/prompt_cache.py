"""Token-id prompts parsed incrementally from the request's JSON bytes.

An agent's next turn re-sends its whole context as token ids: for a 195k-token
prompt, decoding the JSON array into Python ints and those into an int64 array
costs ~7 ms here (msgspec ~4.8 ms, numpy ~2.5 ms), more than the routing
decision itself. But the client serializes the same ids the same way each turn,
so the new prompt's bytes start with the previous one's: ``PromptBytesCache``
keeps, for recent large prompts, the bytes of the array up to and including the
comma after its last remembered token (``[t0, t1, ..., tk,``) with those tokens
as an array, finds a stored prefix the new bytes start with (a ``memcmp``), and
parses only the rest (``[`` + the bytes after the prefix is a valid array).

Correct whatever the client sends: identical bytes up to a separator mean
identical tokens up to it (JSON numbers end at the comma); a prompt serialized
differently (other spacing) just misses and is parsed in full. The body is still
validated whole by the caller (``msgspec.Raw`` decoding), and the forwarded body
is the client's bytes, never rebuilt from this cache.

What it learns on a hit, that the first ids equal a stored entry's array, goes
on to the hashing (``token_ids_known``: a ``KnownPrefix``), which then need not
compare those ids with the stored hash chain (that chain is held in the same
array when the router hashed the earlier prompt: hashing a re-sent 195k-token
context 0.96 -> 0.67 ms p50 in the decision bench, docs/router.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import numpy as np

from kvstore.errors import InvalidRequest
from kvstore_router_client.prefix_cache import KnownPrefix

# Smaller prompts parse in well under 0.1 ms: not worth an entry.
MIN_PROMPT_BYTES = 4096
# Entries are found by the first bytes of the array (the shared system prompt of
# a parent agent and its subagents): at most this many per key, LRU.
KEY_BYTES = 256
MAX_ENTRIES_PER_KEY = 16
_COMMA = ord(",")


@dataclass
class _Entry:
    prefix: bytes
    """The array's bytes through the comma after the last token of ``tokens``."""
    tokens: np.ndarray


def parse_token_ids(raw: bytes | memoryview) -> np.ndarray:
    """A JSON array of integers as int64 (InvalidRequest: anything else)."""
    try:
        ids = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"token ids: {e}") from None
    if not isinstance(ids, list):
        raise InvalidRequest("token ids must be a list of integers")
    try:
        return np.fromiter(ids, dtype=np.int64, count=len(ids))
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequest(f"token ids must be integers: {e}") from None


class PromptBytesCache:
    """Bounded LRU of large token-id prompts' byte prefixes. Not thread-safe: one per
    router loop."""

    def __init__(self, max_tokens: int = 8 << 20) -> None:
        if max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0; got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, list[_Entry]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    @property
    def stored_tokens(self) -> int:
        return self._tokens

    def token_ids(self, raw: bytes) -> np.ndarray:
        """The int64 token ids of the JSON array ``raw`` (as the client wrote it)."""
        return self.token_ids_known(raw)[0]

    def token_ids_known(self, raw: bytes) -> tuple[np.ndarray, KnownPrefix | None]:
        """``token_ids``, and on a hit which leading ids equal the stored entry's
        (for ``PrefixHashCache.hash(known=...)``; None on a miss)."""
        if len(raw) < MIN_PROMPT_BYTES:
            return parse_token_ids(raw), None
        key = raw[:KEY_BYTES]
        best: _Entry | None = None
        for e in self._entries.get(key, ()):
            if (best is None or len(e.prefix) > len(best.prefix)) and raw.startswith(e.prefix):
                best = e
        if best is None:
            self.misses += 1
            tokens = parse_token_ids(raw)
            self._remember(key, raw, tokens, 0, 0, None)
            return tokens, None
        self.hits += 1
        self._entries.move_to_end(key)
        start = len(best.prefix)
        tail = parse_token_ids(b"[" + raw[start:])
        tokens = np.concatenate([best.tokens, tail])
        self.reused_tokens += best.tokens.size
        self._remember(key, raw, tokens, start, best.tokens.size, best)
        # the stored ids then the tail's: the first best.tokens.size are best's
        return tokens, KnownPrefix(tokens, best.tokens, best.tokens.size)

    def _remember(
        self,
        key: bytes,
        raw: bytes,
        tokens: np.ndarray,
        start: int,
        known: int,
        parent: _Entry | None,
    ) -> None:
        """Store ``raw``'s prefix through the comma after its second-to-last token
        (``start``: a byte offset already known to follow token ``known - 1``)."""
        keep = tokens.size - 1  # tokens before the last separator
        if keep <= known:
            return
        tail = np.frombuffer(raw, dtype=np.uint8, offset=start)
        commas = np.flatnonzero(tail == _COMMA)
        if commas.size < keep - known:
            return  # not an array of numbers after all (the caller's decode said so)
        end = start + int(commas[keep - known - 1]) + 1
        entry = _Entry(raw[:end], tokens[:keep])
        entries = self._entries.setdefault(key, [])
        self._entries.move_to_end(key)
        if parent is not None and parent in entries:
            # the new prompt extends the old one entirely: keep one of them
            entries.remove(parent)
            self._tokens -= parent.tokens.size
        entries.append(entry)
        self._tokens += entry.tokens.size
        while len(entries) > MAX_ENTRIES_PER_KEY:
            self._tokens -= entries.pop(0).tokens.size
        while self._tokens > self.max_tokens and self._entries:
            k, old = next(iter(self._entries.items()))
            if k == key and len(self._entries) == 1 and len(old) == 1:
                break  # the one just stored, alone and over the cap: keep it
            self._tokens -= old.pop(0).tokens.size
            if not old:
                del self._entries[k]
