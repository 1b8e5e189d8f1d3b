"""The NIXL edge: one agent per daemon, one registered region, batched READs.

The only module that imports NIXL (1.5.1, wheel ``nixl-cu12``, or ``nixl-cu13``
on CUDA 13 machines: same API, module ``nixl_cu13``). Facts it is
built on, measured on the project's machines (docs: environment.md):

- UCX backend, progress thread off: the thread burns ~0.45 core per idle
  agent. So nothing moves unless someone calls into the agent: the puller
  polls its transfer, and the owner must keep calling ``get_new_notifs`` or a
  peer's first connection (and any UCX_TLS=tcp transfer) never completes.
  ``ProgressPump`` does that on the owner, fast while pins are outstanding.
- A killed peer makes the next transfer raise ``nixlRemoteDisconnectError``;
  a transfer in flight may instead just stop progressing, so every wait has a
  deadline.
- Unmapping registered memory breaks the connection to every peer: call
  ``close()`` (deregister) before the region is unmapped.
- Every process that created a UCX backend segfaults at interpreter exit:
  the owner process must ``close()`` and then ``os._exit``.

The agent is not thread-safe with NIXL's default sync mode when the listener
thread is off, so every call into it goes through one lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.errors import (
    BackendError,
    DeadlineExceeded,
    InvalidRequest,
    KVStoreError,
    StateConflict,
    Unavailable,
)
from kvstore.transfer.base import KIND_NIXL, SHORT_BATCH, PeerLink, ReadBatch

log = logging.getLogger(__name__)

_PUMP_BUSY_S = 0.0001
_POLL_SLICE_S = 0.002
_PUMP_IDLE_S = 0.02


# The import names of NIXL's wheels: the meta-package, the CUDA 12 and CUDA 13 builds.
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def load_nixl() -> tuple[Any, Any]:
    """Import NIXL's Python API; ``BackendError`` with the reason when it cannot load."""
    errors = []
    for module in NIXL_MODULES:
        try:
            mod = __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
            return mod.nixl_agent, mod.nixl_agent_config
        except Exception as exc:  # ImportError, or a shared library that fails to load
            errors.append(f"{module}: {exc!r}")
    raise BackendError("NIXL cannot load: " + "; ".join(errors))


def _is_disconnect(exc: BaseException) -> bool:
    return type(exc).__name__ == "nixlRemoteDisconnectError"


