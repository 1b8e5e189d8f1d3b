"""Requests that do not parse: INVALID_ARGUMENT, and the log says so once in a while.

Left to gRPC, a request whose bytes are not the method's protobuf message
fails inside the library's deserializer: the caller gets UNKNOWN and the
daemon logs a full ERROR traceback per call, so a fuzzing or broken client
floods the log. ``ParseGuardInterceptor`` swaps each method's deserializer
for one that turns a parse failure into a marker; the method then answers
INVALID_ARGUMENT naming the message type, and a ``RateLimitedLog`` writes
one WARNING per interval with the count of the others.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore import errors

log = logging.getLogger(__name__)

MAX_CACHED_METHODS = 256  # more than every method of every service the daemon registers


class RateLimitedLog:
    """One log line per ``interval_s`` at most; the lines held back are counted in the next."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._next_s = float("-inf")
        self.suppressed = 0

    def warning(self, message: str, *args: Any) -> bool:
        """Log now if the interval has passed (True), else count it (False)."""
        now = self._clock()
        if now < self._next_s:
            self.suppressed += 1
            return False
        held, self.suppressed = self.suppressed, 0
        suffix = f" ({held} more since the last such line)" if held else ""
        self._logger.warning(message + suffix, *args)
        self._next_s = now + self._interval_s
        return True


class _Unparsed:
    __slots__ = ("error", "nbytes")

    def __init__(self, error: Exception, nbytes: int) -> None:
        self.error = error
        self.nbytes = nbytes


class HandlerCache:
    """What a server interceptor hands gRPC for each method: ``wrap(handler,
    method)`` built once per method, not once per call (building it per call cost
    ~4% of a one-block Lookup). Only registered methods reach it, so it stays
    small; past MAX_CACHED_METHODS it wraps without remembering."""

    def __init__(self, wrap: Callable[[Any, str], Any]) -> None:
        self._wrap = wrap
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def get(self, handler: Any, method: str) -> Any:
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        if len(self._wrapped) < MAX_CACHED_METHODS:
            self._wrapped[method] = (handler, wrapped)
        return wrapped


class _Guard:
    """What both parse guards share: the guarded deserializer of one method, the
    refusal's message, and one wrapped handler per method."""

    def __init__(self, parse_log: RateLimitedLog | None) -> None:
        self.parse_log = parse_log or RateLimitedLog(log)
        self._handlers = HandlerCache(self._wrap_parsed)

    def wrapped(self, handler: Any, method: str) -> Any:
        return self._handlers.get(handler, method)

    def _wrap_parsed(self, handler: Any, method: str) -> Any:
        return handler if handler.request_deserializer is None else self._wrap(handler, method)

    def _refusal(self, request: _Unparsed, method: str, type_name: str) -> errors.InvalidRequest:
        self.parse_log.warning(
            "refused a request to %s that does not parse as %s (%d bytes): %s",
            method,
            type_name,
            request.nbytes,
            request.error,
        )
        return errors.InvalidRequest(
            f"request to {method} does not parse as {type_name} ({request.nbytes} bytes)"
        )

    @staticmethod
    def _parsers(handler: Any) -> tuple[Callable[[bytes], Any], str]:
        parse = handler.request_deserializer
        message_class = getattr(parse, "__self__", None)
        descriptor = getattr(message_class, "DESCRIPTOR", None)
        type_name = getattr(descriptor, "full_name", "the request message")

        def guarded_parse(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # any failure to parse is the caller's bytes
                return _Unparsed(exc, len(data))

        return guarded_parse, type_name

    def _wrap(self, handler: Any, method: str) -> Any:
        raise NotImplementedError


class _AsyncGuard(_Guard):
    def _wrap(self, handler: Any, method: str) -> Any:
        guarded_parse, type_name = self._parsers(handler)

        async def refuse(request: _Unparsed, context: grpc.aio.ServicerContext) -> None:
            await errors.abort(context, self._refusal(request, method, type_name))

        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Unparsed):
                    await refuse(request, context)
                return await behaviour(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=guarded_parse,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            # (A stream handler written with context.write, not yield, keeps gRPC's parsing.)
            stream_behaviour = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Unparsed):
                    await refuse(request, context)
                async for item in stream_behaviour(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=guarded_parse,
                response_serializer=handler.response_serializer,
            )
        return handler


class _SyncGuard(_Guard):
    def _wrap(self, handler: Any, method: str) -> Any:
        if handler.unary_unary is None:
            return handler
        guarded_parse, type_name = self._parsers(handler)
        behaviour = handler.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Unparsed):
                errors.abort_sync(context, self._refusal(request, method, type_name))
            return behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=guarded_parse,
            response_serializer=handler.response_serializer,
        )


class ParseGuardInterceptor(grpc.aio.ServerInterceptor):
    """Unparseable requests get INVALID_ARGUMENT instead of UNKNOWN plus a traceback."""

    def __init__(self, parse_log: RateLimitedLog | None = None) -> None:
        self._guard = _AsyncGuard(parse_log)
        self.parse_log = self._guard.parse_log

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._guard.wrapped(handler, handler_call_details.method)


class SyncParseGuardInterceptor(grpc.ServerInterceptor):
    """ParseGuardInterceptor for a thread-pool ``grpc.server`` (the indexer's)."""

    def __init__(self, parse_log: RateLimitedLog | None = None) -> None:
        self._guard = _SyncGuard(parse_log)
        self.parse_log = self._guard.parse_log

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._guard.wrapped(handler, handler_call_details.method)
