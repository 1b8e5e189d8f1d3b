"""Who a caller is, and which tenants it may use (docs/security.md, "Identities").

Principals are configured by name (``[auth.principals.<name>]`` for the daemon,
``[indexer.principals.<name>]`` for the indexer). Each has credentials, any of:

- a bearer token: only its SHA-256 is configured (``token_sha256``); the token
  travels in gRPC metadata (``x-kvstore-token``) and in the lean channel's
  ``hello``. It is hashed and compared in constant time with every configured
  digest (no early exit).
- certificate names (``cert_names``): a subject CN or SAN of a client
  certificate the TLS handshake already verified against the CA.
- local uids / gids (``uids``, ``gids``): the peer credentials (SO_PEERCRED) of a
  lean-channel connection. gRPC over a Unix socket exposes no peer credentials
  (its auth context says only "insecure"/"local"), so gRPC on the socket needs
  a token once principals are configured.

and rights: the tenants (``cache_salt``s, the namespace's ``tenant``; ``"*"`` =
all) and optionally the models and namespace ids it may use, and roles:
``admin`` (Clear, Snapshot; everything on the indexer), ``node`` (a daemon or
the indexer itself: Snapshot, RegisterNode/UnregisterNode), ``router`` (the
indexer's Score, ListNodes, Models). Holders of the cluster secret are the
cluster (``CLUSTER``): every tenant, every role, as before.

No principal configured: no ``Authorizer`` (``None``), every check is skipped:
the behaviour before identities existed.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvstore.errors import ConfigError
from kvstore.files import read_small_file

TOKEN_METADATA_KEY = "x-kvstore-token"
ENV_TOKEN = "KVSTORE_TOKEN"
ENV_TOKEN_FILE = "KVSTORE_TOKEN_FILE"
ALL = "*"
ROLES = ("admin", "node", "router")
MAX_TOKEN_BYTES = 4096  # a token longer than this is refused before it is hashed

Role = Literal["admin", "node", "router"]


class PrincipalConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One principal's credentials and rights (the key of its table is its name)."""

    token_sha256: str = ""
    tenants: list[str] = []
    models: list[str] = []
    namespaces: list[str] = []
    cert_names: list[str] = []
    uids: list[int] = []
    gids: list[int] = []
    roles: list[Role] = []


# Fields given as one comma-separated string by KVSTORE_* variables and --set flags.
LIST_FIELDS = ("tenants", "models", "namespaces", "cert_names", "uids", "gids", "roles")


def split_list_fields(principals: Any) -> Any:
    """``{"a": {"tenants": "x,y"}}`` -> ``{"a": {"tenants": ["x", "y"]}}`` (env, flags)."""
    if not isinstance(principals, dict):
        return principals
    out: dict[str, Any] = {}
    for name, fields in principals.items():
        if isinstance(fields, dict):
            fields = {
                k: [p.strip() for p in v.split(",") if p.strip()]
                if k in LIST_FIELDS and isinstance(v, str)
                else v
                for k, v in fields.items()
            }
        out[name] = fields
    return out


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    tenants: frozenset[str] | None  # None: every tenant
    models: frozenset[str] | None  # None: every model
    namespaces: frozenset[str] | None  # None: every namespace id
    roles: frozenset[str]

    def may_use(self, namespace_id: str, tenant: str, model: str) -> bool:
        return (
            (self.tenants is None or tenant in self.tenants)
            and (self.models is None or model in self.models)
            and (self.namespaces is None or namespace_id in self.namespaces)
        )

    def has_role(self, *roles: str) -> bool:
        return "admin" in self.roles or any(r in self.roles for r in roles)


@dataclass(frozen=True, slots=True)
class Caller:
    """One call's (or lean connection's) identity: its principal (None: none) and how
    the audit log names it (``label``; ``key``: the rate-limit key, port-free)."""

    principal: Principal | None
    label: str
    key: str | None = None


# The gRPC caller of the running call, set by kvstore.auth's interceptor (the
# handler runs in the interceptor's task) when principals are configured.
CURRENT: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "kvstore_caller", default=None
)


# The holders of the cluster secret (peers, the indexer with the secret): as before.
CLUSTER = Principal("cluster", None, None, None, frozenset(ROLES))


def _set(values: list[str]) -> frozenset[str] | None:
    return None if not values or ALL in values else frozenset(values)