class NixlAgent:
    """One NIXL agent with the UCX backend and at most one registered DRAM region."""

    def __init__(self, name: str, *, num_threads: int = 0) -> None:
        agent_cls, config_cls = load_nixl()
        config = config_cls(enable_prog_thread=False, backends=["UCX"], num_threads=num_threads)
        started = time.monotonic()
        try:
            self._agent = agent_cls(name, config)
        except Exception as exc:
            raise BackendError(f"NIXL agent {name!r}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise BackendError("NIXL loaded but its UCX backend did not (plugin missing?)")
        self.name = name
        self._lock = threading.Lock()
        self._reg: Any = None
        self._region = (0, 0)
        self._mem_type = "DRAM"
        self._device_id = 0
        self._metadata: bytes | None = None
        self._peers: dict[str, bytes] = {}  # agent name -> digest of its metadata
        self._closed = False
        log.info("NIXL agent %s ready in %.2f s", name, time.monotonic() - started)

    # region ---------------------------------------------------------------
    @property
    def region(self) -> tuple[int, int]:
        """(base address, nbytes) of the registered region; (0, 0) if none."""
        return self._region

    def register_region(
        self, addr: int, nbytes: int, *, mem_type: str = "DRAM", device_id: int = 0
    ) -> None:
        """Register the region peers read from and we read into. Once.

        mem_type "DRAM" (host memory; device_id 0) or "VRAM" (CUDA memory of
        device ``device_id``, e.g. a GPU pool)."""
        if self._reg is not None:
            raise StateConflict("a region is already registered with this NIXL agent")
        if addr <= 0 or nbytes <= 0:
            raise InvalidRequest(f"bad region ({addr:#x}, {nbytes})")
        if mem_type not in ("DRAM", "VRAM") or device_id < 0:
            raise InvalidRequest(f"mem_type must be DRAM or VRAM, device_id >= 0: {mem_type!r}")
        with self._lock:
            try:
                self._reg = self._agent.register_memory([(addr, nbytes, device_id, "")], mem_type)
            except Exception as exc:
                raise BackendError(f"NIXL register_memory ({mem_type}): {exc}") from exc
            self._region = (addr, nbytes)
            self._mem_type = mem_type
            self._device_id = device_id
            self._metadata = None

    def deregister_region(self) -> None:
        """Deregister before unmapping: peers must not read memory that is gone."""
        if self._reg is None:
            return
        with self._lock:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                log.error("NIXL deregister_memory failed: %s", exc)
            self._reg = None
            self._region = (0, 0)
            self._metadata = None

    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered region), cached."""
        if self._metadata is None:
            with self._lock:
                self._metadata = bytes(self._agent.get_agent_metadata())
        return self._metadata

    # peers ------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; return its agent name. Idempotent for the same bytes;
        replaces what was loaded under the same name otherwise (the peer re-registered)."""
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        with self._lock:
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise BackendError(f"NIXL add_remote_agent: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            old = self._peers.get(name)
            if old is not None and old != digest:
                # Same name, new bytes: drop the stale connection, load again.
                self._agent.remove_remote_agent(name)
                name = self._agent.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = digest
        return name

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if self._peers.pop(name, None) is None:
                return
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # already gone on NIXL's side: nothing to undo
                log.debug("NIXL remove_remote_agent(%s): %s", name, exc)

    # transfers ---------------------------------------------------------------
    def start_read(
        self,
        peer: str,
        remote_base: int,
        batch: ReadBatch,
        *,
        remote_mem_type: str = "DRAM",
        remote_device_id: int = 0,
    ) -> Any:
        """Post one READ for the whole batch; return its handle.

        remote_mem_type / remote_device_id: how the peer registered its region."""
        if self._reg is None:
            raise StateConflict("no region registered")
        if peer not in self._peers:
            raise StateConflict(f"NIXL peer {peer!r} not loaded")
        local: Any
        remote: Any
        if 0 < len(batch) <= SHORT_BATCH:  # (address, bytes, device) tuples: fewer calls
            sizes = batch.sizes.tolist()
            base, device = self._region[0], self._device_id
            local = [
                (o + base, s, device)
                for o, s in zip(batch.local_offsets.tolist(), sizes, strict=True)
            ]
            remote = [
                (o + remote_base, s, remote_device_id)
                for o, s in zip(batch.remote_offsets.tolist(), sizes, strict=True)
            ]
        else:  # the same rows as an Nx3 array
            local = np.zeros((len(batch), 3), dtype=np.uint64)
            remote = np.zeros((len(batch), 3), dtype=np.uint64)
            local[:, 0] = batch.local_offsets + np.uint64(self._region[0])
            local[:, 1] = batch.sizes
            local[:, 2] = self._device_id
            remote[:, 0] = batch.remote_offsets + np.uint64(remote_base)
            remote[:, 1] = batch.sizes
            remote[:, 2] = remote_device_id
        with self._lock:
            try:
                ldescs = self._agent.get_xfer_descs(local, self._mem_type)
                rdescs = self._agent.get_xfer_descs(remote, remote_mem_type)
                handle = self._agent.initialize_xfer("READ", ldescs, rdescs, peer)
                state = self._agent.transfer(handle)
            except Exception as exc:
                if _is_disconnect(exc):
                    raise Unavailable(f"NIXL peer {peer} disconnected: {exc}") from exc
                if type(exc).__name__ == "nixlNotFoundError":
                    # NIXL found no registration covering a descriptor on one side.
                    raise InvalidRequest(f"READ from {peer}: outside registered memory") from exc
                raise BackendError(f"NIXL READ from {peer}: {exc}") from exc
        if state == "ERR":
            self.release(handle)
            raise Unavailable(f"NIXL READ from {peer} failed to post")
        return handle

    def poll(self, handle: Any, peer: str = "") -> bool:
        """True once the transfer is done; raises if it failed."""
        with self._lock:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                if _is_disconnect(exc):
                    raise Unavailable(f"NIXL peer {peer} disconnected: {exc}") from exc
                raise BackendError(f"NIXL transfer state: {exc}") from exc
        if state == "ERR":
            raise Unavailable(f"NIXL READ from {peer} failed (peer gone?)")
        return state == "DONE"

    def wait(self, handle: Any, timeout_s: float, peer: str = "") -> None:
        """Poll the transfer until done; bounded by ``timeout_s``. Releases the handle."""
        deadline = time.monotonic() + timeout_s
        try:
            # Progress happens only inside polls (progress thread off): poll back to back.
            while not self.poll(handle, peer):
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"NIXL READ from {peer} not done after {timeout_s:.3g} s"
                    )
        except KVStoreError as exc:
            if not self.release(handle):
                exc.slots_in_use = True  # type: ignore[attr-defined]
            raise
        self.release(handle)

    def read(
        self,
        peer: str,
        remote_base: int,
        batch: ReadBatch,
        timeout_s: float,
        *,
        remote_mem_type: str = "DRAM",
        remote_device_id: int = 0,
    ) -> None:
        handle = self.start_read(
            peer,
            remote_base,
            batch,
            remote_mem_type=remote_mem_type,
            remote_device_id=remote_device_id,
        )
        self.wait(handle, timeout_s, peer)

    def release(self, handle: Any) -> bool:
        """Free a transfer handle, cancelling it if still running. False if NIXL could not:
        the READ may still write into the local slots, which must then not be reused."""
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
                return True
            except Exception as exc:
                log.warning("NIXL could not release a transfer handle: %s", exc)
                return False

    def progress(self) -> dict[str, list[bytes]]:
        """Drive the UCX worker (and collect notifications): the owner side's duty."""
        with self._lock:
            if self._closed:
                return {}
            return self._agent.get_new_notifs()

    def close(self) -> None:
        """Drop every peer and deregister. The process must still exit with os._exit."""
        if self._closed:
            return
        for name in list(self._peers):
            self.remove_peer(name)
        self.deregister_region()
        with self._lock:
            self._closed = True


