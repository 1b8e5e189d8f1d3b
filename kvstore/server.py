"""The daemon process: assembles region, manager, gRPC server, metrics, reaper.

Life cycle: start() binds everything (port 0 picks free ports) and prints one
JSON ``ready`` line on stdout with the bound addresses; SIGTERM/SIGINT flip
health to NOT_SERVING, stop accepting calls, let in-flight ones finish within
``server.drain_timeout_s``, then release the region and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvstore.audit import AuditCollector
from kvstore.auth import TcpSecretInterceptor
from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.event_loop import use_event_loop
from kvstore.events.sink import EventSink
from kvstore.files import FilePolicy, claim_socket_path
from kvstore.heap import CollectorPauses, settle_heap
from kvstore.identity import Authorizer
from kvstore.local_server import LocalServer, local_socket_path
from kvstore.manager import BlockManager
from kvstore.metrics import (
    ManagerCollector,
    MetricsInterceptor,
    PeerMetrics,
    RpcMetrics,
    serve_metrics,
)
from kvstore.presence import PresenceTable, presence_path
from kvstore.quotas import tenant_regions
from kvstore.rpc_guard import ParseGuardInterceptor
from kvstore.sdnotify import SdNotifier
from kvstore.service import StoreService
from kvstore.tiers.dram import Region
from kvstore.tls import TlsFiles
from kvstore.v1 import store_pb2, store_pb2_grpc

log = logging.getLogger("kvstore.server")

STORE_SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["StoreService"].full_name


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.region: Region | None = None
        self.manager: BlockManager | None = None
        self.peer: Any = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.registry = CollectorRegistry()
        self.gc_pauses = CollectorPauses()  # timed only with /metrics on
        self.tcp_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._sink: EventSink | None = None
        self._stopping = asyncio.Event()
        self._socket_bound = False
        self.local: LocalServer | None = None  # the lean local channel (kvstore.local_server)

    def _warn_if_tenants_share_memory(self) -> None:
        """Principals make tenants separate trust domains, but a tenant without its own
        DRAM region shares the one file every admitted local client maps: say so
        once at start, naming principals (never a cache_salt)."""
        cfg = self.config
        separated = {r.tenant for r in tenant_regions(cfg)}
        sharing = sorted(
            name
            for name, p in cfg.auth.principals.items()
            if any(t != "*" and t not in separated for t in p.tenants)
        )
        if sharing:
            log.warning(
                "auth.principals maps callers to tenants, but the tenants of %s share the "
                "one DRAM region that every admitted local client maps: their blocks are "
                "separated by the API, not by memory. Give each tenant a "
                "quotas.tenants.<name>.dram_bytes cap and set dram.tenant_regions = true "
                "(docs/tenants.md)",
                ", ".join(sharing),
            )

    def _make_sink(self) -> EventSink | None:
        if not self.config.events.enabled:
            return None
        from kvstore.events.publisher import ZmqEventPublisher

        return ZmqEventPublisher.from_config(self.config.node_id, self.config.events)

    async def start(self) -> None:
        cfg = self.config
        tls = TlsFiles(cfg.tls.cert_path, cfg.tls.key_path, cfg.tls.ca_path)
        # Read and checked before anything is allocated or listens: a bad file stops
        # the start with an error naming it (kvstore/tls.py).
        server_credentials = tls.server_credentials() if tls.enabled else None
        # Principals mapped to tenants; None (none configured): one trust domain.
        auth = Authorizer.from_config(cfg.auth.principals, "auth.principals")
        if auth is not None:
            self._warn_if_tenants_share_memory()
        if cfg.server.socket_path:
            # Before anything is allocated: a second daemon on one socket stops here.
            claim_socket_path(cfg.server.socket_path)
        self.region = Region(
            cfg.dram.path,
            cfg.dram.capacity_bytes,
            prefault=cfg.dram.prefault,
            huge_pages=cfg.dram.huge_pages,
            files=FilePolicy.from_group(cfg.server.file_group),
            # dram.tenant_regions: one file per capped tenant (docs/tenants.md)
            partitions=[(r.name, r.nbytes) for r in tenant_regions(cfg)],
        )
        self.region.warn_if_not_memory()
        self.region.collapse_huge_pages()  # in the background (dram.huge_pages = auto)
        self._sink = self._make_sink()
        self.manager = BlockManager(cfg, self.region, self._sink)
        if cfg.server.presence_table and not cfg.dram.tenant_regions and not cfg.auth.principals:
            # One table for every tenant would tell a client whether another tenant
            # holds a prefix, past the namespace check a Lookup call gets: with
            # tenant regions or principals, lookups stay calls (docs/presence.md).
            self.manager.publish_presence(
                PresenceTable.create(
                    presence_path(cfg.dram.path),
                    cfg.dram.capacity_bytes + (cfg.disk.capacity_bytes if cfg.disk.path else 0),
                    FilePolicy.from_group(cfg.server.file_group),
                    self.region.region_id,
                )
            )
        peer_metrics: PeerMetrics | None = None
        if cfg.peer.enabled:
            from kvstore.peer_service import PeerNode  # imports NIXL only when enabled

            peer_metrics = PeerMetrics(self.registry)
            self.peer = PeerNode(
                self.manager,
                secret=cfg.peer.secret,
                transport=cfg.peer.transport,
                transfer_timeout_s=cfg.peer.transfer_timeout_s,
                peers=cfg.peer.peers,
                max_message_bytes=cfg.server.max_message_bytes,
                metrics=peer_metrics,
                pull_piece_bytes=cfg.peer.pull_piece_bytes,
                tls=tls,
                pin_channel=cfg.peer.pin_channel,
                pin_port=cfg.peer.pin_port,
            )

        options = [
            ("grpc.max_receive_message_length", cfg.server.max_message_bytes),
            ("grpc.max_send_message_length", cfg.server.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        rpc_metrics = RpcMetrics(self.registry)  # the lean channel's calls count here too
        interceptors: list[grpc.aio.ServerInterceptor] = [
            MetricsInterceptor(rpc_metrics),
            ParseGuardInterceptor(),
        ]
        # Always: without a secret it keeps every data call off TCP (kvstore/auth.py).
        interceptors.append(TcpSecretInterceptor(cfg.peer.secret, tls=tls.enabled, auth=auth))
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=options,
            maximum_concurrent_rpcs=cfg.server.max_concurrent_rpcs,
        )
        peer_fill = self.peer.fill if self.peer is not None else None
        store_service = StoreService(
            self.manager,
            peer_fill,
            peer_counters=peer_metrics.counters if peer_metrics is not None else None,
            addresses=self.endpoints,
            auth=auth,
        )
        if self.peer is not None:
            self.peer.fetch_service.allow = store_service.requests.allow_namespace
        store_pb2_grpc.add_StoreServiceServicer_to_server(store_service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        peer_services = self.peer.add_to_server(self.server) if self.peer is not None else []
        reflection.enable_server_reflection(
            [
                STORE_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
                *peer_services,
            ],
            self.server,
        )
        if cfg.server.socket_path:
            self.server.add_insecure_port(f"unix:{cfg.server.socket_path}")
            self._socket_bound = True
        if cfg.server.tcp_address:
            try:
                if server_credentials is not None:
                    self.tcp_port = self.server.add_secure_port(
                        cfg.server.tcp_address, server_credentials
                    )
                else:
                    self.tcp_port = self.server.add_insecure_port(cfg.server.tcp_address)
            except RuntimeError as exc:
                raise ConfigError(
                    f"server.tcp_address: cannot bind {cfg.server.tcp_address}: {exc}"
                ) from None
        await self.server.start()
        if self.peer is not None and self.tcp_port is not None:
            # pins between daemons without gRPC (kvstore/transfer/pin_channel.py)
            await self.peer.start(cfg.server.tcp_address.rpartition(":")[0] or "127.0.0.1")
        if cfg.server.socket_path:
            os.chmod(cfg.server.socket_path, 0o660)
        if cfg.server.socket_path and cfg.server.local_channel:
            region = self.region
            self.local = LocalServer(
                store_service.requests,  # the gRPC service's own handling
                local_socket_path(cfg.server.socket_path),
                node_id=self.manager.node_id,
                region_id=lambda: region.region_id,
                max_frame_bytes=cfg.server.max_message_bytes,
                max_connections=cfg.server.local_max_connections,
                policy=FilePolicy.from_group(cfg.server.file_group),
                metrics=rpc_metrics,
                fetch=self.peer.fetch_service.fetch if self.peer is not None else None,
                presence_path=self.manager.presence.path if self.manager.presence else "",
                hand_over=self.peer.fetch_service.hand_over if self.peer is not None else None,
            )
            try:
                await self.local.start()
            except OSError as exc:  # e.g. a path past AF_UNIX's 107 bytes: gRPC serves alone
                log.warning(
                    "lean local channel not served (%s); clients use gRPC",
                    exc,
                    extra={"fields": {"path": self.local.path}},
                )
                self.local = None

        if cfg.metrics.address:
            self.registry.register(ManagerCollector(self.manager))
            self.registry.register(AuditCollector())
            self.gc_pauses.export(self.registry)
            try:
                self._metrics_server, self.metrics_port = serve_metrics(
                    cfg.metrics.address, self.registry
                )
            except OSError as exc:
                raise ConfigError(
                    f"metrics.address: cannot bind {cfg.metrics.address}: {exc.strerror}"
                ) from None

        self._tasks.append(asyncio.create_task(self._reap_leases(), name="lease-reaper"))
        for service in ("", STORE_SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    @property
    def tcp_address(self) -> str | None:
        if self.tcp_port is None:
            return None
        host = self.config.server.tcp_address.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self.tcp_port}"

    def endpoints(self) -> dict[str, str | None]:
        """Every address this daemon bound, port 0 resolved (None = not bound), and its
        peer transport: what the ready line, Hello and ``kvstore status`` report."""
        host = self.config.metrics.address.rpartition(":")[0] or "127.0.0.1"
        sink = self._sink
        return {
            "socket_path": self.config.server.socket_path or None,
            "tcp_address": self.tcp_address,
            "metrics_address": f"{host}:{self.metrics_port}" if self.metrics_port else None,
            "events_publish_address": getattr(sink, "endpoint", None),
            "events_replay_address": getattr(sink, "replay_endpoint", None),
            "peer_transport": self.peer.transport_kind if self.peer is not None else None,
        }

    def ready_info(self) -> dict[str, Any]:
        assert self.region is not None
        return {
            "event": "ready",
            "node_id": self.config.node_id,
            "pid": os.getpid(),
            **self.endpoints(),
            "region_path": self.region.path,
            "region_bytes": self.region.capacity_bytes,
            "region_page_bytes": self.region.page_bytes,
        }

    async def _reap_leases(self) -> None:
        assert self.manager is not None
        interval_s = self.config.leases.reap_interval_s
        while True:
            await asyncio.sleep(interval_s)
            expired = self.manager.expire_leases()
            if expired:
                log.info("reclaimed expired leases", extra={"fields": {"count": expired}})

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def stop(self) -> None:
        """Drain: refuse new calls, let in-flight ones finish, release everything."""
        for service in ("", STORE_SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.server is not None:
            # The lean channel keeps serving meanwhile: commits clients flush on
            # their way out still land.
            await self.server.stop(grace=self.config.server.drain_timeout_s)
        if self.local is not None:
            await self.local.close()
        self.gc_pauses.uninstall()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._sink is not None and hasattr(self._sink, "close"):
            self._sink.close()
        if self.peer is not None:
            await self.peer.close()  # NIXL deregisters before the region is unmapped
        if self.manager is not None:
            await self.manager.close()  # background demotion stops, disk files close
        if self.region is not None:
            self.region.close(unlink=True)  # the warm-restart hook may keep it
        if self._socket_bound:  # never another daemon's socket after a failed start
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.server.socket_path)


async def serve(config: Config) -> int:
    notifier = SdNotifier.from_env()  # malformed NOTIFY_SOCKET/WATCHDOG_USEC: ConfigError, exit 2
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        await daemon.start()
    except BaseException:
        if daemon.region is not None:
            daemon.region.close_hooks.clear()  # nothing was served: no warm-restart manifest
        await daemon.stop()
        raise
    # After start-up (a warm restart's blocks loaded, the tiers and NIXL up):
    # full collections walk only what serving allocates from here on.
    settle_heap()
    info = daemon.ready_info()
    log.info("serving", extra={"fields": {k: v for k, v in info.items() if k != "event"}})
    print(json.dumps(info), flush=True)
    notifier.ready(status=f"serving {info['tcp_address'] or info['socket_path']}")
    watchdog = asyncio.create_task(notifier.watchdog_loop(), name="sd-watchdog")
    await daemon.wait_stopped()
    notifier.stopping(status="draining")
    log.info("draining", extra={"fields": {"grace_s": config.server.drain_timeout_s}})
    await daemon.stop()
    watchdog.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watchdog
    notifier.close()
    log.info("stopped")
    return 0


def run(config: Config) -> int:
    log.info("event loop: %s", use_event_loop(config.server.event_loop, "server.event_loop"))
    rc = asyncio.run(serve(config))
    sys.stdout.flush()
    sys.stderr.flush()
    if config.peer.enabled:
        # A process that created a UCX backend segfaults at interpreter exit (libnl
        # bundled in the NIXL wheel); everything is closed by now, so skip the exit hooks.
        os._exit(rc)
    return rc
