"""The GPU half of scripts/gpu_check.sh: every CUDA path once, figures in one summary.

Steps, each a child process with its own time limit inside one overall budget
(a step that hangs or crashes costs its limit and the others still run):

1. versions: driver, GPU, CUDA, torch, cupy, NIXL, the wire packages;
2. the ``gpu``-marked tests (tests/gpu: tier IPC, client CUDA tensors, connector copier);
3. ``kvstore-bench gpu``: promotion/demotion HBM <-> pinned DRAM vs a torch copy,
   page-locking cost, device-to-device put/get through a daemon's IPC mapping;
4. ``kvstore_bench.gpu_copier``: the connector's copies of a 195k-token prefix vs its prefill;
5. ``kvstore_bench.gpu_nixl``: NIXL READs from VRAM between two processes, if NIXL loads;
6. ``vllm-spec``: EAGLE and MTP speculative decoding through the vLLM connector
   (tests/gpu/test_vllm_spec_decode.py: eight engine starts), where vLLM's GPU build
   is installed (skipped otherwise, and in host mode). Eight engines take minutes:
   on the device machine run it alone (``--only vllm-spec --budget-s 560``).

Writes to ``--out``: summary.md (the table and the versions), summary.json,
gpu_check.log (every step's output). ``--host`` runs the same steps without CUDA
(host mode, small sizes): what CI runs to keep this script working.

    python -m kvstore_bench.gpu_check --out DIR [--host] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Standard library only up here: the module check below must be able to say what is
# missing in one line, before numpy or msgspec are imported.
if TYPE_CHECKING:
    from kvstore_bench._common import Figure

# Modules a run needs; a missing one is named in one line before anything starts.
REQUIRED = (
    "numpy",
    "msgspec",
    "zmq",
    "grpc",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "google.protobuf",
    "xxhash",
    "prometheus_client",
    "torch",
    "pytest",
    "kvstore.v1.store_pb2_grpc",  # checks protobuf/grpcio against the generated code
    "kvstore.server",
    "kvstore_connectors.vllm.copier",
)

# (name, limit in seconds on a GPU) of each step; host mode divides nothing: its sizes are small.
STEP_LIMITS_S = {
    "versions": 60,
    "tests": 180,
    "bench-gpu": 150,
    "copier": 150,
    "nixl": 100,
    "vllm-spec": 540,
}
VLLM_SPEC_TESTS = "tests/gpu/test_vllm_spec_decode.py"
RESERVE_S = 10.0  # kept back for the summary


@dataclass
class Step:
    name: str
    command: list[str]
    rc: int | None = None  # None: not run
    elapsed_s: float = 0.0
    status: str = "not run"  # ok | failed (rc N) | timed out after N s | skipped: why
    tail: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=False, default="", help="output folder (default: $OUT)")
    p.add_argument("--host", action="store_true", help="no CUDA: host mode, small sizes")
    p.add_argument("--budget-s", type=float, default=420.0, help="hard limit for all steps")
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--versions-json", default="", help=argparse.SUPPRESS)


def missing_modules() -> list[str]:
    missing = []
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or generated code refusing an old runtime
            missing.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
    return missing


def versions() -> dict[str, Any]:
    """What a reader needs to compare runs; each probe fails alone, into its value."""
    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        out["nvidia-smi"] = smi.stdout.strip() or smi.stderr.strip() or f"rc {smi.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvidia-smi"] = f"not available ({type(exc).__name__})"
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch CUDA"] = str(torch.version.cuda)
        out["CUDA available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["device"] = (
                f"{props.name}, {props.total_memory / 2**30:.0f} GiB, cc {props.major}.{props.minor}"
            )
    except Exception as exc:
        out["torch"] = f"failed: {exc}"
    try:
        import cupy

        out["cupy"] = cupy.__version__
        rt = cupy.cuda.runtime
        out["cupy CUDA runtime / driver"] = f"{rt.runtimeGetVersion()} / {rt.driverGetVersion()}"
    except Exception as exc:
        out["cupy"] = f"not usable: {type(exc).__name__}: {str(exc)[:160]}"
    try:
        from kvstore.transfer.nixl_agent import load_nixl

        cls, _ = load_nixl()
        out["nixl"] = cls.__module__
    except Exception as exc:
        out["nixl"] = f"does not load: {str(exc)[:300]}"
    for name in ("grpc", "google.protobuf", "msgspec", "zmq", "numpy"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as exc:
            out[name] = f"absent ({type(exc).__name__})"
    return out


def _steps(args: argparse.Namespace, py: str, figures: Path, versions_path: Path) -> list[Step]:
    dev = "cpu" if args.host else "cuda:0"
    quick = ["--quick"] if args.host else []
    tests = [py, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rA", "-s"]
    # the vLLM engines have a step of their own (minutes, and only where vLLM is)
    tests += ["-p", "no:cacheprovider", "-o", "addopts=", "--ignore", VLLM_SPEC_TESTS]
    spec = [py, "-m", "pytest", "-m", "gpu", VLLM_SPEC_TESTS, "-q", "-rA"]
    spec += ["-p", "no:cacheprovider", "-o", "addopts="]
    try:
        importlib.import_module("pytest_timeout")
        tests += ["--timeout", "90"]  # one hung test fails alone, the others still run
        spec += ["--timeout", "270"]
    except ImportError:
        pass
    bench = [py, "-m", "kvstore_bench", "gpu", "--device", dev, "--figures", str(figures)]
    if not args.host:
        bench += ["--context-bytes", str(1 << 30), "--repeats", "5"]
    return [
        Step(
            name="versions",
            command=[py, "-m", "kvstore_bench.gpu_check", "--versions-json", str(versions_path)],
        ),
        Step(name="tests", command=tests),
        Step(name="bench-gpu", command=bench + quick),
        Step(
            name="copier",
            command=[
                py,
                "-m",
                "kvstore_bench.gpu_copier",
                "--device",
                dev,
                "--figures",
                str(figures),
            ]
            + quick,
        ),
        # 30 s per read and reply: two destinations that hang still end inside the limit
        Step(
            name="nixl",
            command=[
                py,
                "-m",
                "kvstore_bench.gpu_nixl",
                "--figures",
                str(figures),
                "--timeout-s",
                "30",
            ]
            + quick,
        ),
        Step(name="vllm-spec", command=spec),
    ]


def _skip_why(step: Step, host: bool) -> str:
    """Why ``step`` cannot run here ("" = it can); "skipped: not ..." is no failure."""
    if step.name != "vllm-spec":
        return ""
    if host:
        return (
            "skipped: not in host mode (the CPU build runs the same engines:"
            " tests/integration/test_vllm_spec_drafters.py)"
        )
    if importlib.util.find_spec("vllm") is None:
        return "skipped: not installed here: vLLM's GPU build (pip install vllm==0.33.0)"
    return ""


def run_step(step: Step, limit_s: float, log: Any) -> None:
    log.write(f"\n===== {step.name}: {' '.join(step.command)} (limit {limit_s:.0f} s)\n")
    log.flush()
    print(f"gpu_check: {step.name} (limit {limit_s:.0f} s)", flush=True)
    t0 = time.monotonic()
    # A session of its own, so a timeout ends the step's children too (daemons, NIXL peers).
    proc = subprocess.Popen(
        step.command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=limit_s)
        step.rc = proc.returncode
        step.status = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        step.rc = -9
        step.status = f"timed out after {limit_s:.0f} s"
    step.elapsed_s = time.monotonic() - t0
    log.write(out or "")
    log.write(f"===== {step.name}: {step.status} in {step.elapsed_s:.1f} s\n")
    log.flush()
    lines = (out or "").rstrip().splitlines()
    step.tail = "\n".join(lines[-15:])
    if step.name == "tests":  # pytest's closing line: "3 passed, 1 skipped in 2.1s"
        step.tail = next(
            (ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", ln)),
            step.tail,
        )
    print(f"gpu_check: {step.name}: {step.status} in {step.elapsed_s:.1f} s", flush=True)


def _test_counts(tail: str) -> tuple[int, int]:
    """(passed, total) from pytest's closing line."""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail)}
    passed = counts.get("passed", 0)
    total = passed + sum(counts.get(k, 0) for k in ("failed", "error", "errors", "skipped"))
    return passed, total


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if abs(v) < 1e5 else f"{v:.3g}"


