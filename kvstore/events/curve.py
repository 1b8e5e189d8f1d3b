"""ZMQ CURVE for the KV event streams: keys, socket setup, and the ZAP allow-list.

The KV event streams carry every tenant's prompt token ids (``BlockStored``
has them) and block hashes, so where the network is not private they are
authenticated and encrypted with ZMQ's CURVE (docs/security.md, "KV event
streams"):

- the publisher (a daemon's PUB and replay ROUTER) is a CURVE *server*: it
  holds a secret key, and a ZAP handler (pyzmq's ``zmq.auth``) admits only the
  subscribers whose public keys are listed; every other handshake fails and is
  audited (``kvstore.audit``, reason ``events_curve_denied``);
- a subscriber (the indexer's SUB and replay DEALER, a router that subscribes)
  is a CURVE *client*: its own key pair plus the server's public key, so it
  cannot be fed by a publisher without that server's secret key.

Key files are pyzmq's certificate format (``zmq.auth.create_certificates``):
``NAME.key`` holds the public key, ``NAME.key_secret`` both. ``kvstore keys
curve --out DIR`` makes a pair (the secret file ``0600``). A secret key file
is read only when it is a regular file this process's user owns and neither
group nor others may read it (``ConfigError`` naming the path otherwise).

    secure_socket(sock, curve)              -> the one place a socket gets CURVE
    load_keypair(path, what)                -> KeyPair from a NAME.key_secret
    public_key(value, what)                 -> a Z85 key, or one read from a file
    ZapAllowList(ctx, allowed, ...)         -> the ZAP handler of a publisher's context
    write_keypair(dir, name)                -> (public file, secret file, public key)
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

from kvstore import audit
from kvstore.errors import ConfigError
from kvstore.files import read_small_file

log = logging.getLogger(__name__)

ZAP_DOMAIN = "kvstore-events"
_Z85_KEY_CHARS = 40  # a 32-byte CURVE key in Z85
_MAX_KEY_FILE_BYTES = 64 << 10  # a key file is a few hundred bytes; bounds a wrong path
_KEY_LINE = re.compile(rb'^\s*(public|secret)-key\s*=\s*"?([^"\s]+)"?\s*$')


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair, both Z85 (40 bytes)."""

    public: bytes
    secret: bytes


@dataclass(frozen=True, slots=True)
class CurveServer:
    """A bound socket's CURVE role: this key pair; who may connect is the ZAP handler's."""

    keys: KeyPair


@dataclass(frozen=True, slots=True)
class CurveClient:
    """A connecting socket's CURVE role: our key pair and the server's public key."""

    keys: KeyPair
    server_key: bytes


def require_curve(what: str) -> None:
    """Fail at start, clearly, when CURVE is configured but this libzmq lacks it."""
    if not zmq.has("curve"):
        raise ConfigError(
            f"{what}: CURVE is configured but this pyzmq/libzmq ({zmq.zmq_version()}) was "
            "built without it (zmq.has('curve') is False): install a libzmq with libsodium "
            "or CURVE support, or leave the CURVE settings empty on a private network"
        )


def secure_socket(sock: zmq.Socket, curve: CurveServer | CurveClient | None) -> None:
    """Give ``sock`` its CURVE role before it binds or connects (None: plaintext).

    The one helper every KV event socket goes through (publisher, subscriber,
    replay requests), so a new socket cannot forget half of it.
    """
    if curve is None:
        return
    require_curve("KV events")
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
    if isinstance(curve, CurveServer):
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        # ZAP requests of this socket name our domain: only our handler's list applies
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)


