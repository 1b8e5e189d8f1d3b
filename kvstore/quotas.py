"""Per-tenant quotas: each tenant's caps in bytes per tier, and its name in reports.

A tenant is the namespace's ``tenant`` field (vLLM ``cache_salt``; "" is the
default tenant). ``[quotas.tenants.<name>]`` caps one tenant; the
``quotas.default_*_bytes`` cap every tenant not listed, each on its own. The
placement (``kvstore.placement``) keeps one ``TenantAccount`` per tenant and
enforces the caps; this module only says what the caps are and how a tenant is
named where others can read it (docs/tenants.md).

Names, never salts: a cache_salt is a secret of its tenant (who knows it shares
that tenant's cache), so Stats, /metrics and ``kvstore status`` name a
configured tenant by its configured name and sum every other tenant under
``OTHER_TENANTS``: the label set stays bounded by the config, whatever tenants
clients declare.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.config import Config, QuotasConfig
from kvstore.errors import ConfigError
from kvstore.namespace import TenantAccount, Tier

# The label of every tenant not in quotas.tenants, summed (a configured name
# cannot start with "_": kvstore.config checks).
OTHER_TENANTS = "_other"


@dataclass(slots=True)
class TenantStats:
    """One row of the tenants report: a configured tenant, or the others summed."""

    label: str
    namespaces: int
    # Bytes held and caps (0 = none) by tier; for OTHER_TENANTS the bytes of all
    # of them together and the cap each one has.
    used_bytes: dict[Tier, int]
    quota_bytes: dict[Tier, int]
    tenants: int = 1  # tenants summed in this row (OTHER_TENANTS: those seen)


@dataclass(frozen=True, slots=True)
class TenantRegion:
    """A tenant's own range of the DRAM region (dram.tenant_regions)."""

    name: str  # the configured name: part of the file name, never the salt
    tenant: str
    nbytes: int


def tenant_regions(config: Config) -> list[TenantRegion]:
    """The tenant regions the config asks for: one per configured tenant with a DRAM
    cap, by name, each its cap rounded up to whole chunks (the slab allocator's
    unit); [] when dram.tenant_regions is off."""
    dram = config.dram
    if not dram.tenant_regions:
        return []
    chunk = dram.chunk_bytes
    if dram.capacity_bytes % chunk:
        raise ConfigError(
            f"dram.tenant_regions needs dram.capacity_bytes ({dram.capacity_bytes}) in whole "
            f"chunks of dram.chunk_bytes ({chunk})"
        )
    regions = [
        TenantRegion(name, entry.tenant, -(-entry.dram_bytes // chunk) * chunk)
        for name, entry in sorted(config.quotas.tenants.items())
        if entry.dram_bytes
    ]
    taken = sum(r.nbytes for r in regions)
    if taken >= dram.capacity_bytes:
        raise ConfigError(
            f"dram.tenant_regions: the tenants' DRAM caps take {taken} bytes in whole chunks, "
            f"not less than dram.capacity_bytes ({dram.capacity_bytes}); the shared region "
            "of the other tenants needs at least one chunk"
        )
    return regions


class QuotaTable:
    """The configured caps, by tenant."""

    def __init__(self, config: QuotasConfig | None = None) -> None:
        config = config or QuotasConfig()
        self._named = {
            entry.tenant: (name, [0, entry.gpu_bytes, entry.dram_bytes, entry.disk_bytes])
            for name, entry in config.tenants.items()
        }
        self._default = [
            0,
            config.default_gpu_bytes,
            config.default_dram_bytes,
            config.default_disk_bytes,
        ]

    def account(self, tenant: str) -> TenantAccount:
        """A new, empty account for ``tenant`` with its caps."""
        named = self._named.get(tenant)
        label, caps = named if named is not None else (OTHER_TENANTS, self._default)
        account = TenantAccount(tenant, label, named is not None, list(caps))
        for tier in Tier:
            if caps[tier]:
                account.order[tier] = {}
        return account

    def report(self, accounts: Iterable[TenantAccount]) -> list[TenantStats]:
        """Rows for Stats and metrics: every configured tenant (held bytes or not),
        then the others summed under OTHER_TENANTS when any was seen or a default
        cap is set."""
        rows = {
            label: TenantStats(label, 0, dict.fromkeys(Tier, 0), _caps(caps))
            for label, caps in self._named.values()
        }
        other = TenantStats(OTHER_TENANTS, 0, dict.fromkeys(Tier, 0), _caps(self._default), 0)
        for account in accounts:
            row = rows[account.label] if account.configured else other
            if not account.configured:
                other.tenants += 1
            row.namespaces += account.namespaces
            for tier in Tier:
                row.used_bytes[tier] += account.used_bytes[tier]
        out = sorted(rows.values(), key=lambda r: r.label)
        if other.tenants or any(self._default):
            out.append(other)
        return out


def _caps(caps: list[int]) -> dict[Tier, int]:
    return {tier: caps[tier] for tier in Tier}
