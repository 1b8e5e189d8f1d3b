"""The cost model that turns measured cache behaviour into modelled time.

The cluster replay *measures* where every input token came from (the
engine's GPU cache, the local daemon's DRAM or disk tier, a peer daemon, or
recompute) against real daemons and the real indexer. It cannot measure what
an H100 would take to prefill the rest, so it *models* that, with this file's
formulas and parameters; every figure derived from them is labelled
"modelled" in the output.

Per request, with ``n`` tokens recomputed after ``c`` cached tokens:

    prefill_s  = FLOPs / (gpu_flops * mfu)
    FLOPs      = n * 2 * params + attention,
    attention  = 4 * layers * d_model * sum_{i=c}^{c+n} i   (causal, QK^T and AV)
    load_s     = sum over tiers of kv_bytes(tokens from tier) / bandwidth(tier)
                 (GPU hits cost nothing; peer pulls go NIC -> host -> GPU, so at
                 the slower of the NIC and the host link)
    decode_s   = output * (weights_bytes / decode_batch + kv_bytes(context)) / hbm_bw
    TTFT       = queueing + load_s + prefill_s   (loads not overlapped: conservative)

An engine serves prefills one at a time (prefill is compute-bound, so
batching them does not add throughput); a request occupies its engine for
``load_s + prefill_s + decode_s / decode_batch`` (decode runs batched with
other requests). Throughput = (input + output tokens) / makespan of the
closed-loop replay.

Defaults: one H100 SXM (989 TFLOP/s dense BF16 at 45% MFU, 3.35 TB/s HBM,
80 GB at 90% use) serving a Llama-3.1-8B-shaped model (8.0 B parameters, 32
layers, d_model 4096, 8 KV heads x 128, BF16 -> 128 KiB of KV per token),
host link PCIe Gen5 x16 at ~50 GB/s effective, one local NVMe at 6 GB/s,
400 Gb/s NICs at 90% efficiency (45 GB/s).
"""

from __future__ import annotations

import msgspec

GB = 1e9


class CostModel(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    params_b: float = 8.0
    """Model parameters, billions."""
    layers: int = 32
    d_model: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    gpu_flops: float = 989e12
    """Dense BF16 FLOP/s of one GPU (H100 SXM)."""
    mfu: float = 0.45
    """Share of peak reached by prefill."""
    gpu_mem_bytes: float = 80 * GB
    gpu_mem_util: float = 0.90
    """Share of GPU memory the engine takes (vLLM's gpu_memory_utilization)."""
    activation_reserve_bytes: float = 4 * GB
    hbm_bw_bytes_per_s: float = 3.35e12
    host_link_bytes_per_s: float = 50 * GB
    """GPU <-> host DRAM (PCIe Gen5 x16, effective)."""
    disk_bytes_per_s: float = 6 * GB
    """Local NVMe read."""
    nic_bytes_per_s: float = 400e9 / 8 * 0.9
    """Peer transfer: 400 Gb/s at 90% efficiency."""
    decode_batch: int = 16
    """Concurrent decodes sharing each weight read."""

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weights_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes

    def gpu_cache_tokens(self) -> int:
        """KV tokens that fit in the engine's GPU cache."""
        free = (
            self.gpu_mem_bytes * self.gpu_mem_util
            - self.weights_bytes
            - self.activation_reserve_bytes
        )
        return max(0, int(free // self.kv_bytes_per_token))

    def prefill_s(self, cached_tokens: int, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        c, n = cached_tokens, new_tokens
        linear = n * 2.0 * self.params_b * 1e9
        # sum of positions c..c+n-1 = n*c + n(n-1)/2
        attention = 4.0 * self.layers * self.d_model * (n * c + n * (n - 1) / 2.0)
        return (linear + attention) / (self.gpu_flops * self.mfu)

    def load_s(self, dram_tokens: int = 0, disk_tokens: int = 0, peer_tokens: int = 0) -> float:
        kv = self.kv_bytes_per_token
        peer_bw = min(self.nic_bytes_per_s, self.host_link_bytes_per_s)
        disk_bw = min(self.disk_bytes_per_s, self.host_link_bytes_per_s)
        return (
            dram_tokens * kv / self.host_link_bytes_per_s
            + disk_tokens * kv / disk_bw
            + peer_tokens * kv / peer_bw
        )

    def decode_s(self, context_tokens: int, output_tokens: int) -> float:
        per_step = (
            self.weights_bytes / self.decode_batch + context_tokens * self.kv_bytes_per_token
        ) / self.hbm_bw_bytes_per_s
        return output_tokens * per_step

    def service(
        self,
        *,
        input_tokens: int,
        output_tokens: int,
        gpu_tokens: int,
        dram_tokens: int,
        disk_tokens: int,
        peer_tokens: int,
    ) -> tuple[float, float, float]:
        """-> (ttft_s without queueing, engine occupancy_s, decode_s)."""
        cached = gpu_tokens + dram_tokens + disk_tokens + peer_tokens
        assert 0 <= cached <= input_tokens, (cached, input_tokens)
        load = self.load_s(dram_tokens, disk_tokens, peer_tokens)
        prefill = self.prefill_s(cached, input_tokens - cached)
        decode = self.decode_s(input_tokens, output_tokens)
        return load + prefill, load + prefill + decode / self.decode_batch, decode

    def describe(self) -> dict[str, float | int]:
        """Parameters plus the derived figures the report prints."""
        out: dict[str, float | int] = msgspec.to_builtins(self)
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        out["gpu_cache_tokens"] = self.gpu_cache_tokens()
        out["prefill_s_100k_cold"] = round(self.prefill_s(0, 100_000), 3)
        out["dram_load_s_100k"] = round(self.load_s(dram_tokens=100_000), 3)
        return out
