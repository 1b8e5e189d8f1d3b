"""The CPU half of scripts/gpu_check.sh: the wheels the GPU machine lacks, and the size check.

The GPU machine (docs/gpu.md) has Python 3.12 with torch, cupy, numpy, grpcio,
protobuf, xxhash, prometheus-client, pytest and hypothesis, and no network. What
kvstore needs beyond that travels as cp312 manylinux x86_64 wheels in one ignored
folder, next to the working tree, and all of it must fit the 64 MiB that travels.

    python3 scripts/gpu_wheels.py fetch [--wheels DIR]   download what is missing, slim nixl
    python3 scripts/gpu_wheels.py check [--wheels DIR]   list, versions, size (exit 1 if wrong)

Standard library only: it runs before anything is installed.

grpcio and protobuf travel too, although the GPU machine has both: the committed
generated code (kvstore/v1/*_pb2*.py) refuses protobuf older than 7.35.1 and
grpcio older than 1.85.1, and the image's versions are not known in advance.
The carried ones are installed in front of the image's (PYTHONPATH), so the run
uses the versions CI tests.

nixl-cu13's wheel (58.8 MB) is slimmed to ~31 MB on download: it bundles
``nixl_ep_cu13`` (expert-parallel kernels, three 9 MB builds for torch 2.12..2.14)
that kvstore never imports. The slim wheel keeps its name; its RECORD drops the
removed files, so pip installs it as usual.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024
# What the device machine takes in one call: working tree + carried paths (docs/gpu.md).
LIMIT_BYTES = 64 * MiB
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".whl"


@dataclass(frozen=True)
class Wheel:
    name: str  # as pip spells it
    version: str
    why: str

    @property
    def dist(self) -> str:
        """The name as a wheel's file name spells it (PEP 427: lower case, '_')."""
        return self.name.lower().replace("-", "_").replace(".", "_")


WHEELS: tuple[Wheel, ...] = (
    Wheel("msgspec", "0.23.0", "missing there: wire structs, events"),
    Wheel("pyzmq", "27.3.0", "missing there: KV events (ZMQ PUB)"),
    Wheel("grpcio-health-checking", "1.85.1", "missing there: grpc.health.v1"),
    Wheel("grpcio-reflection", "1.85.1", "missing there: gRPC reflection"),
    Wheel("grpcio", "1.85.3", "there, maybe too old: generated code needs >= 1.85.1"),
    Wheel("protobuf", "7.36.2", "there, maybe too old: generated code needs 7.x >= 7.35.1"),
    Wheel("nixl-cu13", "1.5.1", "missing there: NIXL for CUDA 13 (slimmed)"),
)

# Paths inside nixl-cu13's wheel that kvstore never loads (see the module docstring).
NIXL_DROP_PREFIXES = ("nixl_ep_cu13/", "nixl_cu13.scripts/")

PIP_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def _wheel_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.whl")) if folder.is_dir() else []


def _parse(path: Path) -> tuple[str, str]:
    """(distribution, version) from a wheel's file name."""
    parts = path.name.split("-")
    if len(parts) < 5:
        raise ValueError(f"{path.name}: not a wheel file name")
    return parts[0].lower(), parts[1]


def slim_nixl(path: Path) -> int:
    """Rewrite nixl-cu13's wheel without the parts kvstore never loads; bytes saved."""
    before = path.stat().st_size
    with zipfile.ZipFile(path) as src:
        names = src.namelist()
        if not any(n.startswith(NIXL_DROP_PREFIXES) for n in names):
            return 0  # already slim
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".whl.part")
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in src.infolist():
                    if info.filename.startswith(NIXL_DROP_PREFIXES):
                        continue
                    data = src.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines()
                        kept = [ln for ln in lines if not ln.startswith(NIXL_DROP_PREFIXES)]
                        data = ("\n".join(kept) + "\n").encode()
                    elif info.filename.endswith(".dist-info/top_level.txt"):
                        lines = data.decode().splitlines()
                        data = ("\n".join(x for x in lines if x != "nixl_ep_cu13") + "\n").encode()
                    dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return before - path.stat().st_size


