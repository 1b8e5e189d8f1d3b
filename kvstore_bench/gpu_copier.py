"""The connector's copies of a long prefix, against the prefill they replace.

A vLLM-shaped paged KV cache (FlashAttention layout, one
``[2, num_blocks, block_size, kv_heads, head_dim]`` bf16 tensor per layer, block
ids scattered as vLLM hands them out) and the two ways the connector moves a
prefix's blocks:

- tier "gpu": ``BlockCopier`` between the cache and a pool on the same device
  (device to device, what the daemon's GPU tier gives a local engine);
- tier "dram": ``CudaBlockCopier`` between the cache and a host region, layer by
  layer on its side stream through pinned staging (``wait_layer`` per layer on
  load, ``save_layer`` per layer on save).

Each is timed (median of ``--repeats`` after one warm-up) for loading and
saving the whole prefix, and compared with (a) a torch copy of the same bytes
(the copier's efficiency) and (b) the time a bf16 prefill of those tokens would
take on this device: the model's FLOPs at the matmul rate measured here (an
8192^3 bf16 product on CUDA). Loading must beat recomputing by a wide margin.

Only ``--layers`` of the model's ``--model-layers`` are materialised (memory);
copies are per layer and independent, so whole-model times are the measured ones
scaled by model_layers / layers (said in each row's note).

Without CUDA (``--device cpu``) the CPU ``BlockCopier`` runs over CPU tensors
(small sizes: a smoke test of the same code), and the CUDA rows say they were
not measured.

    python -m kvstore_bench.gpu_copier [--device cuda:0] [--tokens 195000] [--figures PATH]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvstore_bench._common import Figure, gbps, write_figures

GiB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="", help='"cuda:N" or "cpu"; default cuda:0 if present')
    p.add_argument("--tokens", type=int, default=195_000)
    p.add_argument("--block-size", type=int, default=16, help="tokens per vLLM block")
    # Llama-3.1-8B's shape: 32 layers, 8 KV heads of 128, hidden 4096, MLP 14336.
    p.add_argument("--model-layers", type=int, default=32)
    p.add_argument("--layers", type=int, default=8, help="layers materialised and timed")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    p.add_argument("--figures", default="", help="append figures as JSON lines to this file")


def prefill_flops(args: argparse.Namespace) -> float:
    """Forward FLOPs of a causal prefill of ``args.tokens`` tokens (whole model).

    Linear layers: 2 * params * tokens (attention projections + gated MLP).
    Attention: QK^T and PV, 2 * 2 * T^2 * (q_heads * head_dim) per layer, halved
    for the causal mask."""
    q = args.q_heads * args.head_dim
    kv = args.kv_heads * args.head_dim
    per_layer_params = args.hidden * (2 * q + 2 * kv) + 3 * args.hidden * args.intermediate
    t = args.tokens
    linear = 2.0 * per_layer_params * t
    attention = 2.0 * t * t * q  # (4 T^2 q) / 2 for causal
    return args.model_layers * (linear + attention)


def matmul_rate(device: str, torch) -> tuple[float, str]:
    """Measured bf16 matmul FLOP/s on device (CUDA: 8192^3, mean of 10 after 3 warm-ups)."""
    n, iters = (8192, 10) if device.startswith("cuda") else (512, 3)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device, torch)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device, torch)
    elapsed = (time.perf_counter() - t0) / iters
    return 2.0 * n**3 / elapsed, f"{n}^3 {str(dtype).removeprefix('torch.')}"


def _sync(device: str, torch) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_s(torch, nbytes: int, src_on: str, dst_on: str, repeats: int, sync) -> float:
    """Median time of one contiguous torch copy of nbytes (src_on "pinned": host memory)."""
    if src_on == "pinned":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, device=src_on)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_on)
    return _median_s(lambda: dst.copy_(src, non_blocking=True), repeats, sync)


def _pool_copies_s(torch, kv, nbytes: int, device: str, offsets, ids, repeats: int, sync):
    """(save, load) median times of BlockCopier between the cache and a pool on device."""
    from kvstore_connectors.vllm.copier import BlockCopier

    pool = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    copier = BlockCopier(kv)
    save_s = _median_s(lambda: copier.save(pool, offsets, ids), repeats, sync)
    load_s = _median_s(lambda: copier.load(pool, offsets, ids), repeats, sync)
    return save_s, load_s


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstore_connectors.vllm.copier import BlockCopier, PagedKV

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if args.quick or not cuda:
        args.tokens, args.layers, args.repeats = min(args.tokens, 4096), min(args.layers, 2), 2
    dtype = torch.bfloat16
    layers = min(args.layers, args.model_layers)
    scale = args.model_layers / layers
    prefix_blocks = math.ceil(args.tokens / args.block_size)
    num_blocks = prefix_blocks + 64  # the cache holds other requests' blocks too
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    rng = np.random.default_rng(0)
    ids = rng.permutation(num_blocks)[:prefix_blocks].astype(np.int64)  # scattered, as vLLM's
    cache = [
        (f"model.layers.{i}.self_attn.attn", torch.randn(shape, device=device).to(dtype))
        for i in range(layers)
    ]
    kv = PagedKV.from_layers(cache, num_blocks)
    block_bytes = kv.block_bytes
    nbytes = prefix_blocks * block_bytes
    offsets = np.arange(prefix_blocks, dtype=np.int64) * block_bytes
    rate, rate_what = matmul_rate(device, torch)
    prefill_s = prefill_flops(args) / rate
    print(
        f"bench gpu_copier: {device}, {args.tokens} tokens = {prefix_blocks} blocks of "
        f"{args.block_size}; {layers} of {args.model_layers} layers materialised "
        f"({nbytes / GiB:.2f} GiB here, {nbytes * scale / GiB:.2f} GiB for the model); "
        f"matmul {rate / 1e12:.1f} TFLOP/s ({rate_what}) -> prefill {prefill_s:.2f} s",
        flush=True,
    )
    sync = lambda: _sync(device, torch)  # noqa: E731
    note = f"{layers} of {args.model_layers} layers timed, x{scale:g}; {args.tokens} tokens"
    figures = [
        Figure(
            figure="bf16 matmul rate (the prefill reference)",
            value=rate / 1e12,
            unit="TFLOP/s",
            note=f"{rate_what}; prefill of {args.tokens} tokens = {prefill_s:.2f} s",
        )
    ]

    # Reference: one contiguous torch copy of the same bytes on the device.
    ref_s = _copy_s(torch, nbytes, device, device, args.repeats, sync)

    def rows(name: str, seconds: float, ref_what: str) -> None:
        whole = seconds * scale
        figures.append(
            Figure(
                figure=f"{name}: 195k-token prefix vs prefill"
                if args.tokens == 195_000
                else f"{name}: {args.tokens}-token prefix vs prefill",
                value=whole,
                unit="s",
                reference=prefill_s,
                reference_what="bf16 prefill at the measured matmul rate",
                ratio=prefill_s / whole,
                goal=10.0,
                note=f"{gbps(nbytes, seconds):.1f} GB/s; {note}",
            )
        )
        figures.append(
            Figure(
                figure=f"{name}: rate vs a torch copy",
                value=gbps(nbytes, seconds),
                unit="GB/s",
                reference=gbps(nbytes, ref_s),
                reference_what=ref_what,
                ratio=ref_s / seconds,
                note=note,
            )
        )

    # tier "gpu": pool on the same device, BlockCopier device to device.
    save_s, load_s = _pool_copies_s(torch, kv, nbytes, device, offsets, ids, args.repeats, sync)
    where = "device to device" if cuda else "host mode"
    rows(f"load, GPU pool -> cache ({where})", load_s, "contiguous torch copy on the device")
    rows(f"save, cache -> GPU pool ({where})", save_s, "contiguous torch copy on the device")

    # tier "dram": CudaBlockCopier, side stream, per-layer events, pinned staging.
    if not cuda:
        for what in ("load, DRAM -> cache", "save, cache -> DRAM"):
            figures.append(
                Figure(
                    figure=f"{what} (CudaBlockCopier, side stream)",
                    value=None,
                    unit="s",
                    note="needs CUDA: not measured",
                )
            )
    else:
        from kvstore_connectors.vllm.cuda import CudaBlockCopier

        region = torch.zeros(nbytes, dtype=torch.uint8)  # the daemon's region is host memory
        cuda_copier = CudaBlockCopier(kv)
        names = [name for name, _ in cache]

        def load() -> None:
            cuda_copier.load(region, offsets, ids)
            for name in names:  # what each attention layer does before reading its KV
                cuda_copier.wait_layer(name)

        def save() -> None:
            cuda_copier.begin_save(region, offsets, ids)
            for name in names:  # as vLLM calls save_kv_layer after each layer
                cuda_copier.save_layer(name)
            cuda_copier.finish_save()

        # the DRAM rows compare with one pinned H2D copy of the same bytes
        ref_s = _copy_s(torch, nbytes, "pinned", device, args.repeats, sync)
        save_s = _median_s(save, args.repeats, sync)
        load_s = _median_s(load, args.repeats, sync)
        rows("load, DRAM -> cache (CudaBlockCopier, side stream)", load_s, "pinned H2D torch copy")
        rows("save, cache -> DRAM (CudaBlockCopier, side stream)", save_s, "pinned H2D torch copy")
        # the bytes survive the round trip (save then load into a zeroed cache)
        for _, t in cache:
            t.zero_()
        load()
        sync()
        check = torch.zeros(block_bytes, dtype=torch.uint8)
        BlockCopier(PagedKV.from_layers([(n, t.cpu()) for n, t in cache], num_blocks)).save(
            check, np.array([0]), ids[:1]
        )
        if not torch.equal(check, region[:block_bytes]):
            print("bench gpu_copier: FAILED: a block read back differs from the one saved")
            return 1
    for fig in figures:
        value = "not measured" if fig.value is None else f"{fig.value:.3f} {fig.unit}"
        ratio = "" if fig.ratio is None else f"  ratio {fig.ratio:.2f}x"
        print(f"  {fig.figure}: {value}{ratio}  ({fig.note})")
    write_figures(args.figures, figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
