"""`kvstore demo` (what scripts/demo.sh runs after installing): a real daemon, two
turns, the second one's prefix hit and loaded back byte for byte."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from kvstore.client import DIRECT_LOAD_MACHINES


def test_the_demo_hits_the_second_turn_and_says_what_never_became_a_call():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "demo", "--prompt-tokens", "1024", "--turns", "2",
         "--new-tokens-per-turn", "64", "--dram-mib", "64"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    turn2 = next(i for i, line in enumerate(lines) if line.startswith("turn 2:"))
    assert "cache hit 64 blocks = 1024 tokens" in lines[turn2]
    assert "bytes verified: yes" in lines[turn2 + 1]
    assert "stored 4 new blocks" in lines[turn2 + 2]
    summary = next(line for line in lines if line.startswith("daemon: "))
    assert summary.startswith("daemon: 68 blocks")
    # both lookups were probes of the presence table; the hit was read directly
    # (x86-64 only: elsewhere every load is leased)
    assert "2 of 2 lookups answered from the daemon's presence table" in summary
    direct = 64 if platform.machine() in DIRECT_LOAD_MACHINES else 0
    assert f"{direct} blocks read straight from shared memory" in summary
    assert "daemon stopped (exit code 0)" in out.stdout
