"""KV event wire format: vLLM's exact msgpack layout, and vLLM's own classes reading it."""

from __future__ import annotations

import os
import subprocess

import msgspec
import pytest

from kvstore.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LeanCleared,
    LeanRemoved,
    LeanStored,
    block_hash_to_int,
    full_decoder,
    lean_decoder,
    make_topic,
    parse_topic,
)
from tests.vllm_python import vllm_python


def _stored(**kw):
    base = dict(
        block_hashes=[1, 2**64 - 1],
        parent_block_hash=None,
        token_ids=[5, 6, 7, 8],
        block_size=2,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    base.update(kw)
    return BlockStored(**base)


def test_batch_is_an_array_and_events_are_tagged_maps_in_vllm_field_order():
    batch = KVEventBatch(
        ts=1.5,
        events=[_stored(), BlockRemoved(block_hashes=[3], medium="DISK"), AllBlocksCleared()],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert isinstance(raw, list) and raw[0] == 1.5 and raw[2] == 0
    stored, removed, cleared = raw[1]
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]  # defaults (extra_keys, group_idx, ...) omitted, as vLLM does
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [1, 2**64 - 1]
    assert removed == {"type": "BlockRemoved", "block_hashes": [3], "medium": "DISK"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_rank_none_is_encoded_like_vllm():
    # array_like Structs keep every position (msgspec omits defaults only in maps)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=2.0, events=[])))
    assert raw == [2.0, [], None]


def test_full_and_lean_decoders_round_trip():
    batch = KVEventBatch(ts=1.0, events=[_stored(extra_keys=[("s",), None]), AllBlocksCleared()])
    payload = msgspec.msgpack.encode(batch)
    assert full_decoder().decode(payload) == batch
    lean = lean_decoder().decode(payload)
    assert isinstance(lean.events[0], LeanStored) and lean.events[0].block_hashes == [1, 2**64 - 1]
    assert isinstance(lean.events[1], LeanCleared)
    rm = lean_decoder().decode(
        msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[BlockRemoved([9], None)]))
    )
    assert isinstance(rm.events[0], LeanRemoved) and rm.events[0].medium is None


def test_bytes_hashes_fold_like_vllm_int_conversion():
    digest = bytes(range(32))
    assert block_hash_to_int(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert block_hash_to_int(-1) == 2**64 - 1
    assert block_hash_to_int(5) == 5


def test_topics():
    assert make_topic("node-1", "meta/llama@v2") == "kv@node-1@meta/llama@v2"
    assert parse_topic(b"kv@node-1@meta/llama@v2") == ("node-1", "meta/llama@v2")
    assert parse_topic(b"kv@node-1@") == ("node-1", "")
    assert parse_topic(b"") is None
    assert parse_topic(b"kv@@m") is None
    assert parse_topic(b"\xff\xfe") is None
    assert END_SEQ == b"\xff" * 8


# --- vLLM's own classes ------------------------------------------------------------

_VLLM_SCRIPT = r"""
import time, msgspec, zmq
from vllm.distributed import kv_events as V
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.events.wire import lean_decoder

class NS:
    namespace_id = "ns"; model = "tiny-llama"; tenant = ""; block_size_tokens = 4

class Probe(NS):
    model = "probe"

pub = ZmqEventPublisher("node-a", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", announce_start=True)
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(pub.endpoint)
# PUB/SUB slow joiner: probes (model "probe") until one arrives, then all read
deadline = time.time() + 15
for i in range(100_000):
    assert time.time() < deadline, "the subscriber never joined"
    pub.blocks_stored(Probe(), [i], "CPU", None, None)
    if sub.poll(50):
        break
while sub.poll(300):
    sub.recv_multipart()
pub.blocks_stored(NS(), [11, 2**64 - 2], "CPU", 7, [1, 2, 3, 4, 5, 6, 7, 8])
pub.blocks_removed(NS(), [11], "DISK")
pub.all_cleared(NS())
dec = msgspec.msgpack.Decoder(V.KVEventBatch)
events, topics, seqs = [], set(), []
deadline = time.time() + 10
while len(events) < 3 and time.time() < deadline:
    if sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        b = dec.decode(payload)
        topics.add(topic); seqs.append(int.from_bytes(seq, "big"))
        if topic == b"kv@node-a@tiny-llama":
            events += b.events
# the start-of-life clear (seq 0, all models) may or may not reach a late SUB
assert topics <= {b"kv@node-a@tiny-llama", b"kv@node-a@"}, topics
s, r, c = events
assert isinstance(s, V.BlockStored) and s.block_hashes == [11, 2**64 - 2] and s.parent_block_hash == 7
assert s.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and s.block_size == 4 and s.medium == "CPU"
assert isinstance(r, V.BlockRemoved) and r.block_hashes == [11] and r.medium == "DISK"
assert isinstance(c, V.AllBlocksCleared)
# replay: what vLLM's own subscriber example sends (start seq, 8 bytes BE)
dealer = ctx.socket(zmq.DEALER); dealer.connect(pub.replay_endpoint)
dealer.send_multipart((b"", (0).to_bytes(8, "big")))
got = []
while True:
    assert dealer.poll(5000)
    _, topic, seq, payload = dealer.recv_multipart()
    if seq == V.ZmqEventPublisher.END_SEQ:
        break
    got.append((topic, int.from_bytes(seq, "big"), dec.decode(payload)))
assert got[0][0] == b"kv@node-a@" and isinstance(got[0][2].events[0], V.AllBlocksCleared)
assert [g[1] for g in got] == list(range(len(got)))
# and the other way: what vLLM publishes, our lean decoder reads
vb = V.KVEventBatch(ts=time.time(), events=[
    V.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                  lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",)], group_idx=0),
    V.BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0), V.AllBlocksCleared()],
    data_parallel_rank=0)
lean = lean_decoder().decode(msgspec.msgpack.encode(vb))
assert [type(e).__name__ for e in lean.events] == ["_LeanStored", "_LeanRemoved", "_LeanCleared"]
pub.close()
print("OK", len(got))
"""


@pytest.mark.vllm
def test_vllm_decodes_what_our_publisher_sends():
    py = vllm_python()
    if py is None:
        pytest.skip("vLLM (CPU build) is not installed")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    proc = subprocess.run(
        [py, "-c", _VLLM_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": root},
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK")
