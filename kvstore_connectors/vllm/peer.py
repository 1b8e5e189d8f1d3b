"""Peer hints: which other node's daemon may hold a request's prefix.

A router or P/D proxy that knows where a prefix was computed passes it with
the request, ``kv_transfer_params={"kvstore_peer": "<node-id or host:port>"}``
(vLLM keeps ``SamplingParams.extra_args["kv_transfer_params"]`` as
``Request.kv_transfer_params``); ``peer`` in kv_connector_extra_config is the
default for requests without one. When the local daemon lacks part of the
prefix, the scheduler has its daemon pull the missing blocks from that peer
(``FetchFromPeer``, over NIXL) before answering vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

HINT_KEY = "kvstore_peer"


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