class ProgressPump:
    """A thread that keeps the owner's agent progressing: fast while any pin is
    outstanding (peers are reading), slow otherwise (connection requests)."""

    def __init__(
        self, agent: NixlAgent, busy_s: float = _PUMP_BUSY_S, idle_s: float = _PUMP_IDLE_S
    ):
        self._agent = agent
        self._busy_s = busy_s
        self._idle_s = idle_s
        self._holds: dict[int, float] = {}  # token -> monotonic expiry
        self._holds_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
        self._thread.start()

    def hold(self, token: int, ttl_s: float) -> None:
        """Poll fast until ``release(token)`` or ``ttl_s`` from now."""
        with self._holds_lock:
            self._holds[token] = time.monotonic() + ttl_s
        self._wake.set()

    def release(self, token: int) -> None:
        with self._holds_lock:
            self._holds.pop(token, None)

    def _busy(self) -> bool:
        now = time.monotonic()
        with self._holds_lock:
            for token, expiry in list(self._holds.items()):
                if expiry <= now:
                    del self._holds[token]
            return bool(self._holds)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._agent.progress()
            except Exception as exc:  # a peer that vanished; keep serving the others
                log.debug("NIXL progress: %s", exc)
            if self._busy():
                time.sleep(self._busy_s)
            else:
                self._wake.wait(self._idle_s)
                self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2.0)


class NixlTransport:
    """``Transport`` over a ``NixlAgent``; blocking NIXL calls run off the event loop."""

    kind = KIND_NIXL

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.pump = ProgressPump(agent)

    def local_info(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, info: bytes) -> str:
        return self.agent.add_peer(info)

    def forget_peer(self, key: str) -> None:
        self.agent.remove_peer(key)

    def has_peer(self, key: str) -> bool:
        return self.agent.has_peer(key)

    async def read(
        self,
        peer: PeerLink,
        batch: ReadBatch,
        timeout_s: float,
        *,
        share_gil: Callable[[], bool] | None = None,
    ) -> None:
        """Post the READ and poll it from the event loop, so a cancelled pull
        cancels the transfer (the handle is released) before its slots are freed.

        NIXL's poll keeps the GIL: while ``share_gil()`` is true, each idle poll
        is followed by ``os.sched_yield()`` (0.6 us, and it drops the GIL), so a
        hashing thread gets the GIL back at once instead of after Python's 5 ms
        switch interval (measured: hashing 64 MiB of 2 MiB blocks beside a poll
        loop took 73 ms without, 5-12 ms with; 5 ms alone)."""
        if not len(batch):
            return
        batch.check_bounds(peer.region_bytes, self.agent.region[1])
        deadline = time.monotonic() + timeout_s
        handle = self.agent.start_read(peer.key, peer.region_base, batch)
        released = False
        try:
            # With the progress thread off, the READ advances only inside our polls
            # (over CMA the copy itself runs in them), so poll back to back, and
            # give the event loop a turn every slice so other calls are not starved.
            while True:
                slice_end_s = time.monotonic() + _POLL_SLICE_S
                done = self.agent.poll(handle, peer.node_id)
                while not done and time.monotonic() < slice_end_s:
                    if share_gil is not None and share_gil():
                        os.sched_yield()
                    done = self.agent.poll(handle, peer.node_id)
                if done:
                    break
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"NIXL READ from {peer.node_id} not done after {timeout_s:.3g} s"
                    )
                await asyncio.sleep(0)
            released = self.agent.release(handle)
        except BaseException as exc:
            if not self.agent.release(handle) and isinstance(exc, KVStoreError):
                exc.slots_in_use = True  # type: ignore[attr-defined]
            raise
        if not released:
            log.warning("NIXL READ from %s done but its handle leaked", peer.node_id)

    def close(self) -> None:
        self.pump.stop()
        self.agent.close()
