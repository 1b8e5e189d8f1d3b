"""Tenant regions on a real daemon (dram.tenant_regions, docs/tenants.md): each capped
tenant's DRAM blocks live in its own 0600 file, handed to a client over the lean
socket (SCM_RIGHTS); a client maps only the files of the tenants it declared, so
another tenant's bytes are never in its memory. Round trips through Client (lean
channel and gRPC), and a warm restart that puts every file back."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstore.client import Client
from tests.conftest import make_spec

BLOCK = 64 << 10
MiB = 1 << 20
SALT_A = "a-secret-salt-3b9d"  # "alpha": its own region file
SALT_B = "b-secret-salt-c471"  # "beta": its own region file
SALT_C = "c-secret-salt-77aa"  # not configured: the shared region file
SETTINGS = {
    "dram.tenant_regions": True,
    "quotas.tenants.alpha.tenant": SALT_A,
    "quotas.tenants.alpha.dram_bytes": "1MiB",
    "quotas.tenants.beta.tenant": SALT_B,
    "quotas.tenants.beta.dram_bytes": "1MiB",
}
# The layout: the shared range (2 MiB) at 0, then alpha, then beta, by name.
RANGES = {SALT_C: (0, 2 * MiB), SALT_A: (2 * MiB, 3 * MiB), SALT_B: (3 * MiB, 4 * MiB)}


def blocks_for(hashes, salt: int):
    return np.stack(
        [
            np.random.default_rng([int(h), salt]).integers(0, 256, BLOCK, dtype=np.uint8)
            for h in hashes
        ]
    )


def start(daemon_factory):
    return daemon_factory(dram_bytes=4 * MiB, chunk_bytes=1 * MiB, settings=SETTINGS)


def region_files(d):
    base = str(d.settings["dram.path"])
    return {SALT_C: base, SALT_A: base + ".tenant-alpha", SALT_B: base + ".tenant-beta"}


def test_each_tenant_round_trips_and_reads_nothing_of_the_others(daemon_factory):
    d = start(daemon_factory)
    files = region_files(d)
    for path in files.values():
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    hashes = list(range(1, 9))
    data = {salt: blocks_for(hashes, i) for i, salt in enumerate((SALT_A, SALT_B, SALT_C))}
    clients = {salt: Client(d.address) for salt in data}
    try:
        spaces = {}
        for salt, c in clients.items():
            assert c.local is not None  # the lean channel carries the calls
            ns = c.declare_namespace(make_spec(BLOCK, tenant=salt))
            assert c.put(ns, hashes, data[salt]).stored == 8
            spaces[salt] = ns
        for salt, c in clients.items():
            got = c.get(spaces[salt], hashes)
            assert got.found == 8 and np.array_equal(got.data, data[salt])
            # Straight through the mapping: the blocks are at offsets of its range.
            handle = c.prepare_load(spaces[salt], hashes)
            try:
                lo, hi = RANGES[salt]
                assert all(lo <= off < hi for off in handle.offsets)
                assert np.array_equal(c.view(int(handle.offsets[0]), BLOCK), data[salt][0])
            finally:
                c.release(handle.lease_id)
        # What a client maps of the other tenants' ranges is its own empty memory.
        for salt, c in clients.items():
            for other, (lo, hi) in RANGES.items():
                if other in (salt, SALT_C):
                    continue
                assert not c.view(lo, hi - lo).any(), (salt, other)
        # Each file holds its tenant's bytes and none of another's.
        for salt, path in files.items():
            with open(path, "rb") as f:
                content = f.read()
            for other, blocks in data.items():
                present = blocks[0].tobytes() in content
                assert present == (other == salt), (salt, other)
    finally:
        for c in clients.values():
            c.close()


def test_a_grpc_only_client_still_maps_its_tenants_file(daemon_factory):
    d = start(daemon_factory)
    hashes = list(range(100, 104))
    blocks = blocks_for(hashes, 9)
    with Client(d.address, local_channel=False) as c:
        assert c.local is None
        ns = c.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        assert c.put(ns, hashes, blocks).stored == 4
        handle = c.prepare_load(ns, hashes)
        try:
            assert all(2 * MiB <= off < 3 * MiB for off in handle.offsets)
            assert np.array_equal(c.view(int(handle.offsets[0]), BLOCK), blocks[0])
        finally:
            c.release(handle.lease_id)
        got = c.get(ns, hashes)
        assert got.found == 4 and np.array_equal(got.data, blocks)


def test_a_warm_restart_serves_every_tenants_blocks_from_its_file(daemon_factory):
    d = start(daemon_factory)
    hashes = list(range(1, 5))
    data = {SALT_A: blocks_for(hashes, 1), SALT_C: blocks_for(hashes, 3)}
    with Client(d.address) as c:
        for salt, blocks in data.items():
            assert (
                c.put(c.declare_namespace(make_spec(BLOCK, tenant=salt)), hashes, blocks).stored
                == 4
            )
    assert d.stop(keep_region=True) == 0
    d.start()
    with Client(d.address) as c:
        for salt, blocks in data.items():
            got = c.get(c.declare_namespace(make_spec(BLOCK, tenant=salt)), hashes)
            assert got.found == 4 and np.array_equal(got.data, blocks), salt


def test_map_tenant_on_the_wire(daemon_factory):
    """The raw lean-socket exchange: the descriptor only on a map_tenant alone in its
    frame, only for a tenant with its own region, sized to that region."""
    import fcntl
    import mmap
    import socket

    from kvstore import local_wire as w
    from kvstore.errors import InvalidRequest, NamespaceNotFound
    from kvstore.local_client import LocalChannel
    from kvstore.local_server import local_socket_path

    d = start(daemon_factory)
    path = local_socket_path(d.socket_path)
    hashes = list(range(1, 3))
    blocks = blocks_for(hashes, 5)
    with Client(d.address) as c:
        a = c.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        shared = c.declare_namespace(make_spec(BLOCK, tenant=SALT_C))
        assert c.put(a, hashes, blocks).stored == 2
    ch = LocalChannel.open(path, "wire-test", 5.0)
    try:
        answer, fd = ch.map_tenant(a.namespace_id)
        assert fd is not None and (answer.offset, answer.nbytes) == (2 * MiB, MiB)
        try:
            assert os.fstat(fd).st_size == MiB
            # A new open of the file, not the daemon's locked one: a client keeping it
            # (or its mapping) cannot hold or drop the daemon's lock.
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with mmap.mmap(fd, 0) as m:
                assert blocks[0].tobytes() in bytes(m)
        finally:
            os.close(fd)
        answer, fd = ch.map_tenant(shared.namespace_id)
        assert fd is None and answer.nbytes == 0  # the shared file, at Hello's path
        try:
            ch.map_tenant("0" * 32)
            raise AssertionError("an unknown namespace was answered")
        except NamespaceNotFound:
            pass
    finally:
        ch.close()
    # Beside another request in one frame: refused (the descriptor would ride on a
    # frame that carries other answers), and the frame refused as a whole.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(path)
    try:
        sock.sendall(w.frame([w.Hello(1, "wire-test")]))
        hello = sock.recv(4096)
        assert isinstance(w.reply_decoder.decode(hello[w.HEADER.size :])[0], w.HelloReply)
        sock.sendall(w.frame([w.MapTenant(2, a.namespace_id), w.Lookup(3, a.namespace_id, b"")]))
        msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        assert fds == []
        (reply,) = w.reply_decoder.decode(msg[w.HEADER.size :])
        assert isinstance(reply, w.Error) and reply.reason == InvalidRequest.reason
        assert "alone in its frame" in reply.message
    finally:
        sock.close()


def test_a_client_that_outlives_a_restart_maps_the_new_daemons_tenant_file(daemon_factory):
    d = daemon_factory(
        dram_bytes=4 * MiB,
        chunk_bytes=1 * MiB,
        settings={**SETTINGS, "dram.warm_restart": False},
    )
    before, after = list(range(1, 5)), list(range(11, 15))
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        assert c.put(ns, before, blocks_for(before, 1)).stored == 4
        assert d.stop(keep_region=True) == 0
        d.start()  # a new region: new files, new region_id, nothing kept
        new = blocks_for(after, 2)
        assert c.put(ns, after, new).stored == 4  # re-declared, re-mapped, the new file
        got = c.get(ns, after)
        assert got.found == 4 and np.array_equal(got.data, new)
        handle = c.prepare_load(ns, after)
        try:
            assert np.array_equal(c.view(int(handle.offsets[0]), BLOCK), new[0])
        finally:
            c.release(handle.lease_id)
        with open(region_files(d)[SALT_A], "rb") as f:
            assert new[0].tobytes() in f.read()


def test_a_principal_is_handed_only_its_own_tenants_file(daemon_factory):
    """With auth.principals, a tenant's file goes only to a caller whose principal
    may use that tenant: bob (tenant beta) asking for alpha's namespace gets
    PERMISSION_DENIED and no descriptor, and his Client maps none of alpha's bytes."""
    from kvstore.errors import PermissionDenied
    from kvstore.identity import hash_token
    from kvstore.local_client import LocalChannel
    from kvstore.local_server import local_socket_path

    alice, bob = "alice-token-5f1e0c9a7d", "bob-token-0b8e44c2a1"
    d = daemon_factory(
        dram_bytes=4 * MiB,
        chunk_bytes=1 * MiB,
        settings={
            **SETTINGS,
            "auth.principals.alice.token_sha256": hash_token(alice),
            "auth.principals.alice.tenants": SALT_A,
            "auth.principals.bob.token_sha256": hash_token(bob),
            "auth.principals.bob.tenants": SALT_B,
        },
    )
    hashes = list(range(1, 5))
    data = blocks_for(hashes, 7)
    with Client(d.address, token=alice) as a:
        ns_a = a.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        assert a.put(ns_a, hashes, data).stored == 4
        got = a.get(ns_a, hashes)
        assert got.found == 4 and np.array_equal(got.data, data)
    ch = LocalChannel.open(local_socket_path(d.socket_path), "bob-raw", 5.0, bob)
    try:
        with pytest.raises(PermissionDenied, match="bob may not use namespace"):
            ch.map_tenant(ns_a.namespace_id)
    finally:
        ch.close()
    with Client(d.address, token=bob) as b:
        ns_b = b.declare_namespace(make_spec(BLOCK, tenant=SALT_B))
        assert b.put(ns_b, hashes, blocks_for(hashes, 8)).stored == 4
        with pytest.raises(PermissionDenied):
            b.get(ns_a, hashes)
        lo, hi = RANGES[SALT_A]
        assert b.region is not None
        assert not b.view(lo, hi - lo).any()  # alpha's range: empty memory here
    # Both principals' tenants have their own files: no "memory is shared" warning.
    assert "share the one DRAM" not in d.log_tail(200_000)
