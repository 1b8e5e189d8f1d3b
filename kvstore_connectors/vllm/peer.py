"""Peer hints: which other node's daemon may hold a request's prefix.

A router or P/D proxy that knows where a prefix was computed passes it with
the request, ``kv_transfer_params={"kvstore_peer": "<node-id or host:port>"}``
(vLLM keeps ``SamplingParams.extra_args["kv_transfer_params"]`` as
``Request.kv_transfer_params``); ``peer`` in kv_connector_extra_config is the
default for requests without one. When the local daemon lacks part of the
prefix, the scheduler has its daemon pull the missing blocks from that peer
(``FetchFromPeer``, over NIXL) before answering vLLM.

Handed-over pins (the P/D split, docs/peer-transfer.md): a prefill request
sent with ``kv_transfer_params={"kvstore_hand_over": true}`` has the prefill
engine's connector pin the prompt's blocks in its daemon when the request
finishes (``HandOver``) and answer ``{"kvstore_ticket": "<base64>"}`` in the
response's ``kv_transfer_params``. The router passes that on to the decode
request beside its ``kvstore_peer`` hint, and the decode engine's daemon reads
the blocks at once, with no pin round trip to the prefill node first.

llm-d's P/D split needs no proxy of ours: its routing sidecar (the "nixlv2"
protocol of llm-d-inference-scheduler's pkg/sidecar/proxy) sends the prefill
request with ``kv_transfer_params["do_remote_decode"] = true`` and passes the
prefill answer's ``kv_transfer_params`` on to the decode request as they are.
A prefill request asking that is handed over alike, so the ticket reaches the
decode engine, which pulls from the node the ticket names (a node of its
daemon's ``[peer] peers``).
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

HINT_KEY = "kvstore_peer"
TICKET_KEY = "kvstore_ticket"
HAND_OVER_KEY = "kvstore_hand_over"
# What llm-d's sidecar (and vLLM's NIXL P/D proxies) ask a prefill engine with.
REMOTE_DECODE_KEY = "do_remote_decode"
# A ticket's base64 beyond this is no ticket of ours (one of a 200k-token prompt
# of 16-token blocks is ~500 KiB): ignored, not decoded.
MAX_TICKET_CHARS = 8 << 20


class PeerTarget(msgspec.Struct, frozen=True):
    """Where to pull from: a node of the daemon's ``[peer] peers``, or an address."""

    node_id: str = ""
    address: str = ""

    @classmethod
    def parse(cls, value: str) -> PeerTarget:
        """An address when it has a port ("host:port"), else a node id."""
        value = value.strip()
        if ":" in value:
            return cls(address=value)
        return cls(node_id=value)

    def __str__(self) -> str:
        return self.address or self.node_id


def peer_hint(kv_transfer_params: Any, default: str) -> PeerTarget | None:
    """The request's peer hint, else the connector's default; None when neither.

    A malformed hint is ignored (the request runs on the local cache only), with
    a warning naming it: a hint is advice and must never fail a request.
    """
    value: Any = None
    if isinstance(kv_transfer_params, dict):
        value = kv_transfer_params.get(HINT_KEY)
    elif kv_transfer_params is not None:
        logger.warning(
            "kvstore: kv_transfer_params is %s, not a dict; its peer hint is ignored",
            type(kv_transfer_params).__name__,
        )
    if value is not None and (not isinstance(value, str) or not value.strip()):
        logger.warning(
            "kvstore: kv_transfer_params[%r] must be a non-empty string "
            "(node id or host:port), got %r; ignored",
            HINT_KEY,
            value,
        )
        value = None
    if value is None:
        value = default
    return PeerTarget.parse(value) if value else None


def pull_ticket(kv_transfer_params: Any) -> bytes:
    """The request's handed-over pin (``kvstore_ticket``, base64), or b"". A malformed
    one is ignored with a warning (the pull then pins as usual): advice, like a hint."""
    if not isinstance(kv_transfer_params, dict):
        return b""
    value = kv_transfer_params.get(TICKET_KEY)
    if value is None:
        return b""
    if isinstance(value, str) and 0 < len(value) <= MAX_TICKET_CHARS:
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    logger.warning(
        "kvstore: kv_transfer_params[%r] must be the base64 of a HandOver ticket; ignored",
        TICKET_KEY,
    )
    return b""


def wants_hand_over(kv_transfer_params: Any) -> bool:
    """Whether the request asks its blocks be handed over when it finishes: ours
    (``kvstore_hand_over``) or llm-d's (``do_remote_decode``), set to true."""
    return isinstance(kv_transfer_params, dict) and (
        kv_transfer_params.get(HAND_OVER_KEY) is True
        or kv_transfer_params.get(REMOTE_DECODE_KEY) is True
    )


def ticket_params(ticket: bytes) -> dict[str, str]:
    """What the finished request answers in ``kv_transfer_params``."""
    return {TICKET_KEY: base64.b64encode(ticket).decode("ascii")}
