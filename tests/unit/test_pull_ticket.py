"""Pull tickets (kvstore.transfer.ticket): sealed by the cluster secret, opened only
whole and unaltered."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest

from kvstore import errors
from kvstore.transfer.puller import ticket_start
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


def test_the_seal_is_hmac_sha256_under_the_key_derived_from_the_secret() -> None:
    # The wire format daemons of other versions seal and open: unchanged by how
    # the MAC is computed here (a keyed state copied per ticket).
    derived = hmac.new(b"cluster-secret", b"kvstore-pull-ticket-v1", hashlib.sha256).digest()
    for n in (1, 3):
        blob = seal(KEY, ticket(n))
        body, mac = blob[:-MAC_BYTES], blob[-MAC_BYTES:]
        assert mac == hmac.digest(derived, body, "sha256")
        assert open_ticket(KEY, blob) == ticket(n)  # the key's state is not used up


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


def test_a_pull_starts_at_the_block_of_the_ticket_it_names() -> None:
    t = ticket(4)  # block hashes 1, 2, 3, 4
    assert ticket_start(t, [1, 2, 3, 4]) == 0
    assert ticket_start(t, [3, 4]) == 2
    assert ticket_start(t, [4, 5, 6]) == 3  # past the ticket's end: the rest is pinned
    assert ticket_start(t, []) == 0
    with pytest.raises(errors.InvalidRequest, match="do not start at a block"):
        ticket_start(t, [9, 1])
    with pytest.raises(errors.InvalidRequest, match="leave the ticket's run"):
        ticket_start(t, [2, 4])


def test_a_hash_whose_bytes_straddle_two_of_the_tickets_is_no_block_of_it() -> None:
    # Little-endian: block 0's high half and block 1's low half spell the asked
    # hash's bytes at byte offset 4, which is no block boundary.
    low, high = 0x11111111_00000000, 0x00000000_22222222
    straddling = 0x22222222_11111111
    t = ticket(3, block_hashes=np.array([low, high, straddling], dtype="<u8").tobytes())
    assert ticket_start(t, [straddling]) == 2  # the real block, after the false match
    t = ticket(2, block_hashes=np.array([low, high], dtype="<u8").tobytes())
    with pytest.raises(errors.InvalidRequest, match="do not start at a block"):
        ticket_start(t, [straddling])