def fetch(folder: Path, python: str = sys.executable) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    have = {_parse(p) for p in _wheel_files(folder)}
    for wheel in WHEELS:
        if (wheel.dist, wheel.version) in have:
            continue
        cmd = [
            python,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *(arg for plat in PIP_PLATFORMS for arg in ("--platform", plat)),
            "-d",
            str(folder),
            f"{wheel.name}=={wheel.version}",
        ]
        print(f"gpu_wheels: downloading {wheel.name}=={wheel.version}", flush=True)
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            print(f"gpu_wheels: pip download {wheel.name}=={wheel.version} failed (rc {rc})")
            return 1
    for path in _wheel_files(folder):
        if _parse(path)[0] == "nixl_cu13":
            saved = slim_nixl(path)
            if saved:
                print(f"gpu_wheels: slimmed {path.name} by {saved / MiB:.1f} MiB")
    return 0


def tree_bytes(root: Path) -> int:
    """Bytes of what travels besides carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in {n for n in out.decode().split("\0") if n}:
        path = root / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def check(folder: Path, root: Path = ROOT, limit_bytes: int = LIMIT_BYTES) -> int:
    """Print the wheel list and the size budget; 0 when both are right, else 1."""
    problems: list[str] = []
    found: dict[str, list[tuple[Path, str]]] = {}
    for path in _wheel_files(folder):
        try:
            dist, version = _parse(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        found.setdefault(dist, []).append((path, version))
    wanted = {w.dist for w in WHEELS}
    print(f"gpu_wheels: wheels in {folder}")
    for wheel in WHEELS:
        have = found.get(wheel.dist, [])
        if not have:
            state = "MISSING"
            problems.append(f"{wheel.name}=={wheel.version} is missing")
        elif len(have) > 1:
            state = "TWICE"
            problems.append(
                f"{wheel.name}: {len(have)} wheels ({', '.join(p.name for p, _ in have)}); "
                "keep one (two stop the whole install)"
            )
        elif have[0][1] != wheel.version:
            state = f"WRONG {have[0][1]}"
            problems.append(f"{wheel.name}: {have[0][1]} found, {wheel.version} wanted")
        else:
            state = f"{have[0][0].stat().st_size / MiB:6.2f} MiB"
        print(f"  {wheel.name + '==' + wheel.version:32s} {state:>12s}  {wheel.why}")
    for dist in sorted(set(found) - wanted):
        problems.append(f"unexpected wheel(s) {[p.name for p, _ in found[dist]]}: remove them")
    wheel_total = sum(p.stat().st_size for p in _wheel_files(folder))
    tree = tree_bytes(root)
    total = tree + wheel_total
    print(
        f"gpu_wheels: size: tree {tree / MiB:.2f} MiB + wheels {wheel_total / MiB:.2f} MiB = "
        f"{total / MiB:.2f} MiB of {limit_bytes / MiB:.0f} MiB"
    )
    if total > limit_bytes:
        problems.append(
            f"tree + wheels = {total} bytes, over the {limit_bytes}-byte limit of what travels "
            f"(by {(total - limit_bytes) / MiB:.2f} MiB)"
        )
    for problem in problems:
        print(f"gpu_wheels: PROBLEM: {problem}")
    if any("missing" in p for p in problems):
        print(
            "gpu_wheels: fetch them (network to the package index): bash scripts/gpu_check.sh --fetch"
        )
    print(f"gpu_wheels: {'OK' if not problems else 'NOT READY'}")
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("fetch", "check"))
    parser.add_argument("--wheels", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--root", type=Path, default=ROOT, help="the working tree that travels")
    parser.add_argument("--limit-bytes", type=int, default=LIMIT_BYTES)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        if fetch(args.wheels) != 0:
            return 1
        return check(args.wheels, args.root, args.limit_bytes)
    return check(args.wheels, args.root, args.limit_bytes)


if __name__ == "__main__":
    sys.exit(main())