class Authorizer:
    """Credentials -> Principal, for one process's configured principals."""

    def __init__(self, principals: Mapping[str, PrincipalConfig], section: str) -> None:
        self._tokens: list[tuple[bytes, Principal]] = []
        self._certs: dict[str, Principal] = {}
        self._uids: dict[int, Principal] = {}
        self._gids: dict[int, Principal] = {}
        self.names: list[str] = sorted(principals)
        problems: list[str] = []
        for name in self.names:
            pc = principals[name]
            where = f"{section}.{name}"
            if name == CLUSTER.name:
                problems.append(f"{where}: the name {name!r} is reserved (the cluster secret)")
            if not (pc.token_sha256 or pc.cert_names or pc.uids or pc.gids):
                problems.append(f"{where}: no credential (token_sha256, cert_names, uids, gids)")
            if not pc.tenants and not pc.roles:
                problems.append(f"{where}: neither tenants nor roles: it could do nothing")
            p = Principal(
                name,
                # no tenants listed: none (a router or admin-only identity); "*": all
                frozenset() if not pc.tenants else _set(pc.tenants),
                _set(pc.models),
                _set(pc.namespaces),
                frozenset(pc.roles),
            )
            if pc.token_sha256:
                try:
                    digest = bytes.fromhex(pc.token_sha256)
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    problems.append(f"{where}.token_sha256: not 64 hex digits (a SHA-256)")
                elif any(hmac.compare_digest(digest, d) for d, _ in self._tokens):
                    problems.append(f"{where}.token_sha256: another principal has this token")
                else:
                    self._tokens.append((digest, p))
            tables: list[tuple[dict[Any, Principal], list[Any], str]] = [
                (self._certs, pc.cert_names, "cert_names"),
                (self._uids, pc.uids, "uids"),
                (self._gids, pc.gids, "gids"),
            ]
            for table, keys, what in tables:
                for key in keys:
                    other = table.get(key)
                    if other is not None and other.name != name:
                        problems.append(f"{where}.{what}: {key!r} is also {other.name}'s")
                    table[key] = p
        if problems:
            raise ConfigError("invalid config: " + "; ".join(problems))

    @classmethod
    def from_config(
        cls, principals: Mapping[str, PrincipalConfig], section: str
    ) -> Authorizer | None:
        return cls(principals, section) if principals else None

    def from_token(self, token: str | bytes) -> Principal | None:
        raw = token.encode() if isinstance(token, str) else bytes(token)
        if not raw or len(raw) > MAX_TOKEN_BYTES:
            return None
        digest = hashlib.sha256(raw).digest()
        found = None
        for configured, p in self._tokens:  # every digest compared: no early exit
            if hmac.compare_digest(digest, configured):
                found = p
        return found

    def from_cert_names(self, names: Iterable[bytes | str]) -> Principal | None:
        for n in names:
            p = self._certs.get(n.decode(errors="replace") if isinstance(n, bytes) else n)
            if p is not None:
                return p
        return None

    def from_peer(self, uid: int | None, gid: int | None) -> Principal | None:
        if uid is not None and uid in self._uids:
            return self._uids[uid]
        if gid is not None and gid in self._gids:
            return self._gids[gid]
        return None


def presented_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return value if isinstance(value, str) else bytes(value).decode(errors="replace")
    return ""


def cert_names(context: Any) -> list[bytes]:
    """The verified client certificate's CN and SANs (empty without TLS)."""
    auth = context.auth_context() or {}
    return [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]


def hash_token(token: str) -> str:
    """What ``token_sha256`` holds for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def read_token_file(path: str) -> str:
    """A token file's first line; refused when others may read or write it."""
    data = read_small_file(path, "token file", MAX_TOKEN_BYTES, private=True)
    token = data.decode(errors="replace").strip().split("\n", 1)[0].strip()
    if not token or len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(f"token file {path}: empty, or longer than {MAX_TOKEN_BYTES} bytes")
    return token


def client_token(
    token: str | None = None, token_file: str = "", env: Mapping[str, str] | None = None
) -> str:
    """A client's token: the one given, else ``token_file``, else $KVSTORE_TOKEN, else
    the file $KVSTORE_TOKEN_FILE names; "" = none."""
    if token:
        return token
    if token_file:
        return read_token_file(token_file)
    env = os.environ if env is None else env
    if env.get(ENV_TOKEN):
        return env[ENV_TOKEN]
    if env.get(ENV_TOKEN_FILE):
        return read_token_file(env[ENV_TOKEN_FILE])
    return ""


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, token),) if token else ()
