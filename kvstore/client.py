"""Client of the node daemon: control over gRPC, bytes through shared memory.

    with Client("unix:/tmp/kvstore.sock") as c:
        ns = c.declare_namespace(NamespaceSpec(model="m", dtype="float16", ..., block_bytes=65536))
        c.put(ns, hashes, blocks)                 # blocks: (n, block_bytes) uint8 array or tensor
        found, data = c.get(ns, hashes)           # the longest present prefix
        c.lookup(ns, hashes).prefix_blocks

The client maps the daemon's DRAM region once (the path comes from Hello) and
copies block bytes itself with batched gathers/scatters, so bytes never cross
gRPC on one node. Every PrepareStore/PrepareLoad answer names the region its
offsets point into (``region_id``, new at each daemon start): a client that
outlived a daemon restart re-maps the new region before it touches a slot
(keeping its mapping when a warm restart kept the same file), never writes or
reads through the stale one. A namespace the daemon dropped (Clear, or idle
and empty) is declared again, once, by the call that finds it gone. A client
that cannot map the region (another host) uses the *Inline calls instead. Lower-level two-phase calls (prepare_store /
commit_store, prepare_load / release) let connectors copy straight between the
region and their own buffers.

Errors come back as the exact kvstore.errors class the daemon raised (rebuilt
from the reason code it sends: ``errors.error_from_rpc``).

Direct loads: where the daemon publishes slot locations in its presence table
(docs/presence.md), ``get`` and ``prepare_load(..., pin=False)`` read DRAM
blocks with no call and no lease, then check with ``intact(handle)`` that no
block left its slot during the copy (what did is loaded the leased way, or
reported). The daemon learns of those loads from one message ``intact`` sends
without waiting (its counters, its eviction order).

Leases are fenced by the client's own clock: a handle's ``deadline_s`` is the
lease's granted lifetime counted from before the request was sent, less a
margin, so it is never later than the daemon's expiry. put/get copy in bounded
chunks and never start one past the deadline: a get whose copy overran reports
those blocks as not found (their slots may have been reused), a put whose copy
overran raises LeaseExpired and stores nothing. Two-phase callers do the same
with ``handle.deadline_s`` (or ``Client.expired(handle)``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import platform
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
import numpy as np

from kvstore import errors, local_wire, memcopy
from kvstore.auth import CLIENT_ID_METADATA_KEY, SECRET_METADATA_KEY
from kvstore.identity import client_token, token_metadata
from kvstore.local_client import LocalChannel, spin_from_env
from kvstore.namespace import NamespaceSpec, layout_hash_seed
from kvstore.presence import Located, PresenceProbe, namespace_salt
from kvstore.tiers.dram import PAGE_BYTES, map_file_at, reserve_addresses
from kvstore.tls import ClientCredentials, TlsFiles
from kvstore.v1 import store_pb2 as pb
from kvstore.v1 import store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

DEFAULT_ADDRESS = "unix:/tmp/kvstore.sock"
# Loads longer than two of these are pipelined: the daemon prepares the next
# chunk while the client copies this one (see Client._get_pipelined).
PIPELINE_CHUNK_BYTES = 64 * 1024 * 1024
STORE_ALLOCATED = pb.STORE_ALLOCATED
# A lease's deadline on this side is its lifetime less this (or a quarter of a
# short lifetime): the commit still reaches the daemon in time, and a copy chunk
# started just before the deadline ends well inside the daemon's quarantine.
LEASE_MARGIN_S = 0.25
# Copies run in pieces of at most this, the deadline checked between pieces: a
# copy runs at most one piece past its deadline (<= 0.25 s even at 1 GB/s, well
# inside the margin plus the daemon's quarantine). Not smaller: on these
# machines glibc copies only big pieces with non-temporal stores, and 8-64 MiB
# pieces of a long run copied ~40% slower than one memcpy (load ~7, 2 cores).
COPY_CHUNK_BYTES = 256 * 1024 * 1024
# While the daemon's lean channel cannot be connected to, a new try at most this often
# (gRPC carries the calls meanwhile).
LOCAL_RETRY_S = 1.0
# A direct load's notice to the daemon (its load counters, its eviction order:
# LoadedDirect) rides in the next frame this client sends, or goes on its own
# after at most this long (kvstore.client._Notices). Sent at once, each cost the
# load the daemon's wake-up, paid by the sender (~55 us on these VMs): one-block
# loads measured 75-76 -> 56-57 us p50 for 64 KiB, 331-347 -> 288-298 us for 2 MiB.
NOTICE_DELAY_S = 0.005
# Direct loads check after the copy that what they read was never another block's:
# sound where loads are not reordered with older loads (x86's TSO order). On other
# machines that check would need a fence these copies do not have: loads pin.
DIRECT_LOAD_MACHINES = ("x86_64", "AMD64")

# A daemon that was down is retried at least this often: gRPC's default backoff
# grows to 120 s, so a client that lived through a 20 s outage kept failing for
# ~8 s after the daemon was back (measured by kvstore-bench soak).
RECONNECT_BACKOFF_MAX_MS = 1000
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    # Each Client its own connection state: with gRPC's process-wide pool, a new
    # Client inherited the backoff another one had run into while the daemon was
    # down, and failed its first calls after the restart.
    ("grpc.use_local_subchannel_pool", 1),
]


def _channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
) -> grpc.Channel:
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=options)
    return grpc.insecure_channel(address, options=options)


def normalise_address(address: str) -> str:
    """'/path.sock' -> 'unix:/path.sock'; 'host:port' and 'unix:...' unchanged."""
    if address.startswith("/"):
        return "unix:" + address
    return address


def pack_hashes(hashes: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(hashes, dtype="<u8").tobytes()


def _u64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u8")


@dataclass(frozen=True, slots=True)
class Namespace:
    namespace_id: str
    block_bytes: int
    spec: NamespaceSpec
    sibling_layouts: tuple[str, ...] = ()
    """Layouts of namespaces on the daemon equal to this one but for the layout."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_blocks: int
    by_tier: dict[str, int]


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    skipped: int  # already present, or being stored by another client
    no_room: int = 0  # refused: the tier is full of pinned or in-flight blocks


@dataclass(frozen=True, slots=True)
class HandedOver:
    found_blocks: int  # the longest present prefix, pinned for the puller
    ticket: bytes  # opaque; b"" when nothing was found
    ttl_s: float  # the pin's lifetime


@dataclass(frozen=True, slots=True)
class GetResult:
    found: int
    data: np.ndarray  # (found, block_bytes) uint8, a prefix of `out` when given


@dataclass(slots=True)
class StoreHandle:
    lease_id: int
    namespace: Namespace
    hashes: np.ndarray
    statuses: np.ndarray  # uint8, StoreStatus per requested block
    offsets: np.ndarray  # uint64 offsets into the tier's space (valid where ALLOCATED)
    tier: str = "dram"  # "dram": the region; "gpu": the GPU pool
    # By the client's clock: writes into the slots must be done before this.
    deadline_s: float = math.inf
    # Slots reserved ahead (reserve_store): ``hashes`` are zeros, the commit names
    # the real ones and the positions (indexes into ``offsets``) they went to.
    reserve: bool = False

    @property
    def allocated(self) -> np.ndarray:
        """Indices (into the request) of blocks the client must write."""
        return np.flatnonzero(self.statuses == STORE_ALLOCATED)


@dataclass(slots=True)
class LoadHandle:
    lease_id: int
    namespace: Namespace
    found: int
    offsets: np.ndarray  # uint64 offsets of the found prefix into the tier's space
    checksums: np.ndarray
    tier: str = "dram"
    # By the client's clock: bytes read from the slots after this are not valid.
    deadline_s: float = math.inf
    # A direct load (lease_id 0): where the presence table showed the blocks,
    # for Client.intact after the copy. None: a lease pins them.
    located: Located | None = None
    # A direct load's hashes (packed), told to the daemon by Client.intact (once).
    unreported: bytes = b""


def _tier_name(tier: int) -> str:
    return pb.Tier.Name(tier).removeprefix("TIER_").lower()  # type: ignore[arg-type]


def _tier_value(tier: str) -> Any:
    """ "dram" | "gpu" -> the protobuf Tier value."""
    if tier not in ("dram", "gpu"):
        raise errors.InvalidRequest(f'tier must be "dram" or "gpu", got {tier!r}')
    return pb.Tier.Value("TIER_" + tier.upper())


FileIdentity = tuple[int, int]  # (st_dev, st_ino): unique among live files


