"""gRPC StoreService: translates protobuf <-> manager calls.

Errors leave through ``errors.abort`` (status and reason from the class). Packed fields
(hashes, offsets, token ids) are decoded with numpy in one call each, never
element by element.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import msgspec
import numpy as np

from kvstore import __version__, errors
from kvstore.auth import CLIENT_ID_METADATA_KEY
from kvstore.events.sink import SequencedSink
from kvstore.handling import (
    Chain,
    PeerFill,
    StoreRequests,
    pack_u64,
    tier_of,
)
from kvstore.handling import unpack_u64 as unpack_u64  # peer_service and the benches use it
from kvstore.identity import CURRENT, Authorizer
from kvstore.manager import STORE_ALLOCATED, STORE_NO_ROOM, BlockManager
from kvstore.namespace import NamespaceSpec
from kvstore.tiers import Tier
from kvstore.v1 import store_pb2 as pb
from kvstore.v1 import store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")


async def call(context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
    """Run fn; turn a kvstore error into the matching status (and abort the call)."""
    try:
        return fn()
    except errors.KVStoreError as exc:
        await errors.abort(context, exc)


async def call_async(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return await fn()
    except errors.KVStoreError as exc:
        await errors.abort(context, exc)


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Who owns the leases a call takes: the peer's host over TCP ("ipv4:10.0.0.5",
    any port: a client's reconnect keeps its leases), "unix" on the local socket.

    Only that caller may commit or release them; others are answered as for an id
    never issued. Local clients share one identity (gRPC does not expose the
    socket's peer credentials), so among them the unguessable lease id is the secret.
    """
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return kind + ":" + rest.rsplit(":", 1)[0]
    return kind


def tier_from_pb(value: int) -> Tier:
    """The tier a store or load asks for: UNSPECIFIED means DRAM."""
    return tier_of(value)


def spec_from_pb(spec: Any) -> NamespaceSpec:
    return NamespaceSpec(
        model=spec.model,
        dtype=spec.dtype,
        block_size_tokens=spec.block_size_tokens,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_bytes=spec.block_bytes,
        tp_rank=spec.tp_rank,
        tp_world_size=spec.tp_world_size or 1,
        pp_rank=spec.pp_rank,
        pp_world_size=spec.pp_world_size or 1,
        tenant=spec.tenant,
        layout=spec.layout,
    )


# Bound-address keys of the daemon that HelloResponse carries.
_HELLO_ADDRESSES = frozenset(
    (
        "socket_path",
        "tcp_address",
        "metrics_address",
        "events_publish_address",
        "events_replay_address",
        "peer_transport",
    )
)


# A snapshot waits this long for the event sender to reach its marker.
SNAPSHOT_MARK_TIMEOUT_S = 10.0
SNAPSHOT_MAX_HASHES_PER_MESSAGE = 65_536


def held_by_tier(manager: BlockManager, model: str) -> dict[str, tuple[int, dict[Tier, list[int]]]]:
    """Per model: its block size and the committed hashes in each tier, as events tell them.

    A block counts in every tier holding a copy: DRAM (a region slot), GPU (a
    pool slot), DISK (a disk slot; a DRAM block with a clean disk copy is in
    both), exactly the tiers whose BlockStored it got and no BlockRemoved.
    """
    out: dict[str, tuple[int, dict[Tier, list[int]]]] = {}
    for ns in list(manager.namespaces.values()):
        if model and ns.model != model:
            continue
        _, tiers = out.setdefault(
            ns.model, (ns.block_size_tokens, {Tier.GPU: [], Tier.DRAM: [], Tier.DISK: []})
        )
        for h, b in ns.blocks.items():
            if b.offset >= 0:
                tiers[Tier.DRAM].append(h)
            if b.gpu_offset >= 0:
                tiers[Tier.GPU].append(h)
            if b.disk_slot >= 0:
                tiers[Tier.DISK].append(h)
    return out


MAX_CLIENT_ID_CHARS = 64


