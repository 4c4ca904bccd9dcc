"""`ftstate demo --address HOST:PORT` joins a running multi-node cluster (the session's, here)
instead of starting its own, and its report says on how many nodes the workers ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray


def test_the_demo_joins_a_running_cluster_and_says_how_many_nodes_it_ran_on(multinode_cluster, tmp_path):
    import ray

    out = tmp_path / "demo"
    address = multinode_cluster.cluster.address
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    cmd = [sys.executable, "-m", "ftstate", "demo", "--address", address, "--steps", "4", "--batch-size", "16",
           "--pad-mb", "1", "--no-live", "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["address"] == address and report["identical_to_fault_free"] is True
    ours = {multinode_cluster.node_id(name) for name in multinode_cluster.alive()}
    used = {m["node_id"] for m in report["members"]}
    assert None not in used and used <= ours
    assert report["nodes"] == len(used) >= 2  # the default placement spreads the workers
    assert report["cluster_nodes"] >= 3  # (a node lost by an earlier test may count until Ray drops it)
    assert "nodes" in done.stdout and f"{len(used)} of" in done.stdout
    # Joined, not owned: the cluster is still there and the driver of this session still on it.
    assert sum(1 for n in ray.nodes() if n["Alive"]) >= 3
    assert Path(out / "audit.jsonl").stat().st_size > 0