def summary_md(vers: dict[str, Any], steps: list[Step], figures: list[Figure], host: bool) -> str:
    lines = [
        "# kvstore GPU check" + (" (host mode: no CUDA, small sizes)" if host else ""),
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        "",
        "| figure | value | reference | ratio | goal | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures:
        value = "not measured" if f.value is None else f"{_fmt(f.value)} {f.unit}"
        ref = "-" if f.reference is None else f"{_fmt(f.reference)} ({f.reference_what})"
        ratio = "-" if f.ratio is None else f"{f.ratio:.2f}x"
        goal = "-"
        if f.goal is not None:
            met = f.ratio is not None and f.ratio >= f.goal
            goal = f">= {f.goal:g}x " + ("met" if met else "NOT met")
        note = f.note.replace("|", "/").replace("\n", " ")
        lines.append(f"| {f.figure} | {value} | {ref} | {ratio} | {goal} | {note} |")
    lines += ["", "| step | status | seconds |", "| --- | --- | --- |"]
    for s in steps:
        lines.append(f"| {s.name} | {s.status} | {s.elapsed_s:.1f} |")
    lines += ["", "| version | |", "| --- | --- |"]
    for k, v in vers.items():
        lines.append(f"| {k} | {str(v).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.versions_json:
        Path(args.versions_json).write_text(json.dumps(versions(), indent=2))
        return 0
    repo = Path(__file__).resolve().parent.parent
    out = Path(args.out or os.environ.get("OUT", "") or "results/gpu-check").resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(repo)  # the steps name tests/gpu and run kvstore_bench.* from the tree
    missing = missing_modules()
    if missing:
        print(f"gpu_check: cannot start, missing or unusable: {'; '.join(missing)}")
        (out / "summary.md").write_text(f"# kvstore GPU check\n\nmissing: {missing}\n")
        return 4
    import msgspec

    from kvstore_bench._common import Figure

    if not args.host:
        import torch

        if not torch.cuda.is_available():
            print(
                f"gpu_check: GPU half skipped: torch {torch.__version__} sees no CUDA device "
                "(run with --host for the host-mode dry run)"
            )
            return 3
    # Steps' figures go to a scratch folder: the output folder holds three files only
    # (the device machine brings back at most eight).
    work = Path(tempfile.mkdtemp(prefix="kvstore-gpu-check-"))
    figures_path = work / "figures.jsonl"
    versions_path = work / "versions.json"
    py = sys.executable
    steps = _steps(args, py, figures_path, versions_path)
    only = {s for s in args.only.split(",") if s}
    deadline = time.monotonic() + args.budget_s
    with open(out / "gpu_check.log", "w") as log:
        for step in steps:
            if only and step.name not in only:
                step.status = "skipped: not asked for (--only)"
                continue
            why = _skip_why(step, args.host)
            if why:
                step.status = why
                print(f"gpu_check: {step.name}: {step.status}")
                continue
            left = deadline - time.monotonic() - RESERVE_S
            if left < 15:
                step.status = f"skipped: the {args.budget_s:.0f} s budget is spent"
                print(f"gpu_check: {step.name}: {step.status}")
                continue
            run_step(step, min(STEP_LIMITS_S[step.name], left), log)
    vers: dict[str, Any] = {}
    if versions_path.exists():
        vers = json.loads(versions_path.read_text())
    figures: list[Figure] = []
    tests = next(s for s in steps if s.name == "tests")
    if tests.rc is not None:
        passed, total = _test_counts(tests.tail)
        figures.append(
            Figure(
                figure="gpu-marked tests (tests/gpu) passed",
                value=float(passed),
                unit="tests",
                reference=float(total),
                reference_what="collected",
                ratio=passed / total if total else None,
                goal=1.0,
                note=tests.tail.strip("= "),
            )
        )
    if figures_path.exists():
        for line in figures_path.read_bytes().splitlines():
            if line.strip():
                figures.append(msgspec.json.decode(line, type=Figure))
    shutil.rmtree(work, ignore_errors=True)
    md = summary_md(vers, steps, figures, args.host)
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_bytes(
        msgspec.json.format(
            msgspec.json.encode(
                {"versions": vers, "steps": [asdict(s) for s in steps], "figures": figures}
            ),
            indent=2,
        )
    )
    print(md)
    failed = [
        s for s in steps if s.status not in ("ok",) and not s.status.startswith("skipped: not")
    ]
    for s in failed:
        print(f"gpu_check: step {s.name} {s.status}; its last lines:\n{s.tail}")
    print(f"gpu_check: summary in {out}/summary.md; every step's output in {out}/gpu_check.log")
    return 0 if not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