def client_key(context: grpc.aio.ServicerContext) -> str:
    """Whose leases a call counts against: the id a Client sends (random per Client),
    else the gRPC peer. Self-declared: it bounds a leaking client, not a hostile one
    (the daemon-wide lease cap does that; see docs/security.md)."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_METADATA_KEY and isinstance(value, str):
            return "id:" + value[:MAX_CLIENT_ID_CHARS]
    return "peer:" + context.peer()


class StoreService(pb_grpc.StoreServiceServicer):
    def __init__(
        self,
        manager: BlockManager,
        peer_fill: PeerFill | None = None,
        *,
        peer_counters: Any = None,
        addresses: Callable[[], dict[str, str | None]] | None = None,
        auth: Authorizer | None = None,
    ) -> None:
        self.manager = manager
        self.config = manager.config
        self.peer_fill = peer_fill
        # kvstore.metrics.PeerCounters (None: peer transfer off); read by Stats
        self.peer_counters = peer_counters
        # the daemon's bound addresses (and peer transport), for Hello
        self.addresses = addresses or dict
        self.max_blocks = self.config.limits.max_blocks_per_request
        # the handling both front-ends share (kvstore.handling)
        # (the caller of each call: identity.CURRENT, set by kvstore.auth's interceptor)
        self.requests = StoreRequests(manager, peer_fill, auth)

    def _hashes(self, data: bytes) -> list[int]:
        return self.requests.hashes(data)

    async def Hello(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        region = self.manager.region
        gpu = self.manager.gpu
        gpu_fields: dict[str, Any] = {}
        if gpu is not None:
            handle = gpu.handle
            gpu_fields = {
                "gpu_device": self.config.gpu.device,
                "gpu_pool_bytes": gpu.capacity_bytes,
                "gpu_ipc_handle": msgspec.msgpack.encode(handle) if handle is not None else b"",
                "gpu_region_path": gpu.host_region.path if gpu.host_region is not None else "",
            }
        bound: dict[str, Any] = {
            k: v or "" for k, v in self.addresses().items() if k in _HELLO_ADDRESSES
        }
        return pb.HelloResponse(
            **gpu_fields,
            **bound,
            node_id=self.manager.node_id,
            version=__version__,
            region_path=region.path,
            region_bytes=region.capacity_bytes,
            max_message_bytes=self.config.server.max_message_bytes,
            default_lease_ttl_s=self.config.leases.default_ttl_s,
            max_block_bytes=self.config.dram.chunk_bytes,
            max_blocks_per_request=self.config.limits.max_blocks_per_request,
            region_id=region.region_id,
            presence_path=presence.path if (presence := self.manager.presence) else "",
        )

    async def DeclareNamespace(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not request.HasField("spec"):
            await errors.abort(context, errors.InvalidRequest("spec is required"))
        spec = await call(context, lambda: spec_from_pb(request.spec))
        who = CURRENT.get()
        d = await call(context, lambda: self.requests.declare_namespace(spec, who))
        return pb.DeclareNamespaceResponse(
            namespace_id=d.namespace_id,
            block_bytes=d.block_bytes,
            sibling_layouts=d.sibling_layouts,
        )

    async def PrepareStore(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        def run() -> Any:
            r = self.requests
            p = r.prepare_store(
                request.namespace_id,
                request.block_hashes,
                request.lease_ttl_s,
                request.tier,
                r.owner_of(caller_of(context), who),
                client_key(context),
                who,
            )
            return pb.PrepareStoreResponse(
                lease_id=p.lease_id,
                statuses=p.statuses,
                offsets=p.offsets,
                tier=p.tier,  # type: ignore[arg-type]
                lease_ttl_s=p.lease_ttl_s,
                region_id=p.region_id,
            )

        return await call(context, run)

    async def CommitStore(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        def run() -> Any:
            n = self.requests.commit_store(
                request.lease_id,
                request.block_hashes,
                request.parent_block_hash if request.has_parent_block_hash else None,
                request.token_ids,
                [
                    Chain(
                        c.blocks,
                        c.parent_block_hash if c.has_parent_block_hash else None,
                        c.token_ids,
                    )
                    for c in request.chains
                ],
                self.requests.owner_of(caller_of(context), who),
                who,
            )
            return pb.CommitStoreResponse(committed=n)

        return await call(context, run)

    @staticmethod
    def _lookup_response(result: Any) -> Any:
        return pb.LookupResponse(
            prefix_blocks=result.prefix_blocks,
            by_tier=[pb.TierCount(tier=int(t), blocks=n) for t, n in result.by_tier.items()],  # type: ignore[arg-type]
        )

    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()
        if not request.peer_hint:  # the hot path: no await
            return await call(
                context,
                lambda: self._lookup_response(
                    self.requests.lookup(request.namespace_id, request.block_hashes, who)
                ),
            )

        async def pull_then_look() -> Any:
            result = await self.requests.lookup_hinted(
                request.namespace_id,
                request.block_hashes,
                request.peer_hint,
                request.peer_timeout_s,
                who,
            )
            return self._lookup_response(result)

        return await call_async(context, pull_then_look)

    async def PrepareLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        async def run() -> Any:
            r = self.requests
            p = await r.prepare_load(
                request.namespace_id,
                request.block_hashes,
                request.lease_ttl_s,
                request.tier,
                request.peer_hint,
                request.peer_timeout_s,
                r.owner_of(caller_of(context), who),
                client_key(context),
                who,
            )
            return pb.PrepareLoadResponse(
                lease_id=p.lease_id,
                found_blocks=p.found_blocks,
                offsets=p.offsets,
                checksums=p.checksums,
                tier=p.tier,  # type: ignore[arg-type]
                lease_ttl_s=p.lease_ttl_s,
                region_id=p.region_id,
            )

        return await call_async(context, run)

    async def Release(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()
        owner = self.requests.owner_of(caller_of(context), who)
        n = await call(context, lambda: self.requests.release(list(request.lease_ids), owner, who))
        return pb.ReleaseResponse(released=n)

    async def Delete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()
        deleted, busy = await call(
            context, lambda: self.requests.delete(request.namespace_id, request.block_hashes, who)
        )
        return pb.DeleteResponse(deleted=deleted, busy=busy)

    async def Clear(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()
        n = await call(context, lambda: self.requests.clear(request.namespace_id, who))
        return pb.ClearResponse(removed=n)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        s = self.manager.stats()
        c = s.counters
        return pb.StatsResponse(
            node_id=s.node_id,
            uptime_s=s.uptime_s,
            tiers=[
                pb.TierStats(
                    tier=int(t.tier),  # type: ignore[arg-type]
                    capacity_bytes=t.capacity_bytes,
                    used_bytes=t.used_bytes,
                    blocks=t.blocks,
                    pinned_blocks=t.pinned_blocks,
                    huge_page_bytes=t.huge_page_bytes,
                    collapsing=t.collapsing,
                )
                for t in s.tiers
            ],
            namespaces=s.namespaces,
            active_leases=s.active_leases,
            lookup_hit_blocks=c.lookup_hit_blocks,
            lookup_miss_blocks=c.lookup_miss_blocks,
            evicted_blocks=c.evicted_blocks,
            expired_leases=c.expired_leases,
            stored_blocks=c.stored_blocks,
            loaded_blocks=c.loaded_blocks,
            demoted_blocks=c.demoted_blocks,
            promoted_blocks=c.promoted_blocks,
            tenants=[
                pb.TenantStats(
                    tenant=r.label,
                    namespaces=r.namespaces,
                    tenants=r.tenants,
                    dram_bytes=r.used_bytes[Tier.DRAM],
                    dram_quota_bytes=r.quota_bytes[Tier.DRAM],
                    disk_bytes=r.used_bytes[Tier.DISK],
                    disk_quota_bytes=r.quota_bytes[Tier.DISK],
                    gpu_bytes=r.used_bytes[Tier.GPU],
                    gpu_quota_bytes=r.quota_bytes[Tier.GPU],
                )
                for r in s.tenants
            ],
            replica_blocks=s.replica_blocks,
            admitted_replicas=c.admitted_replicas,
            promoted_replicas=c.promoted_replicas,
            evicted_replica_blocks=c.evicted_replica_blocks,
            evicted_redundant_blocks=c.evicted_redundant_blocks,
            peer=[
                pb.PeerTransportStats(transport=t, **dataclasses.asdict(p))
                for t, p in (self.peer_counters.by_transport.items() if self.peer_counters else ())
                if t != "unknown" or dataclasses.astuple(p) != dataclasses.astuple(type(p)())
            ],
        )

    async def PutInline(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        def run() -> Any:
            self.requests.allow_namespace(who, request.namespace_id, "PutInline")
            m = self.manager
            hashes = self._hashes(request.block_hashes)
            ns = m.namespace(request.namespace_id)
            expected = len(hashes) * ns.block_bytes
            if len(request.data) != expected:
                raise errors.BlockSizeMismatch(
                    f"data has {len(request.data)} bytes; {len(hashes)} blocks of "
                    f"{ns.block_bytes} bytes need {expected}"
                )
            plan = m.prepare_store(ns.namespace_id, hashes)
            data = (
                np.frombuffer(request.data, dtype=np.uint8).reshape(len(hashes), ns.block_bytes)
                if hashes
                else None
            )
            region = m.region.array
            stored = 0
            for i, status in enumerate(plan.statuses):
                if status == STORE_ALLOCATED:
                    off = plan.offsets[i]
                    region[off : off + ns.block_bytes] = data[i]  # type: ignore[index]
                    stored += 1
            if plan.lease_id:
                m.commit_store(plan.lease_id)
            no_room = plan.statuses.count(STORE_NO_ROOM)
            return pb.PutInlineResponse(
                stored=stored, skipped=len(hashes) - stored - no_room, no_room=no_room
            )

        return await call(context, run)

    async def GetInline(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        async def run() -> Any:
            self.requests.allow_namespace(who, request.namespace_id, "GetInline")
            m = self.manager
            hashes = self._hashes(request.block_hashes)
            ns = m.namespace(request.namespace_id)
            limit = self.config.server.max_message_bytes - 1024
            if len(hashes) * ns.block_bytes > limit:
                raise errors.InvalidRequest(
                    f"{len(hashes)} blocks of {ns.block_bytes} bytes exceed the "
                    f"{self.config.server.max_message_bytes}-byte message limit; ask for fewer"
                )
            plan = await m.prepare_load_async(ns.namespace_id, hashes)
            try:
                region = m.region.array
                data = b"".join(region[o : o + ns.block_bytes].tobytes() for o in plan.offsets)
            finally:
                if plan.lease_id:
                    m.release([plan.lease_id])
            return pb.GetInlineResponse(found_blocks=len(plan.blocks), data=data)

        return await call_async(context, run)

    async def Snapshot(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # every tenant's block hashes: the indexer's (node role) or an admin's
        await call(context, lambda: self.requests.allow_role(CURRENT.get(), "Snapshot", "node"))
        sink = self.manager.sink
        if not isinstance(sink, SequencedSink):
            await errors.abort(
                context, errors.StateConflict("KV events are off: no sequence to snapshot at")
            )
            return
        per_msg = request.max_hashes_per_message or SNAPSHOT_MAX_HASHES_PER_MESSAGE
        per_msg = min(per_msg, SNAPSHOT_MAX_HASHES_PER_MESSAGE)
        # The marker and the walk share one event-loop step (no await between):
        # nothing the manager does can fall between them.
        mark = sink.mark()
        held = held_by_tier(self.manager, request.model)
        next_seq = 0
        try:
            next_seq = await asyncio.wait_for(asyncio.wrap_future(mark), SNAPSHOT_MARK_TIMEOUT_S)
        except errors.KVStoreError as exc:
            await errors.abort(context, exc)
        except TimeoutError:
            await errors.abort(
                context,
                errors.Unavailable(
                    f"the KV event sender did not reach the snapshot within "
                    f"{SNAPSHOT_MARK_TIMEOUT_S}s"
                ),
            )
        for model, (block_size, tiers) in held.items():
            for tier, hashes in tiers.items():
                for i in range(0, len(hashes), per_msg):
                    yield pb.SnapshotChunk(
                        next_seq=next_seq,
                        model=model,
                        tier=int(tier),  # type: ignore[arg-type]
                        block_hashes=pack_u64(hashes[i : i + per_msg]),
                        block_size_tokens=block_size,
                    )
            if not any(tiers.values()):
                # a model with namespaces but no blocks still tells its block size
                yield pb.SnapshotChunk(next_seq=next_seq, model=model, block_size_tokens=block_size)
        yield pb.SnapshotChunk(next_seq=next_seq, done=True)
