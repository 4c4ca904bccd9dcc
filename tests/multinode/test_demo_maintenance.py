"""`ftstate demo --maintenance` end to end, small: a local 3-node cluster of the demo's own (in a
process of its own: a driver joins one cluster only), a loopback GCE metadata server per node,
maintenance announced on a rollout's node mid-run, the node drained while the RL loop goes on;
the drain changes nothing of the training (weights and reward curve identical to the
fault-free reference), no sync fails, no budget is spent, and nothing of the run is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ftstate.core.audit_check import check_trail

pytestmark = pytest.mark.ray


def processes_marked(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment holds ``mark``: the demo and everything
    its cluster started (raylets, workers, agents) inherit it."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if mark.encode() not in Path(f"/proc/{entry}/environ").read_bytes():
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            out.append(int(entry))
    return out


def test_the_maintenance_demo_drains_a_node_mid_run_and_matches_the_fault_free_run(tmp_path):
    out = tmp_path / "demo"
    mark = f"ftstate-demo-test-{uuid.uuid4().hex}"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "FTSTATE_TEST_MARK": mark}
    env.pop("GCE_METADATA_HOST", None)
    cmd = [sys.executable, "-m", "ftstate", "demo", "--maintenance", "--steps", "6", "--batch-size", "16",
           "--pad-mb", "1", "--no-live", "--out", str(out)]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())

    maintenance = report["maintenance"]
    announced = maintenance["announced"]
    assert announced["node"] in ("b", "c") and announced["step"] == 2
    # Seen by the watcher of that node only (its own GCE_METADATA_HOST), with the window's deadline.
    notices = maintenance["notices"]
    assert notices and {n["node_id"] for n in notices} == {announced["node_id"]}
    assert notices[0]["source"] == "gce" and notices[0]["kind"] in ("terminate", "maintenance")
    assert notices[0]["deadline"] == pytest.approx(announced["deadline"], abs=1e-3)
    assert maintenance["problems"] == [] and maintenance["withdrawn"] == 0

    [drain] = report["drains"]
    assert drain["outcome"] == "drained" and drain["node"] == announced["node_id"]
    assert drain["moved"] and all(m.startswith("rollout-") for m in drain["moved"])
    by_member = {m["member"]: m for m in report["members"]}
    for old, new in drain["moved"].items():
        assert by_member[old]["state"] in ("RETIRED", "STOPPED")
        assert by_member[new]["node_id"] != announced["node_id"]

    assert report["syncs_failed"] == 0 and report["error"] is None
    assert report["failovers"] == [] and report["budget_left"] == 5  # a drain spends no budget
    assert report["steps_done"] == 6 and report["syncs"] == 7
    assert report["identical_to_fault_free"] is True
    assert report["final_checksum"] == report["fault_free_checksum"]
    assert report["rewards"] == report["fault_free_rewards"]
    assert set(report["serving_checksums"]) == {report["final_checksum"]}
    assert report["nodes"] == 3 and report["audit_violations"] == []
    assert check_trail(out / "audit.jsonl") == []
    assert (out / "timeline.png").stat().st_size > 0
    assert "drained node" in done.stdout and "syncs failed" in done.stdout

    # Nothing of the run is left: the demo's cluster went with it.
    deadline = time.monotonic() + 15
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"left running: {left}"
    print(f"the small maintenance demo took {took:.0f}s")  # a figure, not a claim: its bound is the run's timeout
