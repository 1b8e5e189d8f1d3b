"""`kvstore-bench sglang`: SGLang HiCache storage, kvstore backend vs SGLang's file backend.

Starts a daemon in a temp dir, then runs kvstore_bench/sglang_side.py in .venv-sglang
(scripts/setup_sglang_venv.sh): the same pages of one real SGLang host pool
stored and loaded in SGLang's 128-page batches through the kvstore backend
(zero-copy ``batch_*_v1``) and through ``HiCacheFile`` (its generic path).
Prints pages/s and GB/s medians with their spread (p10..p90 / median), the
ratio kvstore / file per direction (same run, interleaved), and the load
average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

from kvstore_bench._common import env_python, repo_root, results_dir, summarize, write_json

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=256, help="host pages moved per repetition")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layout", default="page_first", help="SGLang --hicache-mem-layout")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--file-dir", default="", help="HiCacheFile's folder (default: a temp dir)")
    p.add_argument("--results", default="results", help="folder for the JSON report")
    p.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (smoke)")


def run(args: argparse.Namespace) -> int:
    from kvstore.process import DaemonProcess

    py = env_python("sglang")
    if not py:
        print("kvstore-bench sglang: no .venv-sglang: run bash scripts/setup_sglang_venv.sh")
        return 2
    if args.quick:
        args.pages, args.reps, args.layers = 32, 3, 2
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvs-sglang-bench-") as tmp:
        # Room for one repetition's pages twice over (each repetition clears).
        page_bytes = args.page_size * args.layers * args.heads * args.dim * 2 * 2
        dram = max(64 * MiB, 2 * args.pages * page_bytes + 64 * MiB)
        daemon = DaemonProcess(tmp, name="bench", dram_bytes=dram, tcp=False)
        daemon.start()
        try:
            cmd = [
                py,
                "-m",
                "kvstore_bench.sglang_side",
                "--address",
                daemon.address,
                "--pages",
                str(args.pages),
                "--page-size",
                str(args.page_size),
                "--layers",
                str(args.layers),
                "--heads",
                str(args.heads),
                "--dim",
                str(args.dim),
                "--layout",
                args.layout,
                "--reps",
                str(args.reps),
            ]
            if args.file_dir:
                cmd += ["--file-dir", args.file_dir]
            env = {**os.environ, "PYTHONPATH": str(repo_root()), "CUDA_VISIBLE_DEVICES": ""}
            out = subprocess.run(
                cmd, check=True, capture_output=True, text=True, env=env, cwd=str(repo_root())
            )
        finally:
            daemon.stop()
            daemon.remove_region()
    load_end = os.getloadavg()
    data = json.loads(out.stdout)
    pages, page_bytes = data["pages"], data["page_bytes"]
    total = pages * page_bytes
    print(
        f"SGLang HiCache storage: {pages} pages x {page_bytes / 1024:.0f} KiB "
        f"({data['layout']}), {args.reps} reps, batches of 128; "
        f"load {load_start[0]:.1f} -> {load_end[0]:.1f} (1-min avg)"
    )
    print(f"file backend folder: {data['file_dir']}")
    report: dict[str, object] = {"data": data, "load_avg": [load_start, load_end]}
    medians: dict[str, float] = {}
    for name, samples in data["seconds"].items():
        s = summarize(samples)
        medians[name] = s.median_s
        report[name] = {
            "median_s": s.median_s,
            "spread": s.spread,
            "pages_per_s": pages / s.median_s,
            "gb_per_s": total / s.median_s / 1e9,
        }
        print(
            f"  {name:12s} {pages / s.median_s:10.0f} pages/s  {total / s.median_s / 1e9:6.2f} GB/s"
            f"  (spread {s.spread:.0%})"
        )
    for op in ("set", "get"):
        ratio = medians[f"file_{op}"] / medians[f"kvstore_{op}"]
        report[f"ratio_{op}"] = ratio
        print(f"  kvstore / file, {op}: x{ratio:.2f}")
    write_json(results_dir(args.results, "sglang") / "sglang.json", report)
    return 0
