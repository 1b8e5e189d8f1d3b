"""Keep this node's KV event streams registered with every kvstore indexer.

Runs beside the daemon (a sidecar in the DaemonSet pod), because daemons
come and go with nodes and the indexer's static source list cannot follow.
A registration lapses unless renewed within TTL_S, so a node that vanishes
leaves the index by itself; on SIGTERM it is withdrawn at once.

Env: NODE_ID (the daemon's node_id), POD_IP (the address peers reach the
daemon at), INDEXER_ADDRESS (host:port; every address the host resolves to
is registered with, so each replica behind a headless Service follows the
node), EVENTS_PORT, REPLAY_PORT, TTL_S; optional: GRPC_PORT (the daemon's
TCP gRPC port: the indexer then rebuilds this node from the daemon's
snapshots after lost events), KVSTORE_SECRET (the cluster secret, when the
indexer requires it).

The node name belongs to this sidecar: it picks an owner token at start and
presents it on every renewal and on the withdrawal, so nobody else can take
over or remove this node's registration (and a restarted indexer gives the
name back to the same token).
"""

import logging
import os
import secrets
import signal
import socket
import sys
import threading

import grpc

from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

log = logging.getLogger("kvstore.register")
CALL_TIMEOUT_S = 5.0


def _endpoint(scheme: str, host: str, port: int) -> str:
    return f"{scheme}[{host}]:{port}" if ":" in host else f"{scheme}{host}:{port}"


def _indexers(address: str) -> list[str]:
    host, _, port = address.rpartition(":")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return sorted({_endpoint("", str(info[4][0]), int(port)) for info in infos})


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        node = os.environ["NODE_ID"]
        host = os.environ["POD_IP"]
        indexer_address = os.environ["INDEXER_ADDRESS"]
        ttl_s = float(os.environ.get("TTL_S", "30"))
        source = indexer_pb2.EventSource(
            node=node,
            endpoint=_endpoint("tcp://", host, int(os.environ["EVENTS_PORT"])),
            replay_endpoint=_endpoint("tcp://", host, int(os.environ["REPLAY_PORT"])),
            kind="daemon",
            snapshot_address=(
                _endpoint("", host, int(os.environ["GRPC_PORT"]))
                if os.environ.get("GRPC_PORT")
                else ""
            ),
        )
    except (KeyError, ValueError) as exc:
        print(f"register: bad environment: {exc!r}", file=sys.stderr)
        return 2
    if ttl_s <= 0:
        print(f"register: TTL_S must be > 0, got {ttl_s}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    token = secrets.token_hex(16)
    secret = os.environ.get("KVSTORE_SECRET", "")
    metadata = (("x-kvstore-cluster-secret", secret),) if secret else None
    request = indexer_pb2.RegisterNodeRequest(source=source, ttl_s=ttl_s, owner_token=token)
    known: dict[str, bool] = {}  # indexer address -> registered at the last attempt
    while not stop.is_set():
        try:
            addresses = _indexers(indexer_address)
        except (OSError, ValueError) as exc:
            log.warning("cannot resolve %s: %s", indexer_address, exc)
            addresses = []
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                stub = indexer_pb2_grpc.IndexerServiceStub(channel)
                try:
                    stub.RegisterNode(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
                    ok = True
                except grpc.RpcError as exc:
                    ok = False
                    if known.get(address, True):
                        log.warning(
                            "register with %s failed: %s %s", address, exc.code(), exc.details()
                        )
            if ok and not known.get(address):
                log.info(
                    "registered %s %s with %s (ttl %.0f s)", node, source.endpoint, address, ttl_s
                )
            known[address] = ok
        # Renew well inside the TTL: two lost renewals in a row still keep it.
        stop.wait(ttl_s / 3)

    for address, ok in known.items():
        if not ok:
            continue
        with grpc.insecure_channel(address) as channel:
            stub = indexer_pb2_grpc.IndexerServiceStub(channel)
            try:
                stub.UnregisterNode(
                    indexer_pb2.UnregisterNodeRequest(
                        node=node, endpoint=source.endpoint, owner_token=token
                    ),
                    timeout=CALL_TIMEOUT_S,
                    metadata=metadata,
                )
                log.info("unregistered %s from %s", node, address)
            except grpc.RpcError as exc:
                log.warning("unregister from %s failed: %s %s", address, exc.code(), exc.details())
    return 0


if __name__ == "__main__":
    sys.exit(main())
