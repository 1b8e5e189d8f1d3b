"""Redis / Valkey index: several indexer replicas share it; a restart loses nothing.

Layout (``p`` = the configured key prefix, default ``kvidx``):

- ``p:nodes`` hash ``node -> id`` and ``p:next_id`` counter. Ids are never
  reused, so a replica holding a stale id map can never credit one node's
  blocks to another. A DP rank's engine GPU entries have an id of their own,
  under the member name ``<node>@<rank>`` (``backend.rank_member``).
- ``p:models`` set of model names.
- ``p:m:<len>:<model>:<8-byte big-endian block hash>`` string, ``len`` the
  model name's length in UTF-8 bytes: a bit array with bit
  ``medium * max_nodes + id`` (``SETBIT`` order) set while node ``id`` holds
  the block in that medium (``backend.MEDIUMS`` order: 0 engine GPU, 1 CPU,
  2 DISK, 3 the daemon's GPU tier). The length prefix makes every model's
  keys a prefix no other model's keys share (``p:m:1:a:`` cannot match model
  ``a:b``, whose keys start ``p:m:3:a:b:``). Medium-major with a
  fixed stride, so a fetched row converts to node bitsets with one bit-order
  table lookup. A key whose bits all clear is deleted, so memory follows the
  live index. ``p:layout`` records the stride; an indexer configured with
  another ``max_nodes`` refuses to start rather than misread the bits.
- ``p:epoch`` a random value set when the index's data is first written: a
  replica that finds another one knows Redis lost the data (a restart
  without persistence, a flush) and rebuilds.
- ``p:cursor:<source>`` last applied sequence number of an event source, so
  a restarted indexer asks its publishers to replay exactly what it missed.

Every multi-key operation is one Lua script call carrying the hashes packed
in a single argument: one round trip per batch and no per-key argument
encoding in Python. A node's clear is one script that SCANs every model it
names inside Redis, so it is atomic: two ingesting replicas clearing and
re-adding one node cannot interleave (the script blocks Redis while it
runs, ~1 s per million keys of the cleared models). Score fetches the bit arrays of a chunk of hashes as one
concatenated string and runs the same numpy scorer as the in-memory index.
Not for Redis Cluster (scripts build key names themselves).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.errors import BackendError, InvalidRequest, Unavailable
from kvstore.indexer.backend import (
    MEDIUMS,
    RANK_MARK,
    NodeScore,
    fold_ranks,
    group_ranks,
    medium_index,
    prefix_scores,
    rank_member,
    split_member,
)

_MEDIUMS = len(MEDIUMS)
_LAYOUT = "bits-v2"
# bit b (MSB first, Redis's SETBIT order) -> bit b (LSB first, numpy/our order)
_REVERSE_BITS = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], dtype=np.uint8)

_SET_BITS = """
local p, hs, off, val = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pad = string.rep('\\0', tonumber(ARGV[5]))
for i = 1, #hs / 8 do
  local k = p .. string.sub(hs, i * 8 - 7, i * 8)
  if val == 1 then
    -- full width from the start: Score then returns rows without padding
    redis.call('SET', k, pad, 'NX')
    redis.call('SETBIT', k, off, 1)
  elseif redis.call('EXISTS', k) == 1 then
    redis.call('SETBIT', k, off, 0)
    if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
  end
end
return #hs / 8
"""

_GET_ROWS = """
-- ARGV[1]: the full keys, each exactly ARGV[2] bytes, back to back (the client
-- builds them with numpy: one Lua string per key instead of two)
local ks, kl, w = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local pad = string.rep('\\0', w)
local out = {}
local n = #ks / kl
local i = 1
-- MGET in slices: Lua's unpack() takes at most ~8000 values
while i <= n do
  local keys = {}
  local m = math.min(n - i + 1, 7000)
  for j = 1, m do
    local a = (i + j - 2) * kl + 1
    keys[j] = string.sub(ks, a, a + kl - 1)
  end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, m do
    local v = vals[j]
    if not v then
      v = pad
    elseif #v ~= w then
      v = string.sub(v .. pad, 1, w)
    end
    out[i + j - 1] = v
  end
  i = i + m
end
return table.concat(out)
"""

_CLEAR_NODE = """
-- ARGV: node id, stride, SCAN count, n mediums, the mediums, then key patterns
local off, stride, count, nm = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local cleared = 0
for p = 5 + nm, #ARGV do
  local cursor = '0'
  repeat
    local r = redis.call('SCAN', cursor, 'MATCH', ARGV[p], 'COUNT', count)
    cursor = r[1]
    for _, k in ipairs(r[2]) do
      for i = 5, 4 + nm do
        redis.call('SETBIT', k, off + tonumber(ARGV[i]) * stride, 0)
      end
      if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
      cleared = cleared + 1
    end
  until cursor == '0'
