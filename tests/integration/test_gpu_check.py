"""scripts/gpu_check.sh without a GPU: the CPU half (wheel list, size check) and the
GPU half's steps in host mode, as CI runs them; the GPU half proper says in one line
that it needs CUDA. The size check is the real one: the repository's own tree plus
a wheel folder, against the 64 MiB that travels to the GPU machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# scripts/ is no package: load the module by path rather than put scripts/ on sys.path.
_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
assert _spec is not None and _spec.loader is not None
gpu_wheels = importlib.util.module_from_spec(_spec)
sys.modules["gpu_wheels"] = gpu_wheels  # its dataclasses look their module up there
_spec.loader.exec_module(gpu_wheels)

MiB = 1 << 20


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["GPU_PYTHON"] = sys.executable
    env["PYTHON"] = sys.executable
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CI machine with a GPU still runs the dry run
    env.pop("OUT", None)
    env.update(extra)
    return env


def _run(*args: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _fixture_wheels(folder: Path) -> Path:
    """One small file per listed wheel, named as pip saves it."""
    folder.mkdir()
    for w in gpu_wheels.WHEELS:
        (folder / f"{w.dist}-{w.version}-py3-none-any.whl").write_bytes(b"x" * 1000)
    return folder


def test_dry_run_lists_the_wheels_checks_the_size_and_skips_the_gpu_half(tmp_path):
    wheels = _fixture_wheels(tmp_path / "whl")
    out = _run("--wheels", str(wheels))
    assert out.returncode == 0, out.stdout + out.stderr
    for w in gpu_wheels.WHEELS:
        assert f"{w.name}=={w.version}" in out.stdout
    tree = gpu_wheels.tree_bytes(ROOT)
    assert tree > 100_000  # the real tracked tree, not the fixture
    assert f"tree {tree / MiB:.2f} MiB + wheels" in out.stdout
    assert "gpu_wheels: OK" in out.stdout
    skipped = [ln for ln in out.stdout.splitlines() if "GPU half skipped" in ln]
    assert len(skipped) == 1 and "no CUDA device" in skipped[0]


def test_size_check_refuses_a_tree_that_would_not_travel(tmp_path):
    wheels = _fixture_wheels(tmp_path / "whl")
    tree = gpu_wheels.tree_bytes(ROOT)
    # One wheel grows so that tree + wheels is one byte over the limit (sparse: no disk used).
    big = next(wheels.glob("nixl_cu13-*.whl"))
    others = sum(p.stat().st_size for p in wheels.glob("*.whl") if p != big)
    with open(big, "r+b") as f:
        f.truncate(gpu_wheels.LIMIT_BYTES - tree - others + 1)
    out = _run("--check", "--wheels", str(wheels))
    assert out.returncode == 1, out.stdout
    assert "over the 67108864-byte limit of what travels" in out.stdout
    assert "NOT READY" in out.stdout
    with open(big, "r+b") as f:
        f.truncate(gpu_wheels.LIMIT_BYTES - tree - others)  # exactly at the limit: fits
    assert _run("--check", "--wheels", str(wheels)).returncode == 0


def test_missing_twice_and_wrong_wheels_are_named(tmp_path):
    wheels = _fixture_wheels(tmp_path / "whl")
    next(wheels.glob("pyzmq-*.whl")).unlink()
    (wheels / "msgspec-0.1.0-py3-none-any.whl").write_bytes(b"x")
    (wheels / "requests-2.0-py3-none-any.whl").write_bytes(b"x")
    out = _run("--check", "--wheels", str(wheels))
    assert out.returncode == 1
    assert "pyzmq==27.3.0 is missing" in out.stdout
    assert "msgspec: 2 wheels" in out.stdout and "keep one" in out.stdout
    assert "unexpected wheel(s) ['requests-2.0-py3-none-any.whl']" in out.stdout
    assert "bash scripts/gpu_check.sh --fetch" in out.stdout


def _fake_nixl_wheel(folder: Path) -> Path:
    """A minimal installable wheel laid out like nixl-cu13's (with its nixl_ep_cu13 part)."""
    path = folder / "nixl_cu13-1.5.1-py3-none-any.whl"
    files = {
        "nixl_cu13/__init__.py": "VALUE = 13\n",
        "nixl_ep_cu13/__init__.py": "",
        "nixl_ep_cu13/big.so": "\0" * 100_000,
        "nixl_cu13.scripts/telemetry_reader": "#!/bin/sh\n",
        "nixl_cu13-1.5.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: nixl-cu13\nVersion: 1.5.1\n",
        "nixl_cu13-1.5.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "nixl_cu13-1.5.1.dist-info/top_level.txt": "nixl_cu13\nnixl_ep_cu13\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "nixl_cu13-1.5.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("nixl_cu13-1.5.1.dist-info/RECORD", record)
    return path


def test_slimmed_nixl_wheel_installs_without_its_unused_parts(tmp_path):
    wheel = _fake_nixl_wheel(tmp_path)
    assert gpu_wheels.slim_nixl(wheel) > 0
    assert gpu_wheels.slim_nixl(wheel) == 0  # already slim: left alone
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("nixl_cu13-1.5.1.dist-info/RECORD").decode()
    assert not [n for n in names if n.startswith(("nixl_ep_cu13/", "nixl_cu13.scripts/"))]
    assert "nixl_ep_cu13" not in record and "nixl_cu13/__init__.py" in record
    # pip takes it offline, as the GPU half installs it
    site = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        + ["--disable-pip-version-check", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert pip.returncode == 0, pip.stderr
    assert (site / "nixl_cu13" / "__init__.py").exists()
    assert not (site / "nixl_ep_cu13").exists()


def test_gpu_half_without_cuda_says_so_in_one_line():
    out = _run("--gpu")
    assert out.returncode == 3
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "GPU half skipped" in lines[0] and "no CUDA device" in lines[0]


def test_a_missing_package_is_named_in_one_line_not_a_traceback(tmp_path):
    shadow = tmp_path / "shadow" / "xxhash"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed here')\n")
    out = _run(
        "--host", "--out", str(tmp_path / "out"), PYTHONPATH=f"{shadow.parent}{os.pathsep}{ROOT}"
    )
    assert out.returncode == 4, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "cannot start" in ln]
    assert "xxhash (ImportError: simulated: not installed here)" in line


@pytest.mark.slow
def test_host_mode_runs_every_step_and_writes_the_summary(tmp_path):
    """Every step of the GPU half (tests, bench gpu with IPC put/get, the copier, NIXL)
    runs in host mode and lands in one table; at most 8 flat files, as the GPU machine
    brings back."""
    pytest.importorskip("torch")
    out_dir = tmp_path / "out"
    out = _run("--host", "--out", str(out_dir), "--budget-s", "500", timeout_s=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    files = sorted(p.name for p in out_dir.rglob("*"))
    assert files == ["gpu_check.log", "summary.json", "summary.md"]
    summary = (out_dir / "summary.md").read_text()
    for row in (
        "gpu-marked tests (tests/gpu) passed",
        "promotion DRAM -> GPU (host mode",
        "demotion GPU -> DRAM (host mode",
        "page-locking a host region (cudaHostRegister) | not measured",
        "put through the pool's IPC mapping",
        "get through the pool's IPC mapping",
        "mapping the pool in a client",
        "bf16 matmul rate",
        "load, GPU pool -> cache (host mode)",
        "save, cache -> GPU pool (host mode)",
        "load, DRAM -> cache (CudaBlockCopier, side stream) | not measured",
        "NIXL READ DRAM -> DRAM, two processes",
        "| torch CUDA | None |",
    ):
        assert row in summary, row
    for step in ("versions", "tests", "bench-gpu", "copier", "nixl"):
        assert f"| {step} | ok |" in summary
    # the EAGLE/MTP engines on CUDA: said, not run, no failure
    assert "| vllm-spec | skipped: not in host mode" in summary
