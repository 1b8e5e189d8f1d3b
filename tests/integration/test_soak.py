"""CI smoke of `kvstore-bench soak --quick`: 3 real daemons, the real indexer, two
client processes under an agentic trace, and every cheap fault kind injected
at least once while they run. Nothing served may be wrong and nothing may leak.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_NIXL = (
    importlib.util.find_spec("nixl") is not None
    or importlib.util.find_spec("nixl_cu12") is not None
)
# Cheap enough to come at least once in two minutes; disk_full needs a tmpfs
# mount (root) and netem a kernel with sch_netem: either is reported skipped
# with its reason where the machine does not allow it.
CHEAP = (
    "kill9",
    "sigstop",
    "sigterm",
    "indexer_kill",
    "client_kill",
    "peer_kill",
    "event_chaos",
)


@pytest.mark.slow
@pytest.mark.nixl
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed")
def test_soak_quick_serves_no_wrong_byte_and_leaks_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_bench", "soak", "--quick", "--results", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    dirs = [p for p in results.iterdir() if p.is_dir()]
    assert len(dirs) == 1, (dirs, proc.stderr[-3000:])
    out = dirs[0]
    assert (out / "soak.json").exists(), proc.stderr[-3000:]
    summary = json.loads((out / "soak.json").read_text())
    assert proc.returncode == 0, (summary["failed_checks"], proc.stderr[-3000:])
    assert summary["wrong_bytes"] == 0 and summary["wrong_blocks"] == 0
    assert summary["audit"]["wrong_blocks"] == 0
    assert summary["leaks"]["total"] == 0, summary["leaks_by_node"]
    assert summary["hangs"] == 0
    assert summary["over_cap_samples"] == 0
    assert summary["loads_ok"] > 50 and summary["peer_pulls"] > 0
    faults = summary["faults"]
    for kind in CHEAP:
        assert faults[kind]["injected"] >= 1, (kind, faults.get(kind))
        assert faults[kind]["not_converged"] == 0, (kind, faults[kind])
    for kind in ("disk_full", "netem"):
        f = faults[kind]
        assert f["injected"] >= 1 or f["skip_reason"], (kind, f)
    # the fault log is timestamped and starts with the seeded plan
    log = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    assert log[0]["event"] == "plan" and log[0]["seed"] == 0
    assert {e["kind"] for e in log if e["event"] == "fault_start"} >= set(CHEAP)
    # the killed client left leases and pins behind, which the quiesce check saw reclaimed
    killed = [e for e in log if e["event"] == "fault_end" and e["kind"] == "client_kill"]
    assert killed and all(e["detail"]["leases_left"] >= 1 for e in killed), killed
    assert all(e["detail"]["pinned_left"] >= 1 for e in killed), killed
    assert (out / "report.md").read_text().count("wrong bytes served") == 1
    assert (out / "timeline.png").stat().st_size > 10_000
