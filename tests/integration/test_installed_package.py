"""The package as `pip install kvstore` installs it: a wheel built from this tree,
installed (not editable) into a fresh virtual environment that sees the
dependencies but neither the repository nor the editable install.

What users import is what this checks: the top-level names the wheel installs
(kvstore* only: no `bench` or `connectors` beside other packages), the console
scripts, and vLLM's `kv_connector_module_path` resolved by vLLM itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvstore", "kvstore_bench", "kvstore_connectors", "kvstore_router_client"}
OLD_NAMES = ("bench", "connectors", "router_client")  # rename_packages: keep
# Not through PYTHONPATH, the user site or a start-up file: only what the venv holds.
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONUSERBASE")


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 300.0) -> str:
    proc = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


class Installed:
    def __init__(self, wheel: Path, venv: Path, site: Path, env: dict[str, str]) -> None:
        self.wheel, self.venv, self.site, self.env = wheel, venv, site, env
        self.python = venv / "bin" / "python"

    def run(self, args: list[str], timeout_s: float = 300.0) -> str:
        # cwd is the venv's parent, never the repository (`python -c` puts cwd on sys.path).
        return _run(args, self.venv.parent, self.env, timeout_s)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("installed")
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env["PYTHONNOUSERSITE"] = "1"

    # The source as committed or about to be (tracked + untracked, not ignored),
    # copied out: building in the tree would leave build/ and *.egg-info in it.
    files = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT, env
    ).split("\0")
    src = tmp / "src"
    for name in files:
        path = ROOT / name
        if name and path.is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--quiet", "-w", str(dist), str(src)],
        tmp,
        env,
    )
    (wheel,) = dist.glob("kvstore-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    py = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps"]
        + ["--no-index", str(wheel)],
        tmp,
        env,
    )
    site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env
        ).strip()
    )
    # The dependencies: this interpreter's site-packages, after the venv's own
    # (a .pth line only appends a directory: the .pth files in it, among them
    # the editable install's finder for kvstore, are not run).
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "zz_kvstore_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    return Installed(wheel, venv, site, env)


def test_wheel_installs_only_kvstore_names(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
        (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = set(whl.read(top_level).decode().split())
        recorded = {
            line.split(",", 1)[0].split("/", 1)[0]
            for line in whl.read(record).decode().splitlines()
            if line
        }
    dist_info = {n for n in recorded if n.endswith((".dist-info", ".data"))}
    assert declared == PACKAGES
    assert recorded - dist_info == PACKAGES
    # And in the venv: nothing else landed at the top of site-packages.
    ours = {
        p.name
        for p in installed.site.iterdir()
        if p.name.startswith(("kvstore",) + OLD_NAMES) and not p.name.endswith(".dist-info")
    }
    assert ours == PACKAGES


def test_imports_come_from_the_venv_not_the_repository(installed: Installed) -> None:
    probe = (
        "import importlib, importlib.util, json, sys\n"
        f"names = {sorted(PACKAGES)!r}\n"
        "files = {n: importlib.import_module(n).__file__ for n in names}\n"
        f"old = {{n: importlib.util.find_spec(n) is not None for n in {OLD_NAMES!r}}}\n"
        "finders = [type(f).__module__ for f in sys.meta_path]\n"
        "print(json.dumps({'files': files, 'old': old, 'finders': finders}))\n"
    )
    got = json.loads(installed.run([str(installed.python), "-c", probe]))
    for name, file in got["files"].items():
        assert Path(file).is_relative_to(installed.site), f"{name} imported from {file}"
        assert not Path(file).is_relative_to(ROOT), f"{name} imported from the repository"
    assert got["old"] == dict.fromkeys(OLD_NAMES, False), "an old top-level name still imports"
    assert not [f for f in got["finders"] if "editable" in f], got["finders"]


def test_console_scripts(installed: Installed) -> None:
    bin_dir = installed.venv / "bin"
    assert "serve" in installed.run([str(bin_dir / "kvstore"), "--help"])
    out = installed.run([str(bin_dir / "kvstore-bench"), "--help"])
    assert "agentic" in out and "local" in out
    # a subcommand's module loads from the installed kvstore_bench
    assert "--quick" in installed.run([str(bin_dir / "kvstore-bench"), "agentic", "--help"])


@pytest.mark.vllm
def test_vllm_resolves_the_documented_module_path(installed: Installed) -> None:
    """vLLM's own factory, given the kv-transfer-config docs/vllm.md documents."""
    probe = (
        "import json\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        "import kvstore_connectors.vllm as m\n"
        "cfg = KVTransferConfig(kv_connector='KVStoreConnector',\n"
        "    kv_connector_module_path='kvstore_connectors.vllm', kv_role='kv_both')\n"
        "cls = KVConnectorFactory.get_connector_class(cfg)\n"
        "import sys\n"
        "print(json.dumps({'same': cls is m.KVStoreConnector, 'name': cls.__name__,\n"
        "    'v1': issubclass(cls, KVConnectorBase_V1),\n"
        "    'file': sys.modules[cls.__module__].__file__}))\n"
    )
    out = installed.run([str(installed.python), "-c", probe], timeout_s=600)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["name"] == "KVStoreConnector" and got["same"] and got["v1"], got
    assert Path(got["file"]).is_relative_to(installed.site), got["file"]
