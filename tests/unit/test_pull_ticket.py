"""Pull tickets (kvstore.transfer.ticket): sealed by the cluster secret, opened only
whole and unaltered."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import errors
from kvstore.transfer.ticket import MAC_BYTES, PullTicket, open_ticket, seal, ticket_key

KEY = ticket_key("cluster-secret")


def ticket(n: int = 3, **changes: object) -> PullTicket:
    fields: dict[str, object] = {
        "node_id": "node-a",
        "incarnation": "abc123",
        "namespace_id": "ns-" + "0" * 32,
        "lease_id": 7,
        "expires_unix_s": 1.8e9,
        "block_bytes": 65536,
        "block_hashes": np.arange(1, n + 1, dtype="<u8").tobytes(),
        "offsets": (np.arange(n, dtype="<u8") * 65536).tobytes(),
        "checksums": np.arange(100, 100 + n, dtype="<u8").tobytes(),
    }
    fields.update(changes)
    return PullTicket(**fields)  # type: ignore[arg-type]


def test_a_sealed_ticket_opens_to_the_same_ticket() -> None:
    t = ticket()
    assert open_ticket(KEY, seal(KEY, t)) == t
    assert open_ticket(ticket_key(b"cluster-secret"), seal(KEY, t)).blocks == 3


def test_every_altered_byte_is_refused() -> None:
    blob = seal(KEY, ticket())
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        # The magic refused as no ticket; any other byte as a seal that fails.
        with pytest.raises((errors.PermissionDenied, errors.InvalidRequest)):
            open_ticket(KEY, bytes(bad))


def test_another_clusters_ticket_is_permission_denied() -> None:
    with pytest.raises(errors.PermissionDenied, match="not from this cluster"):
        open_ticket(KEY, seal(ticket_key("another-secret"), ticket()))


def test_bytes_that_are_no_ticket_are_invalid() -> None:
    blob = seal(KEY, ticket())
    for bad in (b"", b"KVT1", blob[: 4 + MAC_BYTES], b"XXXX" + blob[4:], b"\x00" * 100):
        with pytest.raises(errors.InvalidRequest, match="not a pull ticket"):
            open_ticket(KEY, bad)
    with pytest.raises(errors.PermissionDenied):  # cut short: the MAC no longer verifies
        open_ticket(KEY, blob[:-1])


@pytest.mark.parametrize(
    "changes",
    [
        {"offsets": b"\x00" * 16},  # 2 offsets for 3 blocks
        {"checksums": b"\x00" * 32},
        {"block_hashes": b"\x00" * 7},  # not whole uint64s
        {"block_hashes": b"", "offsets": b"", "checksums": b""},  # no blocks
        {"block_bytes": 0},
        {"lease_id": 0},
    ],
)
def test_a_sealed_but_malformed_ticket_is_invalid(changes: dict[str, object]) -> None:
    with pytest.raises(errors.InvalidRequest, match="malformed"):
        open_ticket(KEY, seal(KEY, ticket(**changes)))


def test_no_secret_no_tickets() -> None:
    for empty in ("", b""):
        with pytest.raises(errors.ConfigError, match=r"peer\.secret"):
            ticket_key(empty)