def z85_key(text: str | bytes, what: str) -> bytes:
    """A Z85 CURVE key (40 characters) as bytes; ConfigError naming ``what`` otherwise."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    raw = raw.strip()
    try:
        ok = len(raw) == _Z85_KEY_CHARS and len(z85.decode(raw)) == 32
    except (KeyError, ValueError):
        ok = False
    if not ok:
        shown = raw[:60].decode("ascii", "replace")
        raise ConfigError(f"{what}: {shown!r} is not a Z85 CURVE key (40 characters)")
    return raw


def is_z85_key(text: str) -> bool:
    try:
        z85_key(text, "")
    except ConfigError:
        return False
    return True


def _read_key_file(path: str, what: str, *, secret: bool) -> dict[str, bytes]:
    data = read_small_file(path, what, _MAX_KEY_FILE_BYTES, private=secret, owned=secret)
    keys: dict[str, bytes] = {}
    for line in data.splitlines():
        m = _KEY_LINE.match(line)
        if m:
            keys[m.group(1).decode()] = m.group(2)
    return keys


def load_keypair(path: str, what: str) -> KeyPair:
    """A secret key file (``NAME.key_secret``): checked private, both keys in it."""
    require_curve(what)
    keys = _read_key_file(path, what, secret=True)
    if "secret" not in keys:
        raise ConfigError(
            f"{what}: {path} holds no secret-key (a public .key file? name the .key_secret)"
        )
    secret = z85_key(keys["secret"], f"{what} ({path})")
    public = zmq.curve_public(secret)
    if "public" in keys and z85_key(keys["public"], f"{what} ({path})") != public:
        raise ConfigError(f"{what}: {path}: its public-key is not the secret key's")
    return KeyPair(public=public, secret=secret)


def public_key(value: str, what: str) -> bytes:
    """A public key given as Z85 text, or as the path of a key file that holds one."""
    if is_z85_key(value):
        return z85_key(value, what)
    if not (os.sep in value or Path(value).exists()):
        raise ConfigError(f"{what}: {value!r} is neither a Z85 CURVE key nor a key file")
    keys = _read_key_file(value, what, secret=False)
    if "public" not in keys:
        raise ConfigError(f"{what}: {value} holds no public-key")
    return z85_key(keys["public"], f"{what} ({value})")


def split_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class _AuditingAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's ZAP handler, remembering the peer address so a denial names it."""

    address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.address = msg[3].decode("ascii", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)


class _AllowList:
    def __init__(self, allowed: Iterable[bytes], auth: _AuditingAuthenticator, what: str) -> None:
        self._allowed = frozenset(allowed)
        self._auth = auth
        self._what = what
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if domain == ZAP_DOMAIN and key in self._allowed:
            return True
        self.denied += 1
        who = f"{self._auth.address or 'unknown address'} (CURVE key {key.decode('ascii', 'replace')})"
        audit.denied(who, self._what, audit.EVENTS_CURVE_DENIED, key=key.decode("ascii", "replace"))
        return False


class ZapAllowList:
    """The ZAP handler of one context: CURVE clients whose key is listed, nobody else.

    ZAP handlers are per context (one ``inproc://zeromq.zap.01`` each), so a
    publisher with CURVE owns its context: two publishers in one process keep
    their own lists.
    """

    def __init__(self, context: zmq.Context, allowed: Iterable[bytes], what: str) -> None:
        self._auth = _AuditingAuthenticator(context, log=logging.getLogger("kvstore.events.zap"))
        self._list = _AllowList(allowed, self._auth, what)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._list)

    @property
    def denied(self) -> int:
        return self._list.denied

    def stop(self) -> None:
        self._auth.stop()


# ZMQ monitor events that mean a peer's handshake failed (the cause is in the value)
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def handshake_failure(event: Mapping[str, Any], curve: bool = True) -> str:
    """Words for a handshake-failure monitor event (what an operator should check);
    ``curve``: whether our side of the connection uses CURVE."""
    kind, value = event["event"], event.get("value", 0)
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the publisher refused our CURVE key (not in its curve_allowed_keys)"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (
                "security mechanism mismatch: one side uses CURVE and the other does not "
                "(plaintext publisher with curve_server_key set, or the reverse)"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "CURVE cryptographic error (the wrong server public key?)"
        return f"ZMTP protocol error {value:#x}"
    if not curve:
        # a plaintext socket meeting a CURVE server sees this first, not the mismatch
        return (
            "security mechanism mismatch: the publisher uses CURVE and this source has "
            "no curve_server_key"
        )
    return "CURVE handshake failed without detail (the wrong server public key, or a peer without CURVE?)"


def write_keypair(directory: str, name: str) -> tuple[str, str, str]:
    """Write ``DIR/NAME.key`` (public, 0644) and ``DIR/NAME.key_secret`` (0600).

    Never overwrites (``O_EXCL``): a key in use is not replaced by accident.
    Returns both paths and the public key (Z85 text).
    """
    require_curve("kvstore keys curve")
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name must be a plain file name; got {name!r}")
    public, secret = zmq.curve_keypair()
    base = os.path.join(directory, name)
    out = []
    for suffix, mode, body in (
        (".key", 0o644, f'curve\n    public-key = "{public.decode()}"\n'),
        (
            ".key_secret",
            0o600,
            f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n',
        ),
    ):
        path = base + suffix
        banner = (
            "#   ZeroMQ CURVE "
            + ("Secret" if suffix.endswith("secret") else "Public")
            + " Certificate (kvstore keys curve)\n"
            + ("#   Keep it on this host only, mode 0600.\n" if suffix.endswith("secret") else "")
            + "metadata\n"
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        except FileExistsError:
            raise ConfigError(f"{path} exists already; not overwriting a key") from None
        except OSError as exc:
            raise ConfigError(f"cannot create {path}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)  # whatever the umask
            f.write(banner + body)
        out.append(path)
    return out[0], out[1], public.decode()
