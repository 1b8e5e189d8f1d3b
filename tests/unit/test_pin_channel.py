"""The pin channel's handshake and calls, both ends real (kvstore.transfer.pin_channel)
over loopback TCP; the daemon-level tests are in tests/integration/test_nixl_peer.py."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from kvstore import errors
from kvstore.transfer import pin_channel
from kvstore.transfer.pin_channel import PinClient, PinServer
from kvstore.v1 import peer_pb2

SECRET = "cluster-secret"


async def started(
    pin: Any = None, release: Any = None, secret: str = SECRET
) -> tuple[PinServer, int]:
    async def no_release(request: Any) -> Any:
        return peer_pb2.ReleasePullResponse(released=len(request.lease_ids))

    server = PinServer(secret, pin, release or no_release)
    return server, await server.start("127.0.0.1", 0)


async def open_client(port: int, secret: str = SECRET, timeout_s: float = 2.0) -> PinClient:
    return await PinClient.open(
        "127.0.0.1", port, secret, name="owner", timeout_s=timeout_s, max_frame_bytes=1 << 20
    )


async def test_both_sides_must_prove_the_secret() -> None:
    seen: list[Any] = []

    async def pin(request: Any) -> Any:
        seen.append(request)
        return peer_pb2.PinForPullResponse(lease_id=7, found_blocks=1, incarnation="i1")

    server, port = await started(pin)
    try:
        # A puller with another secret is refused, as over gRPC, before any work.
        with pytest.raises(errors.PermissionDenied, match="wrong or missing cluster secret"):
            await open_client(port, "not-it")
        assert seen == [] and server.connections == 0
        client = await open_client(port)
        reply = await client.pin(peer_pb2.PinForPullRequest(requester_node_id="b"), 2.0)
        assert (reply.lease_id, reply.incarnation) == (7, "i1")
        assert seen[0].requester_node_id == "b"
        assert client.release_nowait([7])
        await client.aclose()
    finally:
        await server.close()

    # A stranger on the port who does not know the secret cannot pass for the owner:
    # it answers the challenge with a proof it had to guess.
    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(pin_channel.MAGIC + os.urandom(32))
        await reader.readexactly(64)
        writer.write(pin_channel._frame(pin_channel.WELCOME, 0, os.urandom(32)))
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        with pytest.raises(
            errors.PermissionDenied, match="did not prove the cluster secret"
        ) as err:
            await open_client(fake.sockets[0].getsockname()[1])
        # the peer's failing, like a refusal it sent: a peer hint is skipped, not fatal
        assert err.value.status_code == errors.PermissionDenied.status
    finally:
        fake.close()


async def test_errors_keep_their_class_and_a_lost_owner_fails_the_waiters() -> None:
    gate = asyncio.Event()

    async def pin(request: Any) -> Any:
        if request.requester_node_id == "bad":
            raise errors.CapacityExhausted("too many outstanding peer pins")
        await gate.wait()  # stalls until the test lets it go (never, below)
        return peer_pb2.PinForPullResponse()

    server, port = await started(pin)
    client = await open_client(port)
    try:
        with pytest.raises(errors.CapacityExhausted, match="too many outstanding") as err:
            await client.pin(peer_pb2.PinForPullRequest(requester_node_id="bad"), 2.0)
        assert err.value.status_code == errors.CapacityExhausted.status  # as gRPC would say
        # A stalled owner: the caller's bound holds (DeadlineExceeded), the channel lives.
        with pytest.raises(errors.DeadlineExceeded):
            await client.pin(peer_pb2.PinForPullRequest(requester_node_id="slow"), 0.05)
        assert client.broken is None
        # The owner goes away while a pin waits: the waiter hears Unavailable at once.
        waiting = asyncio.ensure_future(
            client.pin(peer_pb2.PinForPullRequest(requester_node_id="slow"), 30.0)
        )
        await asyncio.sleep(0.05)
        await server.close()
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(waiting, 5.0)
        assert isinstance(client.broken, errors.Unavailable)
        assert not client.release_nowait([1])  # the caller falls back to gRPC
    finally:
        await client.aclose()
        await server.close()


async def test_releases_wait_a_moment_and_go_in_one_frame() -> None:
    """A pull's release goes after the pull's reply (not on its path): batched in
    one frame RELEASE_DELAY_S later, or ahead of the next pin, or at close."""
    seen: list[Any] = []

    async def pin(request: Any) -> Any:
        seen.append(("pin", request.requester_node_id))
        return peer_pb2.PinForPullResponse(lease_id=9)

    async def release(request: Any) -> Any:
        seen.append(("release", list(request.lease_ids)))
        return peer_pb2.ReleasePullResponse(released=len(request.lease_ids))

    server, port = await started(pin, release)
    client = await open_client(port)
    try:
        assert client.release_soon(1) and client.release_soon(2)
        await asyncio.sleep(0)
        assert seen == []  # not sent on the caller's turn
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.005)
        assert seen == [("release", [1, 2])]  # one frame, within a few ms
        # a release due rides ahead of the next pin, in order
        assert client.release_soon(3)
        await client.pin(peer_pb2.PinForPullRequest(requester_node_id="b"), 2.0)
        assert seen[1:] == [("release", [3]), ("pin", "b")]
        # a full batch goes at once
        for lease_id in range(100, 100 + pin_channel.MAX_RELEASE_BATCH):
            assert client.release_soon(lease_id)
        for _ in range(200):
            if len(seen) > 3:
                break
            await asyncio.sleep(0.001)
        assert seen[3] == ("release", list(range(100, 100 + pin_channel.MAX_RELEASE_BATCH)))
        # what waits at close is sent before the connection goes
        assert client.release_soon(4)
        await client.aclose()
        for _ in range(200):
            if len(seen) > 4:
                break
            await asyncio.sleep(0.005)
        assert seen[4] == ("release", [4])
        assert not client.release_soon(5)  # closed: the caller falls back to gRPC
    finally:
        await client.aclose()
        await server.close()


async def test_nothing_listening_is_unavailable() -> None:
    server, port = await started()
    await server.close()
    with pytest.raises(errors.Unavailable):
        await open_client(port)
