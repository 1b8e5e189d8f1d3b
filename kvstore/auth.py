"""Who may call the daemon.

Local clients reach the daemon over its Unix socket, guarded by the socket
file's mode (0660): they are trusted. Anything over TCP may come from another
host or another local user, so no data call is ever served over TCP without
the cluster secret (``peer.secret``), carried in the
``x-kvstore-cluster-secret`` header: a stranger can neither read blocks
(``GetInline``) nor make the daemon pull from an address of its choosing
(``FetchFromPeer``). With a secret configured, every store and fetch call over
TCP must carry it; without one, TCP serves only ``Hello`` and ``Stats``
(tools, ``kvstore status``) and refuses the rest with PERMISSION_DENIED.
Health and reflection stay open (kubelet probes); ``PeerService`` checks the
secret on every call itself, whatever the transport. With mutual TLS
(``kvstore.tls``) the handshake already required a certificate of the cluster's
CA: such a caller may make data calls without a secret (with one configured, it
must present it as well). See docs/security.md.

With principals configured (``auth.principals``, ``kvstore.identity``) the
interceptor also names the caller of every call: the cluster (the secret), the
principal of its token (``x-kvstore-token``), or of its verified certificate's
CN/SAN; it sets ``identity.CURRENT`` for the handler, and ``kvstore.handling``
decides what that principal may touch. Over TCP a call without an identity is
refused here as before; a token no principal has is refused on either transport.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kvstore import audit, errors, identity
from kvstore.identity import CLUSTER, Authorizer, Caller
from kvstore.rpc_guard import HandlerCache

SECRET_METADATA_KEY = "x-kvstore-cluster-secret"
# Sent by kvstore.client.Client (random per instance): whose leases a call counts against.
CLIENT_ID_METADATA_KEY = "x-kvstore-client-id"
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
    "kvstore.v1.PeerService",
)
# Without a cluster secret, the only calls TCP serves: they read no block and
# change nothing.
OPEN_WITHOUT_SECRET = frozenset(
    {"/kvstore.v1.StoreService/Hello", "/kvstore.v1.StoreService/Stats"}
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
    """TCP calls need the secret; with none configured ("") TCP gets Hello and Stats only."""

    def __init__(self, secret: str, *, tls: bool = False, auth: Authorizer | None = None) -> None:
        self._secret = secret.encode()
        self._tls = tls  # TCP callers passed a mutual-TLS handshake (kvstore.tls)
        self._auth = auth  # principals configured: name every caller (kvstore.identity)
        self._handlers = HandlerCache(self._wrap)

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._handlers.get(handler, handler_call_details.method)

    def _wrap(self, handler: Any, method: str) -> Any:
        service = method.lstrip("/").rsplit("/", 1)[0]
        if service in OPEN_SERVICES:
            return handler
        secret = self._secret
        tls = self._tls
        auth = self._auth
        if auth is not None:
            return _with_caller(handler, self._identify_for(method, auth))
        if not secret and method in OPEN_WITHOUT_SECRET:
            return handler

        async def check(context: grpc.aio.ServicerContext) -> None:
            if not is_network_peer(context.peer()):
                return
            if not secret and tls and context.peer_identities():
                return  # a certificate the CA signed: authenticated
            if not secret:
                peer = context.peer()
                audit.denied(peer, method, audit.TCP_NO_SECRET, audit.tcp_caller(peer))
                await errors.abort(
                    context,
                    errors.PermissionDenied(
                        "data calls over TCP need the cluster secret, and this daemon has none: "
                        "use the Unix socket, or set peer.secret (clients: KVSTORE_SECRET)"
                    ),
                )
            elif not secret_matches(context.invocation_metadata(), secret):
                peer = context.peer()
                audit.denied(peer, method, audit.TCP_WRONG_SECRET, audit.tcp_caller(peer))
                await errors.abort(
                    context,
                    errors.PermissionDenied(
                        f"calls over TCP need the cluster secret ({SECRET_METADATA_KEY})"
                    ),
                )

        return _checked(handler, check)

    def _identify_for(
        self, method: str, auth: Authorizer
    ) -> Callable[[grpc.aio.ServicerContext], Any]:
        """The check of one method when principals are configured: the caller's
        identity (a Caller), or an abort (PERMISSION_DENIED, audited)."""
        secret = self._secret
        tcp_open = not secret and method in OPEN_WITHOUT_SECRET

        async def identify(context: grpc.aio.ServicerContext) -> Caller:
            peer = context.peer()
            network = is_network_peer(peer)
            key = audit.tcp_caller(peer) if network else "unix"
            metadata = context.invocation_metadata()
            token = identity.presented_token(metadata)
            principal = None
            if token:
                principal = auth.from_token(token)
                if principal is None:
                    audit.denied(peer, method, audit.NO_IDENTITY, key)
                    await errors.abort(
                        context,
                        errors.PermissionDenied(
                            f"the token ({identity.TOKEN_METADATA_KEY}) is no principal's"
                        ),
                    )
            elif secret and secret_matches(metadata, secret):
                principal = CLUSTER
            elif network and self._tls:
                principal = auth.from_cert_names(identity.cert_names(context))
            if principal is None and network and not tcp_open:
                audit.denied(peer, method, audit.NO_IDENTITY, key)
                await errors.abort(
                    context,
                    errors.PermissionDenied(
                        "calls over TCP need an identity here: a token "
                        f"({identity.TOKEN_METADATA_KEY}, KVSTORE_TOKEN), a client certificate "
                        "mapped in auth.principals, or the cluster secret"
                    ),
                )
            # rate-limited per principal and host (kvstore.audit), not per port
            return Caller(principal, f"{principal.name} ({key})" if principal else key)

        return identify


def _with_caller(handler: Any, identify: Callable[[grpc.aio.ServicerContext], Any]) -> Any:
    async def check(context: grpc.aio.ServicerContext) -> None:
        identity.CURRENT.set(await identify(context))

    return _checked(handler, check)


def _checked(handler: Any, check: Callable[[grpc.aio.ServicerContext], Any]) -> Any:
    """``handler`` with ``check(context)`` awaited before it (in the same task, so a
    context variable ``check`` sets is the handler's)."""
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
