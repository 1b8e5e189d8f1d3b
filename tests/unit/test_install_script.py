"""scripts/install.sh --full refuses to start on a disk without room for it.

A CI run once filled its disk half way through the SGLang venv and ended on
pip's bare "No space left on device". The script now measures the room first:
too little gets a message saying how much is needed and where, exit 1, and
nothing installed past the empty .venv. `df` is a stand-in script on PATH that
reports the free space the case needs (the machine's own disk cannot be made
full for a test); everything else is the real script in a copy of the tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path, free_kib: int) -> tuple[Path, dict[str, str]]:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "install.sh", tree / "scripts" / "install.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    df = bin_dir / "df"
    df.write_text(
        "#!/bin/sh\n"
        "echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
        f"echo '/dev/test 999999999 1 {free_kib} 1% /mnt/test'\n"
    )
    df.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    return tree, env


def _install(tree: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/install.sh", "--full"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_full_install_on_a_disk_without_room_stops_before_installing(tmp_path: Path) -> None:
    tree, env = _tree(tmp_path, free_kib=3 << 20)  # 3 GiB: not enough for .venv + venvs
    proc = _install(tree, env)
    assert proc.returncode == 1, proc.stderr
    assert "not enough disk: the full install needs ~14 GB free on /mnt/test, which has 3 GB" in (
        proc.stderr
    )
    assert "run this again: it resumes where it stopped" in proc.stderr
    # Nothing but the empty .venv the script starts from.
    assert sorted(p.name for p in tree.iterdir()) == [".venv", "scripts"]
    site = list((tree / ".venv").glob("lib/python*/site-packages"))
    assert site and not any((s / "torch").exists() or (s / "vllm").exists() for s in site)


@pytest.mark.parametrize("venv", [".venv-sglang", ".venv-lmcache"])
def test_what_is_installed_already_is_not_asked_for_again(tmp_path: Path, venv: str) -> None:
    tree, env = _tree(tmp_path, free_kib=3 << 20)
    package = {".venv-sglang": "sglang", ".venv-lmcache": "lmcache"}[venv]
    (tree / venv / "lib" / "python3.11" / "site-packages" / package).mkdir(parents=True)
    proc = _install(tree, env)
    assert proc.returncode == 1
    need_gib = {".venv-sglang": 8, ".venv-lmcache": 13}[venv]
    assert f"needs ~{need_gib} GB free" in proc.stderr, proc.stderr
