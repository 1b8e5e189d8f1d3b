"""Mutual TLS for gRPC over TCP, with grpc's own TLS (docs/security.md, "TLS").

One identity per process: a certificate chain and its key (``tls.cert_path``,
``tls.key_path``) and the CA bundle every other party must be signed by
(``tls.ca_path``). A daemon presents its certificate to callers of its TCP
listener and, as a client certificate, to the peers it pulls from; it asks
every TCP caller for a certificate signed by the CA, so a caller without one,
or with one of another CA, fails the handshake and never reaches a handler.

The files are read and checked when the credentials are made (a missing file,
a key that does not match its certificate, a CA bundle without a certificate:
``ConfigError`` naming the path). The server side re-reads them when one of
them changes (size, mtime or inode; checked as each new connection comes in),
so renewed certificates take effect without a restart; a renewal that does not
load is logged and the previous certificates stay in use. Connections already
open keep the certificate they were made with.

Clients (``kvstore.client.Client``, the router, ``kvstore_router_client``, tools) take the
same three paths from ``KVSTORE_TLS_CERT``, ``KVSTORE_TLS_KEY`` and ``KVSTORE_TLS_CA``.

The client side reloads too (``ClientCredentials``): gRPC's channel credentials
are fixed when a channel is made, so each holder of an outgoing channel (the
client, peer pulls, the router, ``kvstore_router_client``, the indexer's Snapshot
calls) asks ``ClientCredentials.current()`` when it uses one; after the files
changed (checked at most every ``RELOAD_CHECK_S``) and load, that returns new
credentials and a new generation, and the holder opens a new channel with
them, so new connections present the renewed certificate. The old channel is
left to finish its calls. A renewal that does not load is logged and the
previous credentials stay in use.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.tls")

ENV_CERT = "KVSTORE_TLS_CERT"
ENV_KEY = "KVSTORE_TLS_KEY"
ENV_CA = "KVSTORE_TLS_CA"
# Bounds what a misconfigured path (a device, a huge file) can make us read.
MAX_PEM_BYTES = 1 << 20
# How often a client looks at its certificate files (three stats) for a renewal.
RELOAD_CHECK_S = 1.0


@dataclass(frozen=True)
class TlsFiles:
    """The three PEM files of one identity; all "" = TLS off."""

    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""
    # How errors name the fields: "tls" -> "tls.cert_path"; a prefix ending in "_"
    # ("indexer.tls_") -> "indexer.tls_cert_path".
    section: str = "tls"

    @property
    def enabled(self) -> bool:
        return bool(self.cert_path or self.key_path or self.ca_path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsFiles:
        env = os.environ if env is None else env
        return cls(
            env.get(ENV_CERT, ""), env.get(ENV_KEY, ""), env.get(ENV_CA, ""), section="KVSTORE_TLS"
        )

    def _name(self, field: str) -> str:
        if self.section == "KVSTORE_TLS":
            return {"cert_path": ENV_CERT, "key_path": ENV_KEY, "ca_path": ENV_CA}[field]
        if self.section.endswith("_"):
            return f"{self.section}{field}"
        return f"{self.section}.{field}"

    def problems(self) -> list[str]:
        """What is missing for mutual TLS (all three paths or none)."""
        if not self.enabled:
            return []
        return [
            f"{self._name(f)} is needed with the other TLS paths (mutual TLS needs all three)"
            for f in ("cert_path", "key_path", "ca_path")
            if not getattr(self, f)
        ]

    def load(self) -> PemSet:
        """Read and check the three files; ConfigError naming the path otherwise."""
        missing = self.problems()
        if missing:
            raise ConfigError("; ".join(missing))
        cert = _read(self._name("cert_path"), self.cert_path)
        key = _read(self._name("key_path"), self.key_path)
        ca = _read(self._name("ca_path"), self.ca_path)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                f"{self._name('ca_path')}: {self.ca_path} holds no usable CA certificate "
                f"({_reason(exc)})"
            ) from None
        try:
            ctx.load_cert_chain(self.cert_path, self.key_path)
        except ssl.SSLError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc):
                raise ConfigError(
                    f"{self._name('key_path')}: {self.key_path} is not the key of "
                    f"{self._name('cert_path')}: {self.cert_path}"
                ) from None
            raise ConfigError(
                f"{self._name('cert_path')}: {self.cert_path} / {self._name('key_path')}: "
                f"{self.key_path}: not a PEM certificate chain and its key ({_reason(exc)})"
            ) from None
        return PemSet(cert=cert, key=key, ca=ca, stamp=self.stamp())

    def stamp(self) -> tuple[tuple[int, int, int], ...]:
        """(inode, size, mtime) of each file: what a change is detected by."""
        out = []
        for path in (self.cert_path, self.key_path, self.ca_path):
            try:
                st = os.stat(path)
            except OSError:
                out.append((-1, -1, -1))
            else:
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against the CA, present our certificate."""
        pem = self.load()
        return grpc.ssl_channel_credentials(
            root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert
        )

    def client_credentials(self) -> ClientCredentials:
        """Client side, following renewals of the files (see ``ClientCredentials``)."""
        return ClientCredentials(self)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: a client certificate signed by the CA is required; files reloaded
        when they change."""
        return _Reloader(self).credentials()


def env_channel_credentials() -> grpc.ChannelCredentials | None:
    """A tool's or router's client identity from KVSTORE_TLS_*; None when unset."""
    tls = TlsFiles.from_env()
    return tls.channel_credentials() if tls.enabled else None


def env_client_credentials() -> ClientCredentials | None:
    """As ``env_channel_credentials``, following renewals of the files."""
    tls = TlsFiles.from_env()
    return tls.client_credentials() if tls.enabled else None


class ClientCredentials:
    """A client's mutual-TLS credentials that follow its certificate files.

    ``current()`` returns the credentials and their generation; a holder whose
    channel was made with an older generation opens a new one (see the module
    doc). Loaded (and checked) at construction: a bad file stops the start,
    naming it. Thread-safe.
    """

    def __init__(
        self,
        files: TlsFiles,
        *,
        check_interval_s: float = RELOAD_CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files = files
        self._check_interval_s = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        pem = files.load()
        self._stamp = pem.stamp
        self._failed_stamp: tuple[tuple[int, int, int], ...] | None = None
        self._credentials = _channel_credentials(pem)
        self.generation = 0
        self._checked_at = clock()

    def current(self) -> tuple[grpc.ChannelCredentials, int]:
        now = self._clock()
        with self._lock:
            if now - self._checked_at >= self._check_interval_s:
                self._checked_at = now
                self._reload()
            return self._credentials, self.generation

    def _reload(self) -> None:
        stamp = self.files.stamp()
        if stamp == self._stamp or stamp == self._failed_stamp:
            return
        try:
            pem = self.files.load()
        except ConfigError as exc:
            self._failed_stamp = stamp  # mid-rotation: keep the old ones, say so once
            log.warning("client TLS files changed but do not load; keeping the old ones: %s", exc)
            return
        self._stamp, self._failed_stamp = pem.stamp, None
        self._credentials = _channel_credentials(pem)
        self.generation += 1
        log.info(
            "client TLS certificates reloaded", extra={"fields": {"cert": self.files.cert_path}}
        )


def _channel_credentials(pem: PemSet) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert
    )


@dataclass(frozen=True)
class PemSet:
    cert: bytes
    key: bytes
    ca: bytes
    stamp: tuple[tuple[int, int, int], ...]

    def server_config(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], self.ca)


class _Reloader:
    """The fetcher grpc calls before each handshake: a new configuration when the
    files changed and load, else None (keep the current one)."""

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._current = files.load()
        self._failed_stamp: tuple[tuple[int, int, int], ...] | None = None
        self._lock = threading.Lock()  # grpc may call from several threads

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._current.server_config(), self._fetch, require_client_authentication=True
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            stamp = self._files.stamp()
            if stamp == self._current.stamp or stamp == self._failed_stamp:
                return None
            try:
                fresh = self._files.load()
            except ConfigError as exc:
                # Mid-rotation (cert written, key not yet) or a bad renewal: keep serving.
                self._failed_stamp = stamp
                log.warning("TLS files changed but do not load; keeping the old ones: %s", exc)
                return None
            self._current = fresh
            self._failed_stamp = None
            log.info("TLS certificates reloaded", extra={"fields": {"cert": self._files.cert_path}})
            return fresh.server_config()


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(f"{name}: {path} is larger than {MAX_PEM_BYTES} bytes: not a PEM file")
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{name}: {path} is not PEM (no -----BEGIN line)")
    return data


def _reason(exc: Exception) -> str:
    return getattr(exc, "reason", None) or str(exc)
