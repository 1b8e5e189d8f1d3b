"""The connector's settings: vLLM's ``kv_connector_extra_config``, typed.

    --kv-transfer-config '{..., "kv_connector_extra_config": {"address": "unix:/run/kvstore.sock"}}'

Unknown keys are an error (a typo would otherwise silently fall back to a
default), raised when vLLM builds the connector, i.e. at engine start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from kvstore.errors import ConfigError

DEFAULT_ADDRESS = "unix:/tmp/kvstore.sock"
# The daemon refuses pulls longer than its peer pin lifetime allows (puller's
# MAX_PIN_TTL_S - PIN_TTL_MARGIN_S); a scheduler stall beyond this is never wanted.
MAX_PEER_TIMEOUT_S = 30.0
# Slots one namespace's reserve may hold: a bound on what an idle engine keeps.
MAX_STORE_RESERVE_BLOCKS = 1024
# Where the daemon keeps a reserve's other slots past a commit (keep_rest), the
# worker asks for a reserve of this many store steps like the recent ones (within
# store_reserve_blocks and its share of the region): most store steps then
# neither ask for one nor read an answer (docs/vllm.md, "Store steps").
RESERVE_STEPS = 4


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    address: str = ""
    """Daemon address: "unix:/path.sock" or "127.0.0.1:PORT"; "" = $KVSTORE_ADDRESS or the default socket."""
    timeout_s: float = 0.5
    """Deadline of each daemon call on the request path; past it the step goes on without the cache."""
    retry_initial_s: float = 0.5
    """Wait before the first reconnect attempt after the daemon failed."""
    retry_max_s: float = 10.0
    """Cap of the doubling wait between reconnect attempts."""
    model_name: str = ""
    """Model id in the namespace; "" = vLLM's --model. Set it when engines load one model from different paths."""
    load: bool = True
    """Ask the daemon for prefix hits and load them."""
    save: bool = True
    """Store newly computed full blocks."""
    save_decode: bool = True
    """Also store blocks completed by generated tokens (multi-turn reuse), not only prompt blocks."""
    min_hit_blocks: int = 1
    """Ignore external hits shorter than this many blocks (a load has a fixed cost)."""
    lease_ttl_s: float = 0.0
    """Lease on blocks being stored or loaded; 0 = the daemon's default."""
    verify_checksums: bool = True
    """Check the xxh3-64 the daemon gives for blocks that crossed disk or network."""
    peer: str = ""
    """Default peer hint (node id of the daemon's [peer] peers, or host:port) for requests
    without kv_transfer_params["kvstore_peer"]; "" = pull from peers only when hinted."""
    peer_timeout_s: float = 2.0
    """Deadline of one pull from a peer (the request waits for it in the scheduler)."""
    local_channel: bool = True
    """Talk to a local daemon over its lean local channel (docs/local-channel.md) where it
    serves one: tens of microseconds a call instead of gRPC's ~0.7 ms; gRPC otherwise.
    false = gRPC only."""
    direct_loads: bool = True
    """Read hits the daemon holds in DRAM straight from its region, found in its presence
    table, with no call and no lease (docs/presence.md, "Direct loads"): each block is
    checked after the copy, and one that left its slot meanwhile is reported to vLLM as
    a failed load (recomputed). false = every load pins its blocks first (PrepareLoad)."""
    store_reserve_blocks: int = 64
    """Most slots the worker keeps reserved ahead per namespace (docs/vllm.md, "Store
    steps"): a store step whose new blocks fit takes its slots from the reserve with
    no call, and its commit asks for the next one in the same send. 0 = every store
    step asks the daemon (PrepareStore) and waits for the answer."""
    tier: Literal["dram", "gpu"] = "dram"
    """Daemon tier the engine copies to and from: "gpu" = the daemon's GPU pool (device to
    device on a CUDA engine; needs gpu.device on the daemon), "dram" = its shared region."""

    token: str = ""
    """Bearer token where the daemon maps callers to tenants (docs/security.md,
    "Identities"); "" = token_file, else $KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE, else none
    (the engine's uid identifies it on the lean channel)."""
    token_file: str = ""
    """File holding the token (first line; must be 0600): kept out of the engine's
    command line."""

    def resolved_address(self) -> str:
        return self.address or os.environ.get("KVSTORE_ADDRESS", "") or DEFAULT_ADDRESS

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        try:
            config = msgspec.convert(dict(extra or {}), cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        problems = []
        if config.timeout_s <= 0:
            problems.append("timeout_s must be > 0")
        if not 0 < config.retry_initial_s <= config.retry_max_s:
            problems.append("need 0 < retry_initial_s <= retry_max_s")
        if config.min_hit_blocks < 1:
            problems.append("min_hit_blocks must be >= 1")
        if not 0 < config.peer_timeout_s <= MAX_PEER_TIMEOUT_S:
            problems.append(f"peer_timeout_s must be in (0, {MAX_PEER_TIMEOUT_S:g}]")
        if config.lease_ttl_s < 0:
            problems.append("lease_ttl_s must be >= 0")
        if not 0 <= config.store_reserve_blocks <= MAX_STORE_RESERVE_BLOCKS:
            problems.append(f"store_reserve_blocks must be in [0, {MAX_STORE_RESERVE_BLOCKS}]")
        if problems:
            raise ConfigError("kv_connector_extra_config: " + "; ".join(problems))
        return config
