"""Who may call the daemon.

Local clients reach the daemon over its Unix socket, guarded by the socket
file's mode (0660): they are trusted. Anything over TCP may come from another
host, so once a cluster secret is configured (``peer.secret``), every call to
the store and fetch services over TCP must carry it in the
``x-kvstore-cluster-secret`` header, or it gets PERMISSION_DENIED: a stranger
on the network can neither read blocks (``GetInline``) nor make the daemon
pull from an address of its choosing (``FetchFromPeer``). Health and
reflection stay open (kubelet probes); ``PeerService`` checks the secret on
every call itself, whatever the transport.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kvstore import errors

SECRET_METADATA_KEY = "x-kvstore-cluster-secret"
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
    "kvstore.v1.PeerService",
)


def presented_secret(metadata: Iterable[tuple[str, Any]] | None) -> bytes:
    for key, value in metadata or ():
        if key == SECRET_METADATA_KEY:
            return value.encode() if isinstance(value, str) else bytes(value)
    return b""


def secret_matches(metadata: Iterable[tuple[str, Any]] | None, secret: bytes) -> bool:
    return hmac.compare_digest(presented_secret(metadata), secret)  # constant time


def is_network_peer(peer: str) -> bool:
    return peer.startswith(("ipv4:", "ipv6:"))


class TcpSecretInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str) -> None:
        assert secret, "an empty secret would let everyone in"
        self._secret = secret.encode()

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").rsplit("/", 1)[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        secret = self._secret

        async def check(context: grpc.aio.ServicerContext) -> None:
            if is_network_peer(context.peer()) and not secret_matches(
                context.invocation_metadata(), secret
            ):
                await errors.abort(
                    context,
                    errors.PermissionDenied(
                        f"calls over TCP need the cluster secret ({SECRET_METADATA_KEY})"
                    ),
                )

        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                return await behaviour(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream_behaviour = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                async for item in stream_behaviour(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
