"""Structured logging: key=value text or one JSON object per line, on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


class ClientGoneFilter(logging.Filter):
    """grpc.aio logs, with a traceback at ERROR, an answer it could not send
    because the caller already left (its deadline passed, it was cancelled):
    nothing went wrong in the daemon, so it becomes one INFO line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(
            "ExecuteBatchError raised in core"
        ):
            method = record.getMessage().rpartition(" ")[2]
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "an answer was not sent: the caller had left %s", (method,)
            record.exc_info = record.exc_text = None
        return True


GRPC_AIO_LOGGER = "grpc._cython.cygrpc"


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    grpc_aio = logging.getLogger(GRPC_AIO_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in grpc_aio.filters):
        grpc_aio.addFilter(ClientGoneFilter())
