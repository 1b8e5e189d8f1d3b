"""Pull tickets: a pin the owner took before the puller asked for it.

A pull's first byte normally waits for the owner's pin: B asks A, A pins and
answers with offsets and checksums, then B reads. In the prefill/decode split
the owner is known before the decode side asks: the prefill engine's client
has just stored the prompt's blocks in its daemon (A). So A can pin them
then, for the decode node to read (``HandOver``), and hand the pin over
with the request, as vLLM's NIXL connector hands its block ids: the decode
node's daemon (B) reads at once, with no round trip to A before the first
byte (docs/peer-transfer.md, "Handed-over pins").

A ticket is that pin's ``PinForPullResponse`` bound to its owner, its
incarnation, its namespace and the hashes it covers, sealed with an
HMAC-SHA256 under a key derived from the cluster secret. It travels through
untrusted hands (the engines, the router, the HTTP request), so:

- only a daemon with the cluster secret can mint one, and B verifies the seal
  before it reads anything: a forged or altered ticket is
  ``PermissionDenied`` (it would otherwise point B's READ at any offset of
  A's region, another tenant's bytes included);
- it names the namespace id (the spec's fingerprint, tenant included), and B
  serves it only to a caller of that namespace: a ticket never moves one
  tenant's blocks into another's;
- it carries A's checksums, and B verifies every block it reads against them
  as in any pull. The pin is A's lease: after B releases it, or past its
  expiry, a replayed ticket reads slots A may have reused, and those blocks
  fail their checksum and are dropped, never served. Clocks do not decide
  correctness: the expiry only spares B a read that would be dropped.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvstore import errors

MAGIC = b"KVT1"
MAC_BYTES = 32
# The seal's key is derived from the cluster secret for this use alone: a
# ticket's MAC never equals any other MAC made with the secret (the pin
# channel's handshake proofs).
_KEY_LABEL = b"kvstore-pull-ticket-v1"


class PullTicket(msgspec.Struct, array_like=True, frozen=True):
    """A handed-over pin; the byte strings are packed little-endian uint64, one per block."""

    node_id: str
    incarnation: str
    namespace_id: str
    lease_id: int
    expires_unix_s: float
    """A's wall clock at the pin's expiry (advice for B: see the module notes)."""
    block_bytes: int
    block_hashes: bytes
    offsets: bytes
    checksums: bytes

    @property
    def blocks(self) -> int:
        return len(self.block_hashes) // 8


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PullTicket)


class TicketKey:
    """The key tickets are sealed with (``ticket_key``), as a keyed HMAC-SHA256
    state made once: each MAC copies it. ``hmac.digest`` looks the digest up by
    name and keys it on every call, which cost ~19 us of a handed-over pull's
    ~0.4 ms in a daemon that had been idle; the copy ~10 us (same MAC)."""

    __slots__ = ("_state",)

    def __init__(self, key: bytes) -> None:
        self._state = hmac.new(key, digestmod=hashlib.sha256)

    def mac(self, body: bytes) -> bytes:
        h = self._state.copy()
        h.update(body)
        return h.digest()


def ticket_key(secret: str | bytes) -> TicketKey:
    """The key tickets are sealed with, derived from the cluster secret (once per
    daemon: it is on the first byte's path)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    if not raw:
        raise errors.ConfigError("pull tickets need the cluster secret (peer.secret)")
    return TicketKey(hmac.new(raw, _KEY_LABEL, hashlib.sha256).digest())


def seal(key: TicketKey, ticket: PullTicket) -> bytes:
    """The ticket's wire form: magic, msgpack body, MAC over both (``key``: ticket_key)."""
    body = MAGIC + _encoder.encode(ticket)
    return body + key.mac(body)


def open_ticket(key: TicketKey, blob: bytes) -> PullTicket:
    """The ticket ``blob`` carries, once its seal is proved with ``key`` (ticket_key);
    PermissionDenied for a seal this cluster's secret did not make (forged,
    altered, another cluster's), InvalidRequest for bytes that are no ticket."""
    if len(blob) <= len(MAGIC) + MAC_BYTES or not blob.startswith(MAGIC):
        raise errors.InvalidRequest("ticket is not a pull ticket (HandOver's answer)")
    body, mac = blob[:-MAC_BYTES], blob[-MAC_BYTES:]
    if not hmac.compare_digest(mac, key.mac(body)):
        raise errors.PermissionDenied("pull ticket's seal does not verify: not from this cluster")
    try:
        ticket = _decoder.decode(body[len(MAGIC) :])
    except msgspec.DecodeError as exc:  # sealed by us, so only a version skew gets here
        raise errors.InvalidRequest(f"pull ticket unreadable: {exc}") from None
    n = ticket.blocks
    if (
        n == 0
        or len(ticket.block_hashes) != 8 * n
        or len(ticket.offsets) != 8 * n
        or len(ticket.checksums) != 8 * n
        or ticket.block_bytes <= 0
        or ticket.lease_id <= 0
    ):
        raise errors.InvalidRequest("pull ticket is malformed")
    return ticket