def _map_file(
    path: str, nbytes: int, keep: FileIdentity | None = None, *, shared_only: bool = False
) -> tuple[mmap.mmap | None, np.ndarray | None, FileIdentity | None]:
    """Map a daemon's shared-memory file; (None, None, None) when this process cannot
    (another host, no access): the client then uses the inline calls.

    When the file at ``path`` is the one already mapped (identity ``keep``:
    a warm restart kept it), nothing is mapped: (None, None, keep).

    ``shared_only``: the region file may be shorter than ``nbytes`` (a daemon
    with tenant regions: it holds the shared range only). Then ``nbytes`` of
    addresses are reserved and the file mapped at their start; the tenants'
    ranges this client may map go over the rest (Client._map_tenant), and what
    stays unmapped is this process's own empty memory, never a tenant's bytes.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None, None, None
    try:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if ident == keep:
            return None, None, keep
        if st.st_size < nbytes:
            if not shared_only or not st.st_size or st.st_size % PAGE_BYTES:
                return None, None, None
            reservation, array = reserve_addresses(nbytes)
            try:
                map_file_at(array, 0, fd, st.st_size, populate=True)
            except OSError:
                del array
                reservation.close()
                return None, None, None
            return reservation, array, ident
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    return mapping, np.frombuffer(mapping, dtype=np.uint8), ident


def _reserved(mapping: mmap.mmap | None, nbytes: int) -> bool:
    """Whether _map_file mapped a shorter shared file into a reservation (tenant regions)."""
    return mapping is not None and len(mapping) != nbytes


def _unmap(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass  # views still alive: unmapped when the last one goes


class Client:
    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = 5.0,
        map_region: bool = True,
        max_message_bytes: int = 64 * 1024 * 1024,
        secret: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        local_channel: bool | None = None,
        tls: TlsFiles | None = None,
        token: str | None = None,
        token_file: str = "",
        direct_loads: bool | None = None,
        map_presence: bool | None = None,
        spin_s: float | None = None,
    ) -> None:
        """``direct_loads``: read DRAM blocks found in the daemon's presence table
        without a lease (None: unless $KVSTORE_DIRECT_LOADS is 0/false).
        ``spin_s``: how long a call over the lean channel polls for its answer
        before it sleeps (None: $KVSTORE_SPIN_US, else 300 µs; 0: never polls;
        kvstore.local_client).
        ``map_presence``: map the daemon's presence table (lookups without a call);
        None = as ``map_region``. A client that loads nothing (a scheduler) maps the
        table alone."""
        self.address = normalise_address(
            address or os.environ.get("KVSTORE_ADDRESS", DEFAULT_ADDRESS)
        )
        self.timeout_s = timeout_s
        # read here: a bad $KVSTORE_SPIN_US fails the client, not just its lean channel
        self._spin_s = spin_from_env() if spin_s is None else spin_s
        self._clock = clock  # monotonic, the daemon's rate: lease deadlines
        # Needed over TCP when the daemon has a cluster secret (see kvstore.auth).
        secret = secret if secret is not None else os.environ.get("KVSTORE_SECRET", "")
        # The id the daemon counts this client's leases against (limits.max_leases_per_client).
        self.client_id = os.urandom(8).hex()
        client_id = ((CLIENT_ID_METADATA_KEY, self.client_id),)
        # Our identity where the daemon maps callers to tenants (kvstore.identity): the
        # token given, else token_file, else $KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE.
        self._token = client_token(token, token_file)
        self._metadata = (
            (((SECRET_METADATA_KEY, secret),) if secret else ())
            + token_metadata(self._token)
            + client_id
        )
        if local_channel is None:
            local_channel = os.environ.get("KVSTORE_LOCAL_CHANNEL", "1") not in ("0", "false")
        use_local = local_channel and self.address.startswith("unix:")
        # Over TCP to a daemon with mutual TLS: our certificate, its CA (kvstore.tls).
        tls = tls if tls is not None else TlsFiles.from_env()
        # Renewed certificate files are used for new connections: a channel made with
        # older credentials is replaced when next used (kvstore.tls.ClientCredentials).
        self._credentials: ClientCredentials | None = (
            tls.client_credentials()
            if tls.enabled and not self.address.startswith("unix:")
            else None
        )
        self._channel_options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # With the lean channel carrying the hot path this one can sit idle
            # for long; an idle timeout would read as a dropped link
            # (watch_connection) and restart the session for nothing.
            *((("grpc.client_idle_timeout_ms", 2**31 - 1),) if use_local else ()),
            *CHANNEL_OPTIONS,
        ]
        self._credentials_generation = -1
        self._grpc_channel: grpc.Channel | None = None
        self._grpc_stub: Any = None
        self._renew_channel()
        self._mmap: mmap.mmap | None = None
        self.region: np.ndarray | None = None
        # The GPU tier's pool: a CUDA tensor (IPC) or, in host mode, a mapped file.
        self._gpu_mmap: mmap.mmap | None = None
        self._gpu_pool: Any = None
        self._releaser: _Releaser | None = None
        self._notices = _Notices(self._send_queued, NOTICE_DELAY_S)
        self._map_region = map_region
        self._map_presence_wanted = map_region if map_presence is None else map_presence
        self._region_identity: FileIdentity | None = None
        # Tenant regions (the daemon's dram.tenant_regions): the tenants whose
        # blocks this client can reach in its mapping (True) or not (False: their
        # calls go inline); None = the whole region file is mapped. Bounded by the
        # tenants this client declares namespaces of.
        self._tenants: dict[str, bool] | None = None
        # The lean local channel (kvstore.local_client) for the hot path, when the
        # daemon serves one; None: every call goes over gRPC.
        self._lock = threading.RLock()
        self.local: LocalChannel | None = None
        self.info = self._call(self._stub.Hello, pb.HelloRequest())
        self._local_lost = False
        self._local_wanted = bool(use_local and self.info.socket_path)
        self._local_retry_at = 0.0
        if self._local_wanted:
            self.local = self._open_local(self.info.socket_path)
            if self.local is None:
                self._local_retry_at = time.monotonic() + LOCAL_RETRY_S
        # The daemon's presence table (kvstore.presence), mapped read-only: lookups
        # probe it instead of calling. None: not published, not mappable here, or
        # no longer current (then mapped again at most every LOCAL_RETRY_S).
        self._presence: PresenceProbe | None = None
        self._presence_retry_at = 0.0
        self.probed_lookups = 0  # lookups answered by the table (the daemon never saw them)
        # Blocks read with no lease (direct loads), and those a check after the
        # copy found gone from their slots (read again the leased way, or reported).
        self._direct = (direct_loads if direct_loads is not None else _direct_from_env()) and (
            platform.machine() in DIRECT_LOAD_MACHINES
        )
        self.direct_loaded_blocks = 0
        self.direct_lost_blocks = 0
        if map_region:
            self._map_whole_region()
        if self._map_presence_wanted:
            self._map_presence()

    def _map_presence(self) -> None:
        """(Re)map the presence table of the daemon Hello answered, if it publishes one."""
        old, self._presence = self._presence, None
        if old is not None:
            old.close()
        path = self.info.presence_path
        if path and self._map_presence_wanted:
            self._presence = PresenceProbe.open(path, int(self.info.region_id))
        if self._presence is None:
            self._presence_retry_at = time.monotonic() + LOCAL_RETRY_S

    def _presence_probe(self) -> PresenceProbe | None:
        """The mapped presence table, mapped now when there is one to map."""
        if self._presence is None and (
            self._map_presence_wanted
            and self.info.presence_path
            and time.monotonic() >= self._presence_retry_at
        ):
            self._map_presence()
        return self._presence

    def _presence_gone(self, probe: PresenceProbe) -> None:
        """The table was retired (the daemon stopped) or rebuilt: call until remapped."""
        self._presence = None
        self._presence_retry_at = time.monotonic() + LOCAL_RETRY_S
        probe.close()

    def present(self, ns: Namespace, hashes: Sequence[int] | np.ndarray) -> np.ndarray | None:
        """Which of ``hashes`` the daemon holds, read from its presence table without a
        call (a bool per hash); None where no table is mapped (docs/presence.md).
        A hint: a block may go or come right after; a commit is the authority."""
        probe = self._presence_probe()
        if probe is None:
            return None
        answer = probe.present(namespace_salt(ns.namespace_id), np.asarray(hashes, np.uint64))
        if answer is None:
            self._presence_gone(probe)
        return answer

    def _settled(self, local: LocalChannel) -> bool:
        """``local.settle()`` under the channel's lock: the answers already here
        read (a store step's commits, right before the next step's loads), then
        whether a presence probe may be trusted."""
        with self._lock:
            return local.settle()

    def _probe(self, ns: Namespace, hashes: Sequence[int] | np.ndarray) -> LookupResult | None:
        """A lookup answered from the presence table, or None: call the daemon."""
        probe = self._presence_probe()
        if probe is None:
            return None
        local = self.local
        if local is not None and not self._settled(local):
            # Commits sent without waiting and not answered yet (the call is
            # ordered after them), or the daemon's end closed: a killed daemon's
            # table still reads as current, so its answers would be hits no load
            # can serve; the call meets the closed connection instead.
            return None
        n = len(hashes)
        if n > self.info.max_blocks_per_request:
            return None  # the daemon's InvalidRequest, word for word
        answer = probe.lookup(namespace_salt(ns.namespace_id), hashes)  # converts what it needs
        if answer is None:
            self._presence_gone(probe)
            return None
        self.probed_lookups += 1
        found, by_tier = answer
        return LookupResult(found, {t.name.lower(): c for t, c in by_tier.items()})

    def _locate(self, ns: Namespace, hashes: Sequence[int] | np.ndarray) -> LoadHandle | None:
        """A direct load's handle (lease_id 0) for the DRAM prefix of ``hashes``, read
        from the presence table; None when the daemon must answer: no table or
        lean channel, a tenant region, a block of the prefix held on disk or in
        the GPU pool (a call moves it first), more hashes than one request takes.
        ``intact`` tells the daemon of the blocks read, after the copy."""
        local = self.local
        if (
            not self._direct
            or local is None
            or not local.direct_loads
            or self._tenants is not None
            or self.region is None
            or len(hashes) > self.info.max_blocks_per_request
        ):
            return None
        probe = self._presence_probe()
        if probe is None or not self._settled(local):  # see _probe: a killed daemon's table
            return None
        located = probe.locate(namespace_salt(ns.namespace_id), hashes)
        if located is None:
            self._presence_gone(probe)
            return None
        if located.elsewhere:
            return None
        found = located.found
        return LoadHandle(
            0,
            ns,
            found,
            located.offsets(),
            located.checksums,
            located=located,
            unreported=pack_hashes(hashes[:found]) if found else b"",
        )

    def intact(self, handle: LoadHandle) -> int:
        """After copying a load's blocks out: how many leading ones are valid. A
        direct load: those still in the slots it found them in, nothing else ever
        there meanwhile (the presence table's words unchanged); the rest must be
        read again (``prepare_load``) or recomputed. A leased load: all of them
        until its deadline (by this client's clock), none after (its slots may
        have been reused).

        A direct load's valid blocks are then told to the daemon, once, in one
        message it does not answer (its load counters, its eviction order), only
        for blocks that were loaded: queued, it rides in this client's next frame,
        or goes on its own within NOTICE_DELAY_S; never inside a load's time."""
        located = handle.located
        if located is None:
            return 0 if self.expired(handle) else handle.found
        ok = located.probe.intact(located)
        packed, handle.unreported = handle.unreported, b""
        if packed:
            self.direct_loaded_blocks += ok
            self.direct_lost_blocks += handle.found - ok
            local = self.local
            if ok and local is not None and local.broken is None:
                with self._lock:
                    local.post(
                        local_wire.LoadedDirect(0, handle.namespace.namespace_id, packed[: 8 * ok])
                    )
                self._notices.queued()
        return ok

    def _send_queued(self) -> None:
        """Send what the lean channel has queued (direct loads' notices), if any."""
        local = self.local
        if local is None or local.broken is not None or not local.queued:
            return
        with self._lock:
            try:
                local.flush()
            except errors.KVStoreError as exc:  # broken now: the next call meets it
                log.debug("kvstore: notices not sent: %s", exc)

    @property
    def probes_lookups(self) -> bool:
        """Whether lookups are answered from the daemon's presence table now."""
        return self._presence is not None and self._presence.current

    def _map_whole_region(self) -> None:
        """Map the region file of the daemon Hello answered (tenant ranges come later)."""
        old = self._mmap
        self._mmap, self.region, self._region_identity = _map_file(
            self.info.region_path, self.info.region_bytes, shared_only=True
        )
        self._tenants = {} if _reserved(self._mmap, self.info.region_bytes) else None
        _unmap(old)

    def _reaches(self, ns: Namespace) -> bool:
        """Whether this client's mapping holds the namespace's blocks (its tenant's range
        mapped, or the whole region); asked of the daemon once per tenant."""
        tenants = self._tenants
        if tenants is None:
            return self.region is not None
        tenant = ns.spec.tenant
        known = tenants.get(tenant)
        if known is None:
            known = tenants[tenant] = self._map_tenant(ns)
        return known

    def _check_reach(self, ns: Namespace, tier: str) -> None:
        """Two-phase calls hand out offsets the caller copies through this client's
        mapping: refused when the namespace's tenant region is not mapped here
        (its slots there would be this process's own empty memory)."""
        if tier == "dram" and self._tenants is not None and not self._reaches(ns):
            raise errors.StateConflict(
                f"the tenant region of namespace {ns.namespace_id} is not mapped in this "
                "process (the daemon did not hand it over); put/get go inline instead"
            )

    def _map_tenant(self, ns: Namespace) -> bool:
        """Map the namespace's tenant range over its place in the reservation, with the
        descriptor the daemon hands over the lean socket (SCM_RIGHTS); False when it
        will not or cannot (the tenant's calls then go inline over gRPC)."""
        from kvstore.local_server import local_socket_path

        if self.region is None or not self.info.socket_path:
            return False
        try:
            ch = LocalChannel.open(
                local_socket_path(self.info.socket_path),
                self.client_id,
                self.timeout_s,
                self._token,  # who asks decides which tenants' files it is handed
            )
            try:
                answer, fd = ch.map_tenant(ns.namespace_id)
            finally:
                ch.close()
        except (OSError, errors.KVStoreError) as exc:
            log.debug("kvstore: tenant range of %s not mapped (%s)", ns.namespace_id, exc)
            return False
        if answer.region_id != self.info.region_id:
            if fd is not None:
                os.close(fd)
            return False  # another daemon's: the next call follows the restart
        if fd is None:
            return True  # the tenant shares the region file: mapped already
        try:
            map_file_at(self.region, answer.offset, fd, answer.nbytes, populate=True)
        except (OSError, ValueError) as exc:
            log.debug("kvstore: cannot map the tenant range of %s: %s", ns.namespace_id, exc)
            return False
        finally:
            os.close(fd)
        return True

    # ------------------------------------------------------------ plumbing

    def _renew_channel(self) -> None:
        """(Re)open the gRPC channel when there is none, or when the certificate files
        were renewed since it was made. The old channel is not closed: calls in flight
        on it finish, and it goes when the last of them drops it."""
        credentials, generation = (
            self._credentials.current() if self._credentials is not None else (None, 0)
        )
        if self._grpc_channel is not None and generation == self._credentials_generation:
            return
        self._grpc_channel = _channel(self.address, credentials, self._channel_options)
        self._grpc_stub = pb_grpc.StoreServiceStub(self._grpc_channel)
        self._credentials_generation = generation

    @property
    def _channel(self) -> grpc.Channel:
        if self._credentials is not None:
            self._renew_channel()
        assert self._grpc_channel is not None
        return self._grpc_channel

    @property
    def _stub(self) -> Any:
        if self._credentials is not None:
            self._renew_channel()
        return self._grpc_stub

    def _open_local(self, socket_path: str) -> LocalChannel | None:
        from kvstore.local_server import local_socket_path

        path = local_socket_path(socket_path)
        try:
            ch = LocalChannel.open(
                path, self.client_id, self.timeout_s, self._token, spin_s=self._spin_s
            )
        except (OSError, errors.KVStoreError) as exc:
            log.debug("kvstore: no lean channel at %s (%s); using gRPC", path, exc)
            return None
        if ch.direct_loads or ch.reserves:
            self._notices.start()  # what queues notices: direct loads, reserves' leftovers
        return ch

    def _local_call(
        self,
        make: Callable[[int], Any],
        *,
        ns: Namespace | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One lean-channel call. With ``ns``, a namespace the daemon dropped is
        declared again and the call retried once (as _call does); a request that
        could not even be sent (the daemon went away: a restart) is sent once more
        on a fresh connection, as gRPC reconnects."""
        redeclared = resent = False
        while True:
            local = self._local()
            if local is None:
                raise errors.Unavailable("lean channel to the daemon: cannot connect again")
            try:
                with self._lock:
                    return local.call(make, timeout_s)
            except errors.NamespaceNotFound:
                if ns is None or redeclared:
                    raise
                redeclared = True
                again = self.declare_namespace(ns.spec)
                if again.namespace_id != ns.namespace_id:
                    raise errors.StateConflict(
                        f"namespace {ns.namespace_id} came back as {again.namespace_id}: "
                        "another daemon version?"
                    ) from None
            except errors.Unavailable:
                if resent or not local.failed_unsent:
                    raise
                resent = True

    @property
    def using_local_channel(self) -> bool:
        """Whether hot-path calls go over the lean local channel (else gRPC)."""
        return self.local is not None and self.local.broken is None

    @property
    def local_channel_lost(self) -> bool:
        """Whether the lean channel broke since this client was made (the daemon went
        away, or a timeout): the connector's session then starts a fresh client."""
        return self._local_lost or (self.local is not None and self.local.broken is not None)

    def _local(self) -> LocalChannel | None:
        """The lean channel while it works. Once broken (its error went to the call
        that met it) a new connection is tried, at most every LOCAL_RETRY_S while
        none can be made; gRPC carries the calls meanwhile."""
        local = self.local
        if local is not None and local.broken is None:
            return local
        if not self._local_wanted:
            return None
        if local is not None:
            self.local = None
            self._local_lost = True
            with self._lock:
                local.close()
        elif time.monotonic() < self._local_retry_at:
            return None
        self.local = self._open_local(self.info.socket_path)
        if self.local is None:
            self._local_retry_at = time.monotonic() + LOCAL_RETRY_S
        return self.local

    def _call(
        self,
        method: Any,
        request: Any,
        timeout_s: float | None = None,
        *,
        ns: Namespace | None = None,
    ) -> Any:
        """One call; with ``ns``, a namespace the daemon dropped (or lost in a restart)
        is declared again and the call retried once. Notices queued on the lean
        channel go first: what this client asks next (stats) counts its loads."""
        self._send_queued()
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            err = errors.error_from_rpc(exc)
        if ns is None or not isinstance(err, errors.NamespaceNotFound):
            raise err from None
        again = self.declare_namespace(ns.spec)
        if again.namespace_id != ns.namespace_id:
            raise errors.StateConflict(
                f"namespace {ns.namespace_id} came back as {again.namespace_id}: another daemon version?"
            )
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise errors.error_from_rpc(exc) from None

    def _deadline(self, sent_s: float, granted_ttl_s: float, asked_ttl_s: float) -> float:
        """This side's deadline of a lease asked for at ``sent_s`` (before the request)."""
        ttl_s = granted_ttl_s or asked_ttl_s or self.info.default_lease_ttl_s
        if not ttl_s:  # an old daemon with no default given: nothing to fence by
            return math.inf
        return sent_s + ttl_s - min(LEASE_MARGIN_S, ttl_s / 4)

    def expired(self, handle: LoadHandle | StoreHandle) -> bool:
        """Whether the lease's time is up by this client's clock (stop copying)."""
        return self._clock() > handle.deadline_s

    @property
    def region_id(self) -> int:
        """The daemon region this client's mapping and offsets belong to (0: unknown)."""
        return int(self.info.region_id)

    def _follow_region(self, region_id: int) -> None:
        """Make the mapped spaces those of the daemon that answered with ``region_id``.

        A different id means the daemon restarted since this client's Hello:
        its offsets point into a new region (or the same file kept by a warm
        restart). Ask Hello again and re-map; raise Unavailable if the daemon
        changed once more meanwhile (the answer's offsets belong to no daemon
        this client can reach).
        """
        if not region_id or region_id == self.info.region_id:
            return
        info = self._call(self._stub.Hello, pb.HelloRequest())
        if info.region_id != region_id:
            raise errors.Unavailable("the daemon restarted during the call; retry it")
        self.info = info
        # The GPU pool went with the old daemon too: mapped again on next use.
        self._gpu_pool = None
        _unmap(self._gpu_mmap)
        self._gpu_mmap = None
        if self._map_presence_wanted:
            self._map_presence()  # never the old daemon's table past this point
        if not self._map_region:
            return
        if self._tenants is not None or self.region is None:
            # Tenant ranges: their files and layout are the new daemon's; all mapped anew.
            self._map_whole_region()
            return
        same_size = self.region is not None and len(self.region) == info.region_bytes
        mapping, region, ident = _map_file(
            info.region_path,
            info.region_bytes,
            keep=self._region_identity if same_size else None,
            shared_only=True,
        )
        # The new daemon may have tenant regions: then its tenants are asked anew.
        self._tenants = {} if _reserved(mapping, info.region_bytes) else None
        if ident is not None and ident == self._region_identity and region is None:
            return  # a warm restart kept the file this client maps
        old, self._mmap, self.region = self._mmap, mapping, region
        self._region_identity = ident
        _unmap(old)

    def _follow_for(self, region_id: int, lease_id: int, ns: Namespace, tier: str) -> None:
        """_follow_region for a just-prepared lease: released if its space is unreachable
        (with tenant regions: the new daemon's range of the lease's tenant too)."""
        try:
            self._follow_region(region_id)
            self._check_reach(ns, tier)
        except BaseException:
            self.release(lease_id, wait=False)
            raise

    def _space_of(self, lease_id: int, tier: str) -> Any:
        """The space a lease's offsets point into (after _follow_for), or release and raise."""
        try:
            space = self._space(tier)
            if space is None:
                raise errors.Unavailable(
                    "the restarted daemon's region cannot be mapped in this process"
                )
        except BaseException:
            self.release(lease_id, wait=False)
            raise
        return space

    @property
    def has_gpu_tier(self) -> bool:
        return bool(self.info.gpu_device)

    def gpu_pool(self) -> Any:
        """The daemon's GPU pool, mapped on first use: a uint8 CUDA tensor (CUDA IPC),
        or a numpy array over the shared file when the daemon runs the tier in host mode."""
        if self._gpu_pool is not None:
            return self._gpu_pool
        if not self.info.gpu_device:
            raise errors.StateConflict("the daemon has no GPU tier (gpu.device is not set)")
        if self.info.gpu_ipc_handle:
            from kvstore.tiers.gpu import GpuPoolHandle, open_handle

            handle = msgspec.msgpack.decode(self.info.gpu_ipc_handle, type=GpuPoolHandle)
            self._gpu_pool = open_handle(handle)
        else:
            self._gpu_mmap, self._gpu_pool, _ = _map_file(
                self.info.gpu_region_path, self.info.gpu_pool_bytes
            )
            if self._gpu_pool is None:
                raise errors.Unavailable(
                    f"cannot map the GPU tier's file {self.info.gpu_region_path}"
                )
        return self._gpu_pool

    def _space(self, tier: str) -> Any:
        """Where offsets of a `tier` lease point: the DRAM region or the GPU pool."""
        if tier == "gpu":
            return self.gpu_pool()
        if tier != "dram":
            raise errors.InvalidRequest(f'tier must be "dram" or "gpu", got {tier!r}')
        return self.region

    def watch_connection(
        self, callback: Callable[[grpc.ChannelConnectivity], None]
    ) -> Callable[[], None]:
        """Call `callback(state)` on every change of the connection to the daemon.

        It runs on a gRPC thread, so it should only flip a flag. A drop after
        READY means the daemon went away (and may come back with a new region).
        Returns a function that stops the calls.
        """
        self._channel.subscribe(callback, try_to_connect=False)

        def unsubscribe() -> None:
            try:
                self._channel.unsubscribe(callback)
            except ValueError:
                pass  # already gone

        return unsubscribe

    @property
    def mapped(self) -> bool:
        return self.region is not None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of region bytes (valid while the client is open)."""
        if self.region is None:
            raise errors.Unavailable("the daemon's region is not mapped in this process")
        return self.region[offset : offset + nbytes]

    def close(self) -> None:
        """Flush what was sent without waiting (commits land), then close the channels."""
        self._notices.close()
        local, self.local = self.local, None
        self._local_wanted = False
        if local is not None:
            with self._lock:
                local.close()
        self._flush_releases()
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.close()
        self.region = None
        self._gpu_pool = None
        for mapping in (self._mmap, self._gpu_mmap):
            _unmap(mapping)
        self._mmap = self._gpu_mmap = None
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- control

    def declare_namespace(self, spec: NamespaceSpec) -> Namespace:
        if self._local() is not None:
            reply: Any = self._local_call(lambda seq: local_wire.Declare(seq, spec))
        else:
            reply = self._call(
                self._stub.DeclareNamespace,
                pb.DeclareNamespaceRequest(spec=pb.NamespaceSpec(**msgspec.structs.asdict(spec))),
            )
        ns = Namespace(reply.namespace_id, reply.block_bytes, spec, tuple(reply.sibling_layouts))
        mine = layout_hash_seed(spec.layout)
        others = sorted({layout_hash_seed(x) or "none" for x in ns.sibling_layouts} - {mine})
        if mine is not None and others:
            log.warning(
                "kvstore: HASH SEED MISMATCH on daemon %s: namespace %s (model %s) hashes "
                "blocks with seed %s, other clients of the same model use %s; they never "
                "share a block (vLLM: set one PYTHONHASHSEED and prefix_caching_hash_algo "
                "for every engine)",
                self.address,
                ns.namespace_id,
                spec.model,
                mine,
                ", ".join(others),
            )
        return ns

    def lookup(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        *,
        peer_hint: str = "",
        peer_timeout_s: float = 0.0,
    ) -> LookupResult:
        """Longest present prefix. peer_hint (node id or host:port): the daemon first
        pulls what it lacks from that peer (needs peer.enabled).

        Without a peer hint, a client that maps the daemon's presence table answers
        from it, without a call (docs/presence.md): a hint, as any lookup is (the
        blocks may go before the load; PrepareLoad is the authority)."""
        if not peer_hint and (probed := self._probe(ns, hashes)) is not None:
            return probed
        if not peer_hint and self._local() is not None:
            packed = pack_hashes(hashes)
            looked = self._local_call(
                lambda seq: local_wire.Lookup(seq, ns.namespace_id, packed), ns=ns
            )
            return LookupResult(looked.prefix_blocks, {_tier_name(t): n for t, n in looked.by_tier})
        reply = self._call(
            self._stub.Lookup,
            pb.LookupRequest(
                namespace_id=ns.namespace_id,
                block_hashes=pack_hashes(hashes),
                peer_hint=peer_hint,
                peer_timeout_s=peer_timeout_s,
            ),
            timeout_s=(peer_timeout_s or self.timeout_s) + (2.0 if peer_hint else 0.0),
            ns=ns,
        )
        return LookupResult(
            reply.prefix_blocks, {_tier_name(t.tier): t.blocks for t in reply.by_tier}
        )

    def prepare_store(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        lease_ttl_s: float = 0.0,
        *,
        tier: str = "dram",
    ) -> StoreHandle:
        """Reserve slots in `tier` ("dram", or "gpu": offsets into gpu_pool())."""
        self._check_reach(ns, tier)
        packed = pack_hashes(hashes)
        tier_value = _tier_value(tier)
        sent_s = self._clock()
        if self._local() is not None:
            reply: Any = self._local_call(
                lambda seq: local_wire.PrepareStore(
                    seq, ns.namespace_id, packed, lease_ttl_s, tier_value
                ),
                ns=ns,
            )
        else:
            reply = self._call(
                self._stub.PrepareStore,
                pb.PrepareStoreRequest(
                    namespace_id=ns.namespace_id,
                    block_hashes=packed,
                    lease_ttl_s=lease_ttl_s,
                    tier=tier_value,
                ),
                ns=ns,
            )
        # offsets are the answering daemon's
        self._follow_for(reply.region_id, reply.lease_id, ns, tier)
        return StoreHandle(
            reply.lease_id,
            ns,
            _u64(packed),
            np.frombuffer(reply.statuses, dtype=np.uint8),
            _u64(reply.offsets),
            _tier_name(reply.tier),
            self._deadline(sent_s, reply.lease_ttl_s, lease_ttl_s),
        )

    def commit_store(
        self,
        handle: StoreHandle,
        hashes: Sequence[int] | np.ndarray | None = None,
        *,
        parent_block_hash: int | None = None,
        token_ids: Sequence[int] | np.ndarray | None = None,
        chains: Sequence[tuple[int, int | None]] | None = None,
        positions: Sequence[int] | np.ndarray | None = None,
        keep_rest: bool = False,
    ) -> int:
        """Commit the lease's blocks (``hashes``; None = all of them).

        ``chains``: ``(blocks, parent_block_hash)`` runs of ``hashes`` that are
        each one sequence (one BlockStored event each, in order), for a commit
        holding several requests' blocks; ``token_ids`` follow ``hashes`` and
        travel split per chain (``parent_block_hash`` must then be None).

        ``positions`` (a reserve's handle, and only then): the index into
        ``handle.offsets`` each of ``hashes`` was written at. Blocks the daemon
        already has (or another client is storing) are not committed: the count
        says so; slots not named are freed, or with ``keep_rest`` stay reserved
        at their positions for this handle's later commits (each position is
        committed once; ``reserve_keep`` says whether the daemon serves it).
        """
        if not handle.lease_id:
            return 0
        fields = _commit_fields(hashes, parent_block_hash, token_ids, chains, positions, keep_rest)
        if keep_rest:
            self._check_keep()
        try:
            if fields.positions is not None:
                return int(self._local_call(_local_commit(handle.lease_id, fields)).committed)
            if self._local() is not None:
                message = _local_commit(handle.lease_id, fields)
                return int(self._local_call(message).committed)
            return int(
                self._call(self._stub.CommitStore, _pb_commit(handle.lease_id, fields)).committed
            )
        except errors.KVStoreError as exc:
            raise self._commit_error(handle, exc) from None

    def commit_store_later(
        self,
        handle: StoreHandle,
        hashes: Sequence[int] | np.ndarray | None = None,
        *,
        parent_block_hash: int | None = None,
        token_ids: Sequence[int] | np.ndarray | None = None,
        chains: Sequence[tuple[int, int | None]] | None = None,
        on_done: Callable[[int | errors.KVStoreError], None] | None = None,
        positions: Sequence[int] | np.ndarray | None = None,
        reserve_blocks: int = 0,
        reserve_ttl_s: float = 0.0,
        on_reserved: Callable[[StoreHandle | errors.KVStoreError], None] | None = None,
        keep_rest: bool = False,
    ) -> None:
        """commit_store without waiting for the answer (over the lean channel).

        ``on_done`` gets the committed count, or the error, when the answer is
        read: at the next call of this client, at ``flush()``, or at ``close()``
        (so the commit has landed once the client is closed). The daemon runs
        one connection's requests in order, so this client's later calls see
        the blocks committed. Over gRPC it is commit_store, answered at once.
        Errors sending it raise here (on_done is not called then).

        ``positions``, ``keep_rest``: as for commit_store (a reserve).
        ``reserve_blocks``: ask in the same frame for the next reserve of that
        many slots in the handle's namespace and tier, for ``reserve_ttl_s`` (as
        reserve_store_later; ``on_reserved`` gets it).
        """
        if not handle.lease_id:
            if on_done is not None:
                on_done(0)
            if reserve_blocks:
                self.reserve_store_later(
                    handle.namespace,
                    reserve_blocks,
                    reserve_ttl_s,
                    tier=handle.tier,
                    on_done=on_reserved,
                )
            return
        fields = _commit_fields(hashes, parent_block_hash, token_ids, chains, positions, keep_rest)
        local = self._local()
        if (fields.positions is not None or reserve_blocks) and (
            local is None or not local.reserves
        ):
            raise errors.StateConflict(
                "reserves need the lean local channel to a daemon that serves them"
            )
        if keep_rest:
            self._check_keep()
        if local is None:
            n = self.commit_store(
                handle,
                hashes,
                parent_block_hash=parent_block_hash,
                token_ids=token_ids,
                chains=chains,
            )
            if on_done is not None:
                on_done(n)
            return

        def done(reply: Any) -> None:
            if on_done is not None:
                on_done(
                    self._commit_error(handle, reply)
                    if isinstance(reply, errors.KVStoreError)
                    else int(reply.committed)
                )

        calls: list[tuple[Callable[[int], Any], Callable[[Any], None] | None]] = [
            (_local_commit(handle.lease_id, fields), done)
        ]
        if reserve_blocks:
            calls.append(
                self._reserve_call(
                    handle.namespace, reserve_blocks, reserve_ttl_s, handle.tier, on_reserved
                )
            )
        with self._lock:
            local.calls_later(calls)

    # ------------------------------------------------------------ reserves

    @property
    def reserves(self) -> bool:
        """Whether reserve_store is served: the lean channel, to a daemon that has it."""
        local = self._local()
        return local is not None and local.reserves

    @property
    def reserve_keep(self) -> bool:
        """Whether a reserve's commit may keep the rest of its slots (``keep_rest``)."""
        local = self._local()
        return local is not None and local.reserves and local.reserve_keep

    def _check_keep(self) -> None:
        # An older daemon would decode the commit without keep_rest and free the
        # slots the caller means to write next: refused here, before any send.
        if not self.reserve_keep:
            raise errors.StateConflict(
                "keep_rest needs the lean local channel to a daemon that serves it"
            )

    def reserve_store(
        self, ns: Namespace, blocks: int, lease_ttl_s: float = 0.0, *, tier: str = "dram"
    ) -> StoreHandle:
        """``blocks`` slots in ``tier`` reserved before their blocks are known: write
        them, then commit with the real hashes and the positions written (fewer
        slots than asked when the tier runs out: ``handle.allocated``). Lean
        channel only (``reserves``); StateConflict otherwise."""
        self._check_reach(ns, tier)
        if not self.reserves:
            raise errors.StateConflict(
                "reserves need the lean local channel to a daemon that serves them"
            )
        tier_value = _tier_value(tier)
        sent_s = self._clock()
        reply = self._local_call(
            lambda seq: local_wire.ReserveStore(
                seq, ns.namespace_id, blocks, lease_ttl_s, tier_value
            ),
            ns=ns,
        )
        self._follow_for(reply.region_id, reply.lease_id, ns, tier)
        return self._reserve_handle(reply, ns, sent_s, lease_ttl_s)

    def reserve_store_later(
        self,
        ns: Namespace,
        blocks: int,
        lease_ttl_s: float = 0.0,
        *,
        tier: str = "dram",
        on_done: Callable[[StoreHandle | errors.KVStoreError], None] | None = None,
    ) -> None:
        """reserve_store without waiting: ``on_done`` gets the handle (or the error)
        when the answer is read (the next call, ``flush()``, ``close()``). Its
        deadline counts from before the send, as a waited-for one's does."""
        self._check_reach(ns, tier)
        local = self._local()
        if local is None or not local.reserves:
            raise errors.StateConflict(
                "reserves need the lean local channel to a daemon that serves them"
            )
        call = self._reserve_call(ns, blocks, lease_ttl_s, tier, on_done)
        with self._lock:
            local.calls_later([call])

    def _reserve_call(
        self,
        ns: Namespace,
        blocks: int,
        lease_ttl_s: float,
        tier: str,
        on_done: Callable[[StoreHandle | errors.KVStoreError], None] | None,
    ) -> tuple[Callable[[int], Any], Callable[[Any], None]]:
        tier_value = _tier_value(tier)
        sent_s = self._clock()  # before the send: the deadline never outruns the daemon's

        def make(seq: int) -> Any:
            return local_wire.ReserveStore(seq, ns.namespace_id, blocks, lease_ttl_s, tier_value)

        def done(reply: Any) -> None:
            if isinstance(reply, errors.KVStoreError):
                result: StoreHandle | errors.KVStoreError = reply
            elif reply.region_id and reply.region_id != self.info.region_id:
                # Offsets of a daemon this client does not map (it restarted since):
                # unusable; given back (an answer is read inside a call: post only).
                if self.local is not None and self.local.broken is None:
                    self.local.post(local_wire.Release(0, [reply.lease_id]))
                result = errors.Unavailable("the daemon restarted since; reserve again")
            else:
                result = self._reserve_handle(reply, ns, sent_s, lease_ttl_s)
            if on_done is not None:
                on_done(result)

        return make, done

    def _reserve_handle(
        self, reply: Any, ns: Namespace, sent_s: float, lease_ttl_s: float
    ) -> StoreHandle:
        statuses = np.frombuffer(reply.statuses, dtype=np.uint8)
        return StoreHandle(
            reply.lease_id,
            ns,
            np.zeros(len(statuses), dtype=np.uint64),
            statuses,
            _u64(reply.offsets),
            _tier_name(reply.tier),
            self._deadline(sent_s, reply.lease_ttl_s, lease_ttl_s),
            reserve=True,
        )

    def flush(self) -> None:
        """Send everything queued and wait for every answer not waited for yet
        (commit_store_later, release(wait=False)): they have all landed after this."""
        local = self._local()
        if local is not None:
            with self._lock:
                local.collect()
        self._flush_releases()

    def _commit_error(self, handle: StoreHandle, exc: errors.KVStoreError) -> errors.KVStoreError:
        if (
            isinstance(exc, errors.LeaseNotFound)
            and not isinstance(exc, errors.LeaseExpired)
            and self.expired(handle)  # ours ran out (and its quarantine too, or an old daemon)
        ):
            return errors.LeaseExpired(f"lease expired before the commit: {exc}")
        return exc

    def prepare_load(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        lease_ttl_s: float = 0.0,
        *,
        peer_hint: str = "",
        peer_timeout_s: float = 0.0,
        tier: str = "dram",
        pin: bool = True,
    ) -> LoadHandle:
        """Pin the longest present prefix (after pulling it from peer_hint, if given),
        moved into `tier` first ("gpu": offsets into gpu_pool()).

        ``pin=False``: where the presence table shows the prefix in DRAM, a direct
        load instead: no call, no lease (lease_id 0; release is a no-op). The
        caller must then check ``intact(handle)`` after its copy and trust only
        that many blocks. Otherwise (some of it elsewhere, no table) pinned."""
        if not pin and not peer_hint and tier == "dram":
            direct = self._locate(ns, hashes)
            if direct is not None:
                return direct
        self._check_reach(ns, tier)
        packed = pack_hashes(hashes)
        tier_value = _tier_value(tier)
        sent_s = self._clock()
        if not peer_hint and self._local() is not None:
            reply: Any = self._local_call(
                lambda seq: local_wire.PrepareLoad(
                    seq, ns.namespace_id, packed, lease_ttl_s, tier_value
                ),
                ns=ns,
            )
        else:
            reply = self._call(
                self._stub.PrepareLoad,
                pb.PrepareLoadRequest(
                    namespace_id=ns.namespace_id,
                    block_hashes=packed,
                    lease_ttl_s=lease_ttl_s,
                    peer_hint=peer_hint,
                    peer_timeout_s=peer_timeout_s,
                    tier=tier_value,
                ),
                timeout_s=(peer_timeout_s or self.timeout_s) + (2.0 if peer_hint else 0.0),
                ns=ns,
            )
        # offsets are the answering daemon's
        self._follow_for(reply.region_id, reply.lease_id, ns, tier)
        return LoadHandle(
            reply.lease_id,
            ns,
            reply.found_blocks,
            _u64(reply.offsets),
            _u64(reply.checksums),
            _tier_name(reply.tier) if reply.tier else "dram",
            self._deadline(sent_s, reply.lease_ttl_s, lease_ttl_s),
        )

    def release(self, handle: LoadHandle | StoreHandle | int, *, wait: bool = True) -> None:
        """End a lease. wait=False hands it to a background thread and returns at once.

        The thread sends whatever has queued up as one Release call, so a burst
        of loads costs one extra RPC, off the caller's path; errors there are
        ignored (a lease that is not released expires anyway).
        """
        lease_id = handle if isinstance(handle, int) else handle.lease_id
        if not lease_id:
            return
        self.release_all([lease_id], wait=wait)

    def release_all(
        self,
        handles: Sequence[LoadHandle | StoreHandle | int],
        *,
        wait: bool = True,
        now: bool = True,
    ) -> None:
        """End several leases in one message (wait=False: sent at once, not answered).

        ``now=False`` (with wait=False, over the lean channel): queued, to ride
        this client's next frame, or sent on its own within NOTICE_DELAY_S (a
        reserve's leftover slots, given back right before the step's commit
        goes out: one send, not two)."""
        ids = [h if isinstance(h, int) else h.lease_id for h in handles]
        ids = [i for i in ids if i]
        if not ids:
            return
        local = self._local()
        if local is not None:
            if wait:
                self._local_call(lambda seq: local_wire.Release(seq, ids))
                return
            with self._lock:
                local.post(local_wire.Release(0, ids))
                if now:
                    local.flush()  # now: pins held until a later call would delay eviction
            if not now:
                self._notices.queued()
            return
        if wait:
            self._call(self._stub.Release, pb.ReleaseRequest(lease_ids=ids))
            return
        if self._releaser is None:
            # the stub as of each send: a renewed channel is picked up (kvstore.tls)
            self._releaser = _Releaser(lambda: self._stub, self.timeout_s, self._metadata)
        for lease_id in ids:
            self._releaser.put(lease_id)

    def flush_releases(self) -> None:
        """Send the background releases queued so far and wait for them (wait=False
        releases are otherwise in flight for a moment after the call returns)."""
        self._flush_releases()

    def _flush_releases(self) -> None:
        if self._releaser is not None:
            self._releaser.close()
            self._releaser = None

    def delete(self, ns: Namespace, hashes: Sequence[int] | np.ndarray) -> tuple[int, int]:
        if self._local() is not None:
            packed = pack_hashes(hashes)
            d = self._local_call(lambda seq: local_wire.Delete(seq, ns.namespace_id, packed), ns=ns)
            return d.deleted, d.busy
        reply = self._call(
            self._stub.Delete,
            pb.DeleteRequest(namespace_id=ns.namespace_id, block_hashes=pack_hashes(hashes)),
            ns=ns,
        )
        return reply.deleted, reply.busy

    def clear(self, ns: Namespace) -> int:
        return int(
            self._call(
                self._stub.Clear, pb.ClearRequest(namespace_id=ns.namespace_id), ns=ns
            ).removed
        )

    def stats(self) -> Any:
        return self._call(self._stub.Stats, pb.StatsRequest())

    def fetch_from_peer(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        *,
        peer_node_id: str = "",
        peer_address: str = "",
        timeout_s: float = 0.0,
        ticket: bytes = b"",
    ) -> Any:
        """Have this daemon pull the blocks it lacks of `hashes` from a peer (NIXL).

        Returns the daemon's FetchFromPeerResponse (prefix_blocks now held here,
        fetched_blocks, local_blocks, corrupt_blocks, transport, timings).
        Needs `peer.enabled` on both daemons. ``ticket``: the owner's
        ``hand_over`` of these blocks (the peer may then be left out): the
        daemon reads them at once, with no pin round trip before the first byte.
        """
        from kvstore.v1 import peer_pb2, peer_pb2_grpc

        packed = pack_hashes(hashes)
        # The daemon bounds the pull by timeout_s; give the call a little more.
        call_timeout_s = (timeout_s or self.timeout_s) + 2.0
        local = self._local()
        if local is not None and "fetch_from_peer" in local.ops:
            # Over the lean channel: the pull's first byte then waits for one gRPC
            # call (the daemon's pin on the owner), not this one as well.
            def make(seq: int) -> Any:
                return local_wire.FetchFromPeer(
                    seq, ns.namespace_id, packed, peer_node_id, peer_address, timeout_s, ticket
                )

            r = self._local_call(make, ns=ns, timeout_s=call_timeout_s)
            return peer_pb2.FetchFromPeerResponse(
                prefix_blocks=r.prefix_blocks,
                fetched_blocks=r.fetched_blocks,
                local_blocks=r.local_blocks,
                corrupt_blocks=r.corrupt_blocks,
                transport=r.transport,
                pin_s=r.pin_s,
                transfer_s=r.transfer_s,
                verify_s=r.verify_s,
                pieces=r.pieces,
            )
        stub = peer_pb2_grpc.PeerFetchServiceStub(self._channel)
        request = peer_pb2.FetchFromPeerRequest(
            namespace_id=ns.namespace_id,
            block_hashes=packed,
            peer_node_id=peer_node_id,
            peer_address=peer_address,
            timeout_s=timeout_s,
            ticket=ticket,
        )
        # ns: a daemon that restarted since the declare gets it again, as for the
        # other calls naming a namespace (else NamespaceNotFound after any restart).
        return self._call(stub.FetchFromPeer, request, timeout_s=call_timeout_s, ns=ns)

    def hand_over(
        self, ns: Namespace, hashes: Sequence[int] | np.ndarray, *, ttl_s: float = 0.0
    ) -> HandedOver:
        """Pin the longest prefix of `hashes` this daemon holds for a peer that will
        pull it (the P/D split: the prefill side, right after its store), before
        that peer asks. Hand ``ticket`` to the puller's ``fetch_from_peer``: its
        daemon then reads at once. The pin holds the blocks here until the puller
        releases it or ``ttl_s`` (0: 30 s) passes. Needs `peer.enabled`.
        """
        from kvstore.v1 import peer_pb2, peer_pb2_grpc

        packed = pack_hashes(hashes)
        local = self._local()
        if local is not None and "hand_over" in local.ops:

            def make(seq: int) -> Any:
                return local_wire.HandOver(seq, ns.namespace_id, packed, ttl_s)

            r = self._local_call(make, ns=ns)
            return HandedOver(r.found_blocks, r.ticket, r.ttl_s)
        stub = peer_pb2_grpc.PeerFetchServiceStub(self._channel)
        request = peer_pb2.HandOverRequest(
            namespace_id=ns.namespace_id, block_hashes=packed, ttl_s=ttl_s
        )
        r = self._call(stub.HandOver, request, ns=ns)
        return HandedOver(r.found_blocks, r.ticket, r.ttl_s)

    # ---------------------------------------------------------------- data

    def put(
        self, ns: Namespace, hashes: Sequence[int] | np.ndarray, blocks: Any, *, tier: str = "dram"
    ) -> PutResult:
        """Store blocks (n, block_bytes); already-present blocks are skipped, not rewritten.

        tier="gpu" stores into the daemon's GPU pool (device to device from a
        CUDA tensor) when the node has a GPU tier.
        """
        n = len(hashes)
        if tier == "dram" and not self._reaches(ns):
            data = _as_rows(blocks, n, ns.block_bytes)
            reply = self._call(
                self._stub.PutInline,
                pb.PutInlineRequest(
                    namespace_id=ns.namespace_id,
                    block_hashes=pack_hashes(hashes),
                    data=data.tobytes(),
                ),
                ns=ns,
            )
            return PutResult(reply.stored, reply.skipped, reply.no_room)
        space = self._space(tier)
        if _is_cuda(blocks) or _is_cuda(space):
            return self._put_torch(ns, hashes, blocks, tier, space)
        data = _as_rows(blocks, n, ns.block_bytes)
        handle = self.prepare_store(ns, hashes, tier=tier)
        space = self._space_of(handle.lease_id, tier)  # re-mapped if the daemon restarted
        idx = handle.allocated
        if len(idx):
            try:
                written = scatter(
                    space,
                    handle.offsets[idx],
                    data,
                    idx,
                    ns.block_bytes,
                    deadline_s=handle.deadline_s,
                    clock=self._clock,
                )
            except BaseException:
                self.release(handle, wait=False)  # abort: the slots go back
                raise
            if written < len(idx):
                self.release(handle, wait=False)
                raise _store_too_slow(handle, written, len(idx))
            self.commit_store(handle)
        return _put_result(handle, len(idx))

    def get(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        out: Any = None,
        *,
        tier: str = "dram",
    ) -> GetResult:
        """Read the longest present prefix of `hashes` into `out` (or a new array).

        `out`: a (n, block_bytes) numpy array, or a CPU or CUDA torch tensor.
        tier="gpu" reads through the daemon's GPU pool (blocks are moved up first).
        """
        n = len(hashes)
        space = self._space(tier) if tier != "dram" or self._reaches(ns) else None
        if (out is not None and _is_cuda(out)) or _is_cuda(space):
            if space is None:
                raise errors.Unavailable(
                    "loading into a CUDA tensor needs the daemon's region mapped"
                )
            return self._get_torch(ns, hashes, out, tier, space)
        if out is not None:
            out = _as_rows(out, n, ns.block_bytes, writable=True)
        if space is None:
            reply = self._call(
                self._stub.GetInline,
                pb.GetInlineRequest(namespace_id=ns.namespace_id, block_hashes=pack_hashes(hashes)),
                ns=ns,
            )
            data = np.frombuffer(reply.data, dtype=np.uint8).reshape(
                reply.found_blocks, ns.block_bytes
            )
            if out is None:
                return GetResult(reply.found_blocks, data.copy())
            out[: reply.found_blocks] = data
            return GetResult(reply.found_blocks, out[: reply.found_blocks])
        if tier == "dram" and (direct := self._locate(ns, hashes)) is not None:
            return self._get_direct(ns, hashes, out, direct)
        if n * ns.block_bytes > 2 * PIPELINE_CHUNK_BYTES:
            return self._get_pipelined(ns, hashes, out, tier, space)
        return self._get_pinned(ns, hashes, out, tier)

    def _get_pinned(
        self, ns: Namespace, hashes: Sequence[int] | np.ndarray, out: np.ndarray | None, tier: str
    ) -> GetResult:
        """get() under one load lease: pinned, copied, released."""
        handle = self.prepare_load(ns, hashes, tier=tier)
        space = self._space_of(handle.lease_id, tier)  # re-mapped if the daemon restarted
        try:
            if out is None:
                out = np.empty((handle.found, ns.block_bytes), dtype=np.uint8)
            # Rows copied after the lease ran out may hold another block's bytes:
            # only those copied in time count as found.
            found = gather(
                space,
                handle.offsets,
                out,
                ns.block_bytes,
                deadline_s=handle.deadline_s,
                clock=self._clock,
            )
        finally:
            # The pin only has to outlive the copy; don't wait for the answer.
            self.release(handle, wait=False)
        return GetResult(found, out[:found])

    def _get_direct(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        out: np.ndarray | None,
        handle: LoadHandle,
    ) -> GetResult:
        """get() of a prefix the presence table shows in DRAM: copied with no call;
        blocks that left their slots during the copy are read again with a lease."""
        assert self.region is not None
        found = handle.found
        if out is None:
            out = np.empty((found, ns.block_bytes), dtype=np.uint8)
        if not found:
            return GetResult(0, out[:0])
        gather(self.region, handle.offsets, out, ns.block_bytes)
        ok = self.intact(handle)
        if ok == found:
            return GetResult(found, out[:found])
        if out.shape[0] < len(hashes):  # (a new array: room for what a lease finds)
            grown = np.empty((len(hashes), ns.block_bytes), dtype=np.uint8)
            grown[:ok] = out[:ok]
            out = grown
        # The rest the way a call sees it now: what is still held, pinned.
        more = self._get_pinned(ns, hashes[ok:], out[ok:], "dram").found
        return GetResult(ok + more, out[: ok + more])

    def _get_pipelined(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        out: np.ndarray | None,
        tier: str,
        space: np.ndarray,
    ) -> GetResult:
        """A long prefix in chunks: the daemon prepares chunk k+1 (promoting it from
        disk, moving it between tiers) while this process copies chunk k out.

        One PrepareLoad for the whole prefix would make the copy wait for every
        disk read; here only the first chunk's does. Same result as one call:
        the longest present prefix, each chunk pinned until its copy is done.
        """
        n, block_bytes = len(hashes), ns.block_bytes
        packed = np.asarray(hashes, dtype="<u8")
        per = max(1, PIPELINE_CHUNK_BYTES // block_bytes)
        chunks = [(s, min(n, s + per)) for s in range(0, n, per)]
        if out is None:
            out = np.empty((n, block_bytes), dtype=np.uint8)

        def send(i: int) -> tuple[Any, float]:
            s, e = chunks[i]
            request = pb.PrepareLoadRequest(
                namespace_id=ns.namespace_id,
                block_hashes=packed[s:e].tobytes(),
                tier=_tier_value(tier),
            )
            sent_s = self._clock()
            future = self._stub.PrepareLoad.future(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
            return future, sent_s

        found = 0
        pending: tuple[Any, float] | None = send(0)
        try:
            for i, (s, e) in enumerate(chunks):
                assert pending is not None
                (future, sent_s), pending = pending, None
                try:
                    reply = future.result()
                except grpc.RpcError as exc:
                    raise errors.error_from_rpc(exc) from None
                if reply.region_id and reply.region_id != self.info.region_id:
                    if i:  # earlier chunks were copied from another daemon's region
                        self.release(reply.lease_id, wait=False)
                        raise errors.Unavailable("the daemon restarted during a get; retry it")
                    self._follow_for(reply.region_id, reply.lease_id, ns, tier)
                    space = self._space_of(reply.lease_id, tier)
                complete = reply.found_blocks == e - s
                if complete and i + 1 < len(chunks):
                    pending = send(i + 1)  # in flight while this chunk is copied
                try:
                    copied = gather(
                        space,
                        _u64(reply.offsets),
                        out[s:e],
                        block_bytes,
                        deadline_s=self._deadline(sent_s, reply.lease_ttl_s, 0.0),
                        clock=self._clock,
                    )
                finally:
                    self.release(reply.lease_id, wait=False)
                found += copied
                if not complete or copied < reply.found_blocks:
                    break
        finally:
            if pending is not None:  # an error cut the pipeline: free what it pinned
                try:
                    self.release(pending[0].result().lease_id, wait=False)
                except grpc.RpcError:
                    pass
        return GetResult(found, out[:found])

    def _put_torch(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        blocks: Any,
        tier: str,
        space: Any,
    ) -> PutResult:
        """Blocks -> region or GPU pool with torch: one copy per run of neighbouring slots.

        Used when either side is on a CUDA device (host -> pool, device -> region,
        device -> pool: device to device through the pool's IPC mapping).
        """
        import torch

        n = len(hashes)
        src = (
            _cuda_rows(blocks, n, ns.block_bytes)
            if _is_cuda(blocks)
            else torch.from_numpy(_as_rows(blocks, n, ns.block_bytes))
        )
        handle = self.prepare_store(ns, hashes, tier=tier)
        space = self._space_of(handle.lease_id, tier)  # re-mapped if the daemon restarted
        space_t = space if isinstance(space, torch.Tensor) else torch.from_numpy(space)
        idx = handle.allocated
        offs = handle.offsets[idx]
        late = False
        try:
            for s, e in _runs(offs, idx, ns.block_bytes):
                if self.expired(handle):
                    late = True
                    break
                o, r = int(offs[s]), int(idx[s])
                space_t[o : o + (e - s) * ns.block_bytes].view(e - s, ns.block_bytes).copy_(
                    src[r : r + e - s]
                )
            _synchronize(src, space_t)  # the bytes must be in place before the commit
        except BaseException:
            self.release(handle, wait=False)
            raise
        if late or self.expired(handle):
            self.release(handle, wait=False)
            raise _store_too_slow(handle, 0, len(idx))
        self.commit_store(handle)
        return _put_result(handle, len(idx))

    def _get_torch(
        self,
        ns: Namespace,
        hashes: Sequence[int] | np.ndarray,
        out: Any,
        tier: str,
        space: Any,
    ) -> GetResult:
        """Region or GPU pool -> out with torch: one copy per run of neighbouring slots."""
        import torch

        if _is_cuda(out) and not out.is_contiguous():
            # reshape would copy it, and the blocks would land in the copy, not in `out`
            raise errors.InvalidRequest("a CUDA `out` tensor must be contiguous")
        handle = self.prepare_load(ns, hashes, tier=tier)
        space = self._space_of(handle.lease_id, tier)  # re-mapped if the daemon restarted
        space_t = space if isinstance(space, torch.Tensor) else torch.from_numpy(space)
        result: Any = None
        try:
            if out is None:
                out = torch.empty(
                    (handle.found, ns.block_bytes), dtype=torch.uint8, device=space_t.device
                )
                dst = out
            elif _is_cuda(out):
                dst = _cuda_rows(out, len(hashes), ns.block_bytes)
            else:
                rows = _as_rows(out, len(hashes), ns.block_bytes, writable=True)
                dst = torch.from_numpy(rows)
                result = rows  # a numpy (or CPU tensor) out gets a numpy prefix back
            offs = handle.offsets
            for s, e in _runs(offs, None, ns.block_bytes):
                o = int(offs[s])
                dst[s:e].copy_(
                    space_t[o : o + (e - s) * ns.block_bytes].view(e - s, ns.block_bytes)
                )
            _synchronize(dst, space_t)  # the pin must outlive the copy
            if result is None:
                result = dst
        finally:
            self.release(handle, wait=False)
        # Copies are queued on a device: only their end is known. One that ended
        # after the lease ran out may have read reused slots: none of it counts.
        found = 0 if self.expired(handle) else handle.found
        return GetResult(found, result[:found])


def _direct_from_env() -> bool:
    """Direct loads unless $KVSTORE_DIRECT_LOADS says 0/false."""
    return os.environ.get("KVSTORE_DIRECT_LOADS", "1").lower() not in ("0", "false")


def _synchronize(*tensors: Any) -> None:
    import torch

    for t in tensors:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)


def _cuda_rows(tensor: torch.Tensor, n: int, block_bytes: int) -> torch.Tensor:
    import torch

    rows = (
        tensor.reshape(n, -1).view(torch.uint8)
        if n
        else tensor.view(torch.uint8).reshape(0, block_bytes)
    )
    if rows.shape[1] != block_bytes:
        raise errors.BlockSizeMismatch(
            f"blocks have {rows.shape[1]} bytes each; namespace needs {block_bytes}"
        )
    return rows


class _Releaser:
    """One thread that sends queued lease releases, batched, so callers never wait."""

    MAX_QUEUED = 65536  # beyond this, put() blocks: a bound, never a leak
    MAX_BATCH = 4096

    def __init__(self, stub: Callable[[], Any], timeout_s: float, metadata: Any) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._metadata = metadata
        self._queue: queue.Queue[int | None] = queue.Queue(self.MAX_QUEUED)
        self._thread = threading.Thread(target=self._run, name="kvstore-releaser", daemon=True)
        self._thread.start()

    def put(self, lease_id: int) -> None:
        self._queue.put(lease_id)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=self._timeout_s + 1.0)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            batch: list[int] = []
            if first is None:
                stopping = True
            else:
                batch.append(first)
            while len(batch) < self.MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                else:
                    batch.append(item)
            if batch:
                try:
                    self._stub().Release(
                        pb.ReleaseRequest(lease_ids=batch),
                        timeout=self._timeout_s,
                        metadata=self._metadata,
                    )
                except grpc.RpcError:
                    pass  # expired or daemon gone: nothing is held either way


class _Notices:
    """Sends what a client's lean channel has queued (direct loads' notices) when
    no frame has carried it within ``delay_s``: one thread per client, started
    with a lean channel whose daemon takes such messages (``start``), else on
    the first notice (again in a forked child), stopped by close()."""

    def __init__(self, send: Callable[[], None], delay_s: float) -> None:
        self._send = send
        self._delay_s = delay_s
        self._cond = threading.Condition()
        self._due_s = math.inf
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def start(self) -> None:
        """Start the thread now, before any notice: starting one cost 0.3-0.6 ms
        here, which the engine step that queued the first notice (a reserve's
        leftover slots given back, a direct load) paid inside its hooks."""
        self._after_fork()
        with self._cond:
            self._ensure_thread()

    def queued(self) -> None:
        """A notice was queued: it goes within ``delay_s`` unless a frame takes it."""
        self._after_fork()
        with self._cond:
            if self._closed or self._due_s != math.inf:
                return
            self._due_s = time.monotonic() + self._delay_s
            self._ensure_thread()
            self._cond.notify()

    def _after_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._cond, self._thread, self._pid = threading.Condition(), None, os.getpid()

    def _ensure_thread(self) -> None:
        """Start the thread unless it runs or the notices are closed (under ``_cond``)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="kvstore-notices", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread (what is still queued goes with the channel's close)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread if self._pid == os.getpid() else None
        if thread is not None:
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._due_s == math.inf:
                    self._cond.wait()
                if self._closed:
                    return
                wait_s = self._due_s - time.monotonic()
                if wait_s > 0:
                    self._cond.wait(wait_s)
                    continue
                self._due_s = math.inf
            self._send()


@dataclass(frozen=True, slots=True)
class _CommitFields:
    block_hashes: bytes
    parent_block_hash: int | None
    token_ids: bytes
    chains: list[tuple[int, int | None, bytes]]  # (blocks, parent, packed token ids)
    positions: bytes | None = None  # packed uint32: a reserve's commit (lean only)
    keep_rest: bool = False  # a reserve's slots not named stay reserved (lean only)


def _commit_fields(
    hashes: Sequence[int] | np.ndarray | None,
    parent_block_hash: int | None,
    token_ids: Sequence[int] | np.ndarray | None,
    chains: Sequence[tuple[int, int | None]] | None,
    positions: Sequence[int] | np.ndarray | None = None,
    keep_rest: bool = False,
) -> _CommitFields:
    """A commit's fields packed as both channels send them."""
    if keep_rest and positions is None:
        raise errors.InvalidRequest("keep_rest is for a reserve's commit, which names positions")
    packed_hashes = b"" if hashes is None else pack_hashes(hashes)
    packed_positions = None
    if positions is not None:
        where = np.asarray(positions)
        if len(where) and (where.min() < 0 or where.max() >= 1 << 32):
            raise errors.InvalidRequest("a reserve's positions are lease indexes (uint32)")
        packed_positions = where.astype("<u4").tobytes()
    packed = b"" if token_ids is None else np.asarray(token_ids, dtype="<i4").tobytes()
    split: list[tuple[int, int | None, bytes]] = []
    if chains:
        if parent_block_hash is not None:
            raise errors.InvalidRequest("with chains, each chain names its own parent")
        total = sum(n for n, _ in chains)
        if total <= 0 or len(packed) % total:
            raise errors.InvalidRequest(
                f"{len(packed) // 4} token ids do not split evenly over {total} blocks"
            )
        per_block = len(packed) // total
        start = 0
        for count, parent in chains:
            split.append((count, parent, packed[start : start + count * per_block]))
            start += count * per_block
        packed = b""
    return _CommitFields(
        packed_hashes, parent_block_hash, packed, split, packed_positions, keep_rest
    )


def _pb_commit(lease_id: int, f: _CommitFields) -> Any:
    request = pb.CommitStoreRequest(lease_id=lease_id)
    if f.block_hashes:
        request.block_hashes = f.block_hashes
    for count, parent, tokens in f.chains:
        chain = request.chains.add(blocks=count)
        if parent is not None:
            chain.has_parent_block_hash = True
            chain.parent_block_hash = parent
        chain.token_ids = tokens
    if f.parent_block_hash is not None:
        request.has_parent_block_hash = True
        request.parent_block_hash = f.parent_block_hash
    if f.token_ids:
        request.token_ids = f.token_ids
    return request


def _local_commit(lease_id: int, f: _CommitFields) -> Callable[[int], Any]:
    chains = [local_wire.Chain(n, p, t) for n, p, t in f.chains]
    return lambda seq: local_wire.CommitStore(
        seq,
        lease_id,
        f.block_hashes,
        f.parent_block_hash,
        f.token_ids,
        chains,
        f.positions,
        f.keep_rest,
    )


def _store_too_slow(handle: StoreHandle, written: int, total: int) -> errors.LeaseExpired:
    return errors.LeaseExpired(
        f"lease expired while writing: {written} of {total} blocks were copied before the "
        f"lease's deadline; nothing was stored (the slots were given back)"
    )


def _put_result(handle: StoreHandle, stored: int) -> PutResult:
    no_room = int(np.count_nonzero(handle.statuses == pb.STORE_NO_ROOM))
    return PutResult(stored, len(handle.statuses) - stored - no_room, no_room)


def _is_cuda(obj: Any) -> bool:
    return getattr(obj, "is_cuda", False) is True


def _as_rows(blocks: Any, n: int, block_bytes: int, *, writable: bool = False) -> np.ndarray:
    """View blocks (numpy array, CPU tensor, or list of them) as (n, block_bytes) uint8."""
    if isinstance(blocks, list | tuple):
        blocks = (
            np.stack([_as_rows(b, 1, block_bytes)[0] for b in blocks])
            if blocks
            else np.empty((0, block_bytes), np.uint8)
        )
    if hasattr(blocks, "numpy") and not isinstance(blocks, np.ndarray):
        blocks = blocks.detach().contiguous().numpy() if not writable else blocks.numpy()
    arr = np.asarray(blocks)
    if not arr.flags.c_contiguous:
        if writable:
            raise errors.InvalidRequest("out must be C-contiguous")
        arr = np.ascontiguousarray(arr)
    if arr.nbytes != n * block_bytes:
        raise errors.BlockSizeMismatch(
            f"{arr.nbytes} bytes given for {n} blocks of {block_bytes} bytes (need {n * block_bytes})"
        )
    return arr.reshape(-1).view(np.uint8).reshape(n, block_bytes)


# Up to this many blocks, _runs walks Python ints (cheaper than numpy's setup).
SMALL_RUNS_BLOCKS = 16


def _runs(offsets: np.ndarray, rows: np.ndarray | None, block_bytes: int) -> list[tuple[int, int]]:
    """[start, end) index ranges whose offsets (and rows) are consecutive.

    The slab allocator hands out neighbouring slots for neighbouring blocks of
    one request, so a batch is usually a few long runs: each becomes a single
    memcpy instead of one copy per block.
    """
    n = len(offsets)
    if n == 0:
        return []
    if n <= SMALL_RUNS_BLOCKS:
        # Python ints: numpy's diff/flatnonzero cost ~4 us even for one block,
        # a third of a one-block load's client-side work.
        offs = offsets.tolist()
        rws = rows.tolist() if rows is not None else None
        runs, start = [], 0
        for i in range(1, n):
            if offs[i] - offs[i - 1] != block_bytes or (
                rws is not None and rws[i] - rws[i - 1] != 1
            ):
                runs.append((start, i))
                start = i
        runs.append((start, n))
        return runs
    step_ok = np.diff(offsets.astype(np.int64)) == block_bytes
    if rows is not None:
        step_ok &= np.diff(rows.astype(np.int64)) == 1
    breaks = np.flatnonzero(~step_ok) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    return list(zip(starts, ends, strict=True))


def _chunked(runs: list[tuple[int, int]], block_bytes: int) -> list[tuple[int, int]]:
    """The runs cut into pieces of at most COPY_CHUNK_BYTES (at least one block)."""
    per = max(1, COPY_CHUNK_BYTES // block_bytes)
    return [(a, min(e, a + per)) for s, e in runs for a in range(s, e, per)]


def gather(
    region: np.ndarray,
    offsets: np.ndarray,
    out: np.ndarray,
    block_bytes: int,
    *,
    deadline_s: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """out[i] = region[offsets[i] : offsets[i] + block_bytes], in order, until the deadline.

    Returns how many leading rows were copied entirely before ``deadline_s`` (by
    ``clock``): all of them, or fewer when the copy ran late (those rows are not
    valid: the lease may have lapsed and the slots been reused meanwhile).
    """
    offs = offsets.tolist()
    _check_bounds(region, offs, block_bytes)
    _check_rows(out, len(offs), block_bytes)
    spans = _chunked(_runs(offsets, None, block_bytes), block_bytes)
    base, dst = _base(region, writable=False), _base(out, writable=True)
    pieces = [(dst + s * block_bytes, base + offs[s], (e - s) * block_bytes) for s, e in spans]
    # A piece that finished after the deadline may have been read after the
    # lease ran out: it does not count (fence_reads).
    done = memcopy.copy_pieces(
        pieces, deadline_s=deadline_s, clock=clock, fence_reads=True, load=True
    )
    return len(offs) if done == len(spans) else spans[done][0]


def scatter(
    region: np.ndarray,
    offsets: np.ndarray,
    data: np.ndarray,
    rows: np.ndarray,
    block_bytes: int,
    *,
    deadline_s: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """region[offsets[j] : +block_bytes] = data[rows[j]], in order, until the deadline.

    No piece is started after ``deadline_s`` (by ``clock``): a late writer stops
    instead of writing into slots that may be another block's by now. Returns
    how many were written (len(offsets) unless the deadline passed).
    """
    offs = offsets.tolist()
    rws = rows.tolist()
    _check_bounds(region, offs, block_bytes)
    if rws and (min(rws) < 0 or max(rws) >= len(data)):
        raise errors.InvalidRequest(f"rows outside the {len(data)} blocks given")
    _check_rows(data, len(data), block_bytes)
    spans = _chunked(_runs(offsets, rows, block_bytes), block_bytes)
    base, src = _base(region, writable=True), _base(data, writable=False)
    pieces = [(base + offs[s], src + rws[s] * block_bytes, (e - s) * block_bytes) for s, e in spans]
    done = memcopy.copy_pieces(pieces, deadline_s=deadline_s, clock=clock)
    return len(offs) if done == len(spans) else spans[done][0]


def _check_bounds(region: np.ndarray, offs: list[int], block_bytes: int) -> None:
    """Every slot lies inside the mapped region (the copies below use raw addresses)."""
    if offs and (min(offs) < 0 or max(offs) + block_bytes > region.nbytes):
        raise errors.InvalidRequest(
            f"a slot offset outside the {region.nbytes}-byte region "
            f"(offsets {min(offs)}..{max(offs)}, {block_bytes}-byte blocks)"
        )


def _check_rows(arr: np.ndarray, n: int, block_bytes: int) -> None:
    if arr.nbytes < n * block_bytes:
        raise errors.BlockSizeMismatch(
            f"{arr.nbytes} bytes for {n} blocks of {block_bytes} bytes (need {n * block_bytes})"
        )


def _base(arr: np.ndarray, *, writable: bool) -> int:
    """The address of a C-contiguous array's first byte (checked: raw copies follow)."""
    if not arr.flags.c_contiguous:
        raise errors.InvalidRequest("block copies need C-contiguous arrays")
    if writable and not arr.flags.writeable:
        raise errors.InvalidRequest("block copies: the destination is read-only")
    return int(arr.__array_interface__["data"][0])
