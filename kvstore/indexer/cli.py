"""``kvstore indexer``: run the cluster indexer.

    kvstore indexer --source node=a,endpoint=tcp://10.0.0.5:5557,replay_endpoint=tcp://10.0.0.5:5558
    kvstore indexer --config indexer.toml --backend redis --redis-url redis://127.0.0.1:6379/0
    kvstore indexer --vllm-server node=a,url=http://10.0.0.5:8000,model=M   # its DP ranks

Wired into ``kvstore.cli`` through ``add_arguments(parser)`` and ``run(args)``;
``main(argv)`` runs it standalone (``python -m kvstore.indexer``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

import msgspec

from kvstore.errors import ConfigError, KVStoreError
from kvstore.indexer.config import IndexerConfig, load, parse_source, parse_vllm_server
from kvstore.sdnotify import SdNotifier

log = logging.getLogger("kvstore.indexer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file ([indexer] table or top level)")
    parser.add_argument("--address", help="gRPC listen address host:port (default 127.0.0.1:50061)")
    parser.add_argument("--backend", choices=["memory", "redis"], help="index backend")
    parser.add_argument("--redis-url", help="Redis/Valkey URL for --backend redis")
    parser.add_argument("--metrics-address", help="Prometheus /metrics host:port (default off)")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="node=N,endpoint=tcp://H:P[,replay_endpoint=tcp://H:P][,kind=engine,model=M]"
        "[,engine_url=http://H:P]",
        help="an event stream to follow (repeatable; adds to the config file's sources)",
    )
    parser.add_argument(
        "--vllm-server",
        action="append",
        default=[],
        metavar="node=N,url=http://H:P|unix:PATH,model=M[,host=H][,engine_url=U]",
        help="a vLLM OpenAI server: follow each data-parallel rank's KV events as its "
        "GET /kv_event_sources lists them (repeatable; adds to the config's vllm_servers)",
    )
    parser.add_argument(
        "--no-ingest", action="store_true", help="serve scores only (a replica on a shared Redis)"
    )
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def config_from_args(args: argparse.Namespace) -> IndexerConfig:
    overrides: dict[str, Any] = {}
    for flag, key in (
        ("address", "address"),
        ("backend", "backend"),
        ("redis_url", "redis_url"),
        ("metrics_address", "metrics_address"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    if getattr(args, "no_ingest", False):
        overrides["ingest"] = False
    raw = load(getattr(args, "config", None), {})
    if not raw.cluster_secret and os.environ.get("KVSTORE_SECRET"):
        # the same variable the daemons' clients read; the file wins
        overrides["cluster_secret"] = os.environ["KVSTORE_SECRET"]
    cfg = load(getattr(args, "config", None), overrides)
    extra = [parse_source(s) for s in getattr(args, "source", [])]
    servers = [parse_vllm_server(s) for s in getattr(args, "vllm_server", [])]
    if extra or servers:
        cfg = msgspec.structs.replace(
            cfg, sources=[*cfg.sources, *extra], vllm_servers=[*cfg.vllm_servers, *servers]
        )
        cfg.check()
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT; 0 on a clean stop, 2 on a config error."""
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        notifier = SdNotifier.from_env()
        cfg = config_from_args(args)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    if getattr(args, "print_config", False):
        print(msgspec.json.format(msgspec.json.encode(cfg)).decode())
        return 0
    from kvstore.indexer.service import Indexer, serve  # grpc only when serving

    try:
        indexer = Indexer(cfg)
    except KVStoreError as e:
        log.error("cannot start the indexer: %s", e)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        indexer.start()
        server, port = serve(indexer, cfg.address)
    except KVStoreError as e:
        log.error("cannot start the indexer: %s", e)
        indexer.close()
        return 2
    host = cfg.address.rsplit(":", 1)[0]
    metrics_server = None
    if cfg.metrics_address:
        from kvstore.indexer.metrics import serve_metrics

        try:
            metrics_server, mport = serve_metrics(indexer, cfg.metrics_address)
        except OSError as e:
            log.error("cannot serve metrics on %s: %s", cfg.metrics_address, e)
            server.stop(0)
            indexer.close()
            return 2
        print(f"kvstore indexer metrics on {cfg.metrics_address.rsplit(':', 1)[0]}:{mport}")
    # one line tests and scripts can wait for
    print(f"kvstore indexer listening on {host}:{port}", flush=True)
    log.info("indexer backend=%s sources=%d", cfg.backend, len(cfg.sources))
    notifier.ready(status=f"listening on {host}:{port}")
    interval_s = notifier.watchdog_interval_s
    while not stop.wait(interval_s):  # None (unarmed): wait for the signal only
        # An indexer whose ingestion is down or whose backend is unreachable
        # answers stale scores: let systemd's watchdog restart it.
        if indexer.healthy:
            notifier.watchdog()
    notifier.stopping()
    if metrics_server is not None:
        metrics_server.shutdown()
    server.stop(grace=2.0).wait(3.0)
    indexer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore indexer", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
