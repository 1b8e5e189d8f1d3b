"""`kvstore` command line: serve, status, indexer.

kvstore serve [--config FILE] [--set section.key=value ...] [--print-config]
kvstore status [--address unix:/tmp/kvstore.sock] [--json]
kvstore status --indexer HOST:PORT [--json]   (sources, staleness, health)
kvstore indexer ...            (the cluster indexer; see `kvstore indexer -h`)
kvstore router [--config FILE] [--set router.key=value ...] [--print-config]
kvstore keys curve --out DIR [--name NAME]   (a ZMQ CURVE key pair for the KV events)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvstore.errors import ConfigError, KVStoreError


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the node daemon (embedded defaults need no arguments)")
    p.add_argument("--config", help="TOML config file (also KVSTORE_CONFIG)")
    p.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field; repeatable (e.g. --set dram.capacity_bytes=4GiB)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the merged config as TOML and exit"
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.config import load_config, to_toml
    from kvstore.logs import setup_logging

    config = load_config(args.config, assignments=args.assignments)
    if args.print_config:
        sys.stdout.write(to_toml(config))
        return 0
    setup_logging(config.log.level, config.log.format)
    from kvstore.server import run

    return run(config)


def _add_status(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("status", help="print a live summary of a running daemon")
    p.add_argument(
        "--address",
        default=None,
        help="daemon address (default $KVSTORE_ADDRESS or unix:/tmp/kvstore.sock)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument(
        "--token-file",
        default="",
        help="file (0600) holding our bearer token, for a daemon or indexer with "
        "principals (default $KVSTORE_TOKEN, else $KVSTORE_TOKEN_FILE)",
    )
    p.add_argument(
        "--indexer",
        metavar="HOST:PORT",
        help="show a cluster indexer instead: health, and per source its staleness",
    )


def _indexer_status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.identity import client_token, token_metadata
    from kvstore.tls import TlsFiles
    from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

    metadata = token_metadata(client_token(None, args.token_file))

    tls = TlsFiles.from_env()  # KVSTORE_TLS_*: an indexer with mutual TLS
    ch = (
        grpc.secure_channel(args.indexer, tls.channel_credentials())
        if tls.enabled
        else grpc.insecure_channel(args.indexer)
    )
    with ch:
        try:
            nodes = indexer_pb2_grpc.IndexerServiceStub(ch).ListNodes(
                indexer_pb2.ListNodesRequest(), timeout=args.timeout_s, metadata=metadata
            )
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=args.timeout_s
            )
        except grpc.RpcError as e:
            print(
                f"kvstore status: indexer {args.indexer}: {e.code()} {e.details()}", file=sys.stderr
            )
            return 1
    serving = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    if args.json:
        doc = MessageToDict(nodes, always_print_fields_with_no_presence=True)
        print(json.dumps({"health": serving, **doc}, indent=2))
        return 0

    def age(s: float) -> str:
        return "never" if s < 0 else f"{s:.1f}s"

    print(f"kvstore indexer at {args.indexer}: {serving}, {len(nodes.sources)} sources")
    for n in nodes.sources:
        src = n.source
        how = "registered" if n.registered else "configured"
        print(
            f"  {src.node:<16} {src.kind or 'daemon':<6} {how:<10} "
            f"{'up' if n.connected else 'DOWN':<4} last event {age(n.last_event_age_s):>7} ago, "
            f"snapshot {age(n.since_snapshot_s):>7} ago, seq {n.next_seq}, "
            f"snapshots={n.snapshots} errors={n.errors}"
            + (f"\n    handshake failed: {n.handshake_error}" if n.handshake_error else "")
        )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    if args.indexer:
        return _indexer_status(args)

    from kvstore.client import Client

    with Client(
        args.address, timeout_s=args.timeout_s, map_region=False, token_file=args.token_file
    ) as client:
        stats = client.stats()
        info = client.info
    addresses = {name: getattr(info, name) or None for name in _ADDRESS_FIELDS}
    if args.json:
        doc = {"hello": MessageToDict(info), "stats": MessageToDict(stats), "addresses": addresses}
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"kvstore {info.version} node={stats.node_id} up {stats.uptime_s:.0f}s at {client.address}"
    )
    print("  " + " ".join(f"{k.removesuffix('_address')}={v}" for k, v in addresses.items() if v))
    print(f"  region {info.region_path} ({info.region_bytes / 2**30:.2f} GiB)")
    for t in stats.tiers:
        from kvstore.v1 import store_pb2

        name = store_pb2.Tier.Name(t.tier).removeprefix("TIER_").lower()
        pct = 100.0 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        print(
            f"  {name:<5} {t.used_bytes / 2**20:10.1f} / {t.capacity_bytes / 2**20:.1f} MiB ({pct:5.1f}%)"
            f"  blocks={t.blocks} pinned={t.pinned_blocks}"
            + (f" in 2 MiB pages={t.huge_page_bytes / 2**20:.0f} MiB" if t.huge_page_bytes else "")
        )
    for r in stats.tenants:  # configured names; "_other" sums the rest (docs/tenants.md)
        parts = []
        for tier in ("dram", "disk", "gpu"):
            used, cap = getattr(r, f"{tier}_bytes"), getattr(r, f"{tier}_quota_bytes")
            if used or cap:
                of = f" / {cap / 2**20:.1f}" if cap else ""
                parts.append(f"{tier} {used / 2**20:.1f}{of} MiB")
        who = f"{r.tenant} ({r.tenants} tenants)" if r.tenant == "_other" else r.tenant
        print(f"  tenant {who}: namespaces={r.namespaces} " + (", ".join(parts) or "no bytes"))
    looked = stats.lookup_hit_blocks + stats.lookup_miss_blocks
    hit = 100.0 * stats.lookup_hit_blocks / looked if looked else 0.0
    print(
        f"  namespaces={stats.namespaces} leases={stats.active_leases} stored={stats.stored_blocks} "
        f"loaded={stats.loaded_blocks} evicted={stats.evicted_blocks} expired_leases={stats.expired_leases}"
    )
    # (local clients answer most lookups from the presence table: never a call)
    print(
        f"  lookup hit rate {hit:.1f}% ({stats.lookup_hit_blocks}/{looked} blocks of Lookup "
        "calls; not those answered from the presence table)"
    )
    if info.peer_transport:
        print(f"  peer transfer over {info.peer_transport}:")
    for p in stats.peer:
        print(
            f"    {p.transport:<11} pulled {p.fetched_blocks} blocks ({p.fetched_bytes / 2**20:.1f} MiB)"
            f" in {p.pulls} pulls, {p.pull_failures} failed, {p.checksum_failed_blocks} bad checksums;"
            f" served {p.served_blocks} blocks ({p.served_bytes / 2**20:.1f} MiB)"
            f" in {p.serve_pins} pins, {p.serve_failures} refused"
            + (
                f"; {p.handed_over_pulls} pulls read pins handed over"
                if p.handed_over_pulls
                else ""
            )
        )
    return 0


# HelloResponse fields naming what the daemon bound.
_ADDRESS_FIELDS = (
    "socket_path",
    "tcp_address",
    "metrics_address",
    "events_publish_address",
    "events_replay_address",
)


def _add_indexer(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    try:
        from kvstore.indexer import cli as indexer_cli
    except ImportError:
        return
    p = sub.add_parser("indexer", help="run the cluster indexer (KV events -> prefix scores)")
    indexer_cli.add_arguments(p)
    p.set_defaults(func=indexer_cli.run)


def _add_router(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvstore.router import cli as router_cli

    p = sub.add_parser(
        "router", help="run the OpenAI-compatible router in front of the engines (docs/router.md)"
    )
    router_cli.add_arguments(p)
    p.set_defaults(func=router_cli.run)


def _add_keys(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("keys", help="make keys: `keys curve` for the KV event streams")
    kinds = p.add_subparsers(dest="kind", required=True)
    c = kinds.add_parser(
        "curve",
        help="a ZMQ CURVE key pair: OUT/NAME.key (public) and OUT/NAME.key_secret (0600)",
    )
    c.add_argument("--out", required=True, help="directory to write the two files into")
    c.add_argument("--name", default="", help="file name without suffix (default: host name)")
    p.set_defaults(func=_cmd_keys)


def _cmd_keys(args: argparse.Namespace) -> int:
    import os
    import socket

    from kvstore.events.curve import write_keypair

    os.makedirs(args.out, mode=0o700, exist_ok=True)
    public_path, secret_path, public = write_keypair(args.out, args.name or socket.gethostname())
    print(f"public key {public}")
    print(f"wrote {public_path} (public: give it, or the key above, to the other side)")
    print(f"wrote {secret_path} (secret, 0600: keep it on this host)")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvstore import demo

    p = sub.add_parser("demo", help="start a daemon and play an agentic conversation through it")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstore", description="Distributed KV-cache service for LLM inference."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_status(sub)
    _add_indexer(sub)
    _add_router(sub)
    _add_keys(sub)
    _add_demo(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "status":
            return _cmd_status(args)
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