end
return cleared
"""

_NODE_ID = """
redis.call('SREM', KEYS[3], ARGV[1])
local id = redis.call('HGET', KEYS[1], ARGV[1])
if id then return tonumber(id) end
id = redis.call('INCR', KEYS[2]) - 1
redis.call('HSET', KEYS[1], ARGV[1], id)
return id
"""


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _glob_escape_bytes(b: bytes) -> bytes:
    out = bytearray()
    for c in b:
        if c in b"*?[]\\":
            out.append(0x5C)  # backslash
        out.append(c)
    return bytes(out)


class RedisIndex:
    """``IndexBackend`` over Redis/Valkey (``redis`` package, imported here only)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "kvidx",
        *,
        timeout_s: float = 5.0,
        max_nodes: int = 128,
        scan_count: int = 2000,
    ) -> None:
        try:
            import redis
        except ImportError as e:  # the indexer's Redis backend needs the extra
            raise BackendError("the Redis index needs the 'redis' package") from e
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        # Score replies are ~0.5 MB; redis-py's default 64 KiB reads make
        # parsing them ~3x slower than 1 MiB reads (measured here).
        self._r = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            socket_read_size=1 << 20,
        )
        self._p = key_prefix
        if max_nodes <= 0 or max_nodes % 64:
            raise InvalidRequest(
                f"Redis index max_nodes must be a positive multiple of 64; got {max_nodes}"
            )
        self._max_nodes = max_nodes
        self._words = max_nodes // 64
        self._width = _MEDIUMS * max_nodes // 8
        self._scan_count = scan_count
        self._ids: dict[str, int] = {}
        self._ids_models: set[str] = set()
        try:
            self._r.ping()
            self._set_bits = self._r.register_script(_SET_BITS)
            self._get_rows = self._r.register_script(_GET_ROWS)
            self._clear_node = self._r.register_script(_CLEAR_NODE)
            self._node_id = self._r.register_script(_NODE_ID)
            layout = self._layout = f"{_LAYOUT} max_nodes={max_nodes}"
            self._r.set(f"{self._p}:layout", layout, nx=True)
            raw_layout = self._r.get(f"{self._p}:layout")
            stored = raw_layout.decode() if isinstance(raw_layout, bytes) else str(raw_layout)
            self._epoch = self._read_epoch()
        except redis.RedisError as e:
            raise Unavailable(f"Redis at {url} is unreachable: {e}") from e
        if stored != layout:
            raise InvalidRequest(
                f"Redis index at {url} prefix {key_prefix!r} has layout {stored!r}, "
                f"this indexer is configured for {layout!r}"
            )

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except self._redis_errors as e:
            raise Unavailable(f"Redis index: {e}") from e

    def _model_prefix(self, model: str) -> bytes:
        name = model.encode()
        return f"{self._p}:m:{len(name)}:".encode() + name + b":"

    @staticmethod
    def _parse_model(key: bytes, head: int) -> str | None:
        """The model of a ``p:m:<len>:<model>:<hash>`` key (``head`` = len of ``p:m:``)."""
        colon = key.find(b":", head)
        if colon < 0:
            return None
        try:
            n = int(key[head:colon])
        except ValueError:
            return None
        start = colon + 1
        if len(key) != start + n + 9 or key[start + n : start + n + 1] != b":":
            return None
        return key[start : start + n].decode(errors="replace")

    def _read_epoch(self) -> bytes:
        """This index's epoch: a random value set once per life of the data."""
        key = f"{self._p}:epoch"
        self._r.set(key, secrets.token_hex(8), nx=True)
        raw = self._r.get(key) or b""
        return raw.encode() if isinstance(raw, str) else bytes(raw)

    def ping(self) -> bool:
        """Unavailable if Redis is unreachable; True if it lost this index since the last ping.

        Redis restarted without persistence (or flushed) loses the epoch key;
        the first replica to ping sets a new one, and every replica sees it
        differ from the one it knew: its cached node ids and models are void
        (another replica may have handed the ids out anew), and every source
        must resync.
        """
        epoch = self._call(self._read_epoch)
        if epoch == self._epoch:
            return False
        self._epoch = epoch
        self._call(self._r.set, f"{self._p}:layout", self._layout, nx=True)
        self._ids.clear()
        self._ids_models.clear()
        return True

    @staticmethod
    def _packed(hashes: np.ndarray) -> bytes:
        return hashes.astype(">u8").tobytes()

    @staticmethod
    def _keys(prefix: bytes, hashes: np.ndarray) -> bytes:
        """``prefix + 8-byte BE hash`` for every hash, back to back."""
        keys = np.empty((hashes.size, len(prefix) + 8), dtype=np.uint8)
        keys[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        keys[:, len(prefix) :] = hashes.astype(">u8").view(np.uint8).reshape(-1, 8)
        return keys.tobytes()

    # --- nodes -------------------------------------------------------------------

    def _id(self, node: str) -> int:
        nid = self._ids.get(node)
        if nid is None:
            nid = int(
                self._call(
                    self._node_id,
                    keys=[f"{self._p}:nodes", f"{self._p}:next_id", f"{self._p}:dropped"],
                    args=[node],
                )
            )
            if nid >= self._max_nodes:
                raise InvalidRequest(f"Redis index holds node ids up to {self._max_nodes}")
            self._ids[node] = nid

        return nid

    def _node_map(self) -> dict[str, int]:
        raw = self._call(self._r.hgetall, f"{self._p}:nodes")
        return {k.decode(): int(v) for k, v in raw.items()}

    def nodes(self) -> list[str]:
        return sorted(n for n in self._live_ids() if RANK_MARK not in n)

    def models(self) -> list[str]:
        return sorted(m.decode() for m in self._call(self._r.smembers, f"{self._p}:models"))

    # --- events ------------------------------------------------------------------

    def add(
        self,
        model: str,
        node: str,
        medium: str | None,
        hashes: np.ndarray,
        rank: int | None = None,
    ) -> None:
        if hashes.size == 0:
            return
        m = medium_index(medium)
        member = rank_member(node, rank)
        if rank is not None:
            self._id(node)  # a node has an id whenever one of its ranks has
        off = m * self._max_nodes + self._id(member)
        if model not in self._ids_models:
            self._call(self._r.sadd, f"{self._p}:models", model)
            self._ids_models.add(model)
        self._call(
            self._set_bits,
            args=[self._model_prefix(model), self._packed(hashes), off, 1, self._width],
        )

    def remove(
        self,
        model: str,
        node: str,
        medium: str | None,
        hashes: np.ndarray,
        rank: int | None = None,
    ) -> None:
        if hashes.size == 0:
            return
        m = medium_index(medium)
        member = rank_member(node, rank)
        nid = self._ids.get(member)
        if nid is None:
            nid = self._node_map().get(member)
            if nid is None:
                return
            self._ids[member] = nid
        off = m * self._max_nodes + nid
        self._call(
            self._set_bits,
            args=[self._model_prefix(model), self._packed(hashes), off, 0, self._width],
        )

    def clear(
        self,
        node: str,
        model: str | None,
        mediums: Sequence[str] | None = None,
        rank: int | None = None,
    ) -> None:
        nid = self._node_map().get(rank_member(node, rank))
        if nid is None:
            return
        ms = (
            list(range(_MEDIUMS)) if mediums is None else sorted({medium_index(m) for m in mediums})
        )
        models = self.models() if model is None else [model]
        patterns = [_glob_escape_bytes(self._model_prefix(m)) + b"*" for m in models]
        if patterns:
            self._call(
                self._clear_node,
                args=[nid, self._max_nodes, self._scan_count, len(ms), *ms, *patterns],
            )

    def drop_node(self, node: str) -> None:
        # The id stays bound to the name: a replica with a cached map can
        # never credit another node's blocks to it, and a node that comes back
        # gets its old id. Ids run out only past max_nodes distinct names.
        for member in self._rank_members(self._node_map(), node):
            _, rank = split_member(member)
            self.clear(node, None, rank=rank)
            self._call(self._r.sadd, f"{self._p}:dropped", member)
            self._ids.pop(member, None)
        self.clear(node, None)
        self._call(self._r.sadd, f"{self._p}:dropped", node)
        self._ids.pop(node, None)

    @staticmethod
    def _rank_members(ids: dict[str, int], node: str) -> list[str]:
        head = node + RANK_MARK
        return [n for n in ids if n.startswith(head) and split_member(n)[0] == node]

    def _live_ids(self) -> dict[str, int]:
        ids = self._node_map()
        for n in self._call(self._r.smembers, f"{self._p}:dropped"):
            ids.pop(n.decode(), None)
        return ids

    # --- cursors -------------------------------------------------------------------

    def load_cursor(self, source: str) -> int | None:
        v = self._call(self._r.get, f"{self._p}:cursor:{source}")
        return None if v is None else int(v)

    def save_cursor(self, source: str, seq: int) -> None:
        self._call(self._r.set, f"{self._p}:cursor:{source}", seq)

    def forget_cursor(self, source: str) -> None:
        self._call(self._r.delete, f"{self._p}:cursor:{source}")

    # --- queries -----------------------------------------------------------------

    def score(
        self, model: str, hashes: np.ndarray, nodes: Sequence[str] | None = None
    ) -> list[NodeScore]:
        if hashes.size == 0:
            return []
        ids = self._node_map()
        wanted = ids if nodes is None else {n: ids[n] for n in nodes if n in ids}
        if not wanted:
            return []
        pairs: list[tuple[int, int]] = []  # (node id, rank member id) to fold
        members = {n: nid for n, nid in ids.items() if RANK_MARK in n}
        if members:
            # a dropped node's ranks keep their ids (ids are never reused) but
            # must not come back with it: only live ranks are scored
            for n in self._call(self._r.smembers, f"{self._p}:dropped"):
                members.pop(n.decode(), None)
            wanted = {n: nid for n, nid in wanted.items() if RANK_MARK not in n}
            for name, nid in members.items():
                base, _ = split_member(name)
                if base in wanted:
                    pairs.append((wanted[base], nid))
                    wanted[name] = nid
        alive = np.zeros(self._words, dtype=np.uint64)
        for nid in wanted.values():
            alive[nid // 64] |= np.uint64(1 << (nid % 64))
        prefix = self._model_prefix(model)
        parts: list[np.ndarray] = []
        running = alive.copy()
        start, chunk = 0, 512
        while start < hashes.size:
            blob = self._call(
                self._get_rows,
                args=[
                    self._keys(prefix, hashes[start : start + chunk]),
                    len(prefix) + 8,
                    self._width,
                ],
            )
            rows = self._rows(blob)
            if pairs:
                fold_ranks(rows, pairs)
            parts.append(rows)
            held = np.bitwise_or.reduce(rows, axis=1) & running
            running = np.bitwise_and.reduce(held, axis=0)
            if not running.any():
                break
            start += chunk
            chunk *= 4
        by_id = {nid: n for n, nid in wanted.items()}
        return group_ranks(prefix_scores(np.concatenate(parts), alive, by_id))

    def _rows(self, blob: bytes) -> np.ndarray:
        """Redis bit arrays (SETBIT order) -> (n, medium, word) uint64 node bitsets."""
        raw = np.frombuffer(blob, dtype=np.uint8)
        if raw.size % self._width:
            raise BackendError(f"Redis index returned {raw.size} bytes, not rows of {self._width}")
        return _REVERSE_BITS[raw].view(np.uint64).reshape(-1, _MEDIUMS, self._words)

    def load_into(self, target: Any, batch_keys: int = 4096) -> int:
        """Copy the whole index into ``target`` (an ``IndexBackend``); returns blocks read.

        SCAN in batches and MGET the bit arrays; (block, node, tier) triples
        come out of one unpack per batch and reach ``target`` as one add per
        (model, node, tier) at the end.
        """
        names = {nid: name for name, nid in self._live_ids().items()}
        pattern = _glob_escape(f"{self._p}:m:") + "*"
        head = len(f"{self._p}:m:".encode())
        groups: dict[tuple[str, int], list[np.ndarray]] = {}
        total, cursor = 0, 0
        while True:
            cursor, keys = self._call(self._r.scan, cursor=cursor, match=pattern, count=batch_keys)
            if keys:
                values = self._call(self._r.mget, keys)
                by_model: dict[str, list[tuple[bytes, bytes]]] = {}
                for k, v in zip(keys, values, strict=True):
                    model_name = self._parse_model(k, head)
                    if v is None or model_name is None:
                        continue  # deleted since SCAN saw it, or not a block key
                    by_model.setdefault(model_name, []).append((k[-8:], v))
                for model, items in by_model.items():
                    hashes = np.frombuffer(b"".join(h for h, _ in items), dtype=">u8")
                    blob = b"".join(v.ljust(self._width, b"\0")[: self._width] for _, v in items)
                    # bit j of a row (MSB first) = medium j // max_nodes, node j % max_nodes
                    bits = np.unpackbits(
                        np.frombuffer(blob, dtype=np.uint8).reshape(len(items), -1), axis=1
                    )
                    row, col = np.nonzero(bits)
                    total += len(items)
                    if row.size == 0:
                        continue
                    order = np.argsort(col, kind="stable")
                    row, col = row[order], col[order]
                    cuts = np.flatnonzero(np.diff(col)) + 1
                    for r, c in zip(np.split(row, cuts), col[np.r_[0, cuts]].tolist(), strict=True):
                        groups.setdefault((model, c), []).append(hashes[r])
            if cursor == 0:
                break
        for (model, c), parts in groups.items():
            name = names.get(c % self._max_nodes)
            if name is not None:
                medium = MEDIUMS[c // self._max_nodes]
                target.add(model, name, medium, np.concatenate(parts).astype(np.uint64))
        return total

    def stats(self) -> dict[str, int]:
        info = self._call(self._r.info, "memory")
        return {
            "models": len(self.models()),
            "nodes": sum(RANK_MARK not in n for n in self._node_map()),
            "keys": int(self._call(self._r.dbsize)),
            "bytes": int(info.get("used_memory", 0)),
        }

    def close(self) -> None:
        self._r.close()
