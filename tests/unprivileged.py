"""Run a shell command as another local user (uid/gid 65534, "nobody"), for the trust tests.

Uses ``setpriv`` (util-linux), which needs root to change uid: the tests run
as root (so does CI). Only ``sh`` runs as that user, never Python, whose
installation may not be readable by it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

OTHER_UID = 65534


def as_other_user(
    script: str, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    """``sh -c script sh args...`` as uid/gid 65534 with no supplementary groups."""
    if os.geteuid() != 0:
        pytest.skip("dropping to another uid needs root (setpriv); run the suite as root")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    return subprocess.run(
        [
            setpriv,
            f"--reuid={OTHER_UID}",
            f"--regid={OTHER_UID}",
            "--clear-groups",
            "/bin/sh",
            "-c",
            script,
            "sh",
            *args,
        ],
        input=stdin,
        capture_output=True,
        timeout=30,
        check=False,
    )


def write_as_other_user(path: str, data: bytes, mode: str = "0666") -> None:
    """Create ``path`` owned by the other user, with ``data`` and ``mode``."""
    done = as_other_user('umask 0; cat > "$1" && chmod "$2" "$1"', path, mode, stdin=data)
    assert done.returncode == 0, done.stderr.decode()


def readable_by_other_user(path: str) -> bool:
    return as_other_user('cat "$1" > /dev/null', path).returncode == 0
