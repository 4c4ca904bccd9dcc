"""`ftstate demo` end to end at its smallest size, on the session's Ray cluster: real RL,
three real SIGKILLs, and the proof that nothing was lost (final weights and reward curve
identical to the same seeds run without faults)."""

from __future__ import annotations

import json

import pytest

from ftstate.cli.demo import run_demo
from ftstate.core.audit_check import check_trail

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = {"batch_size": 32, "pad_mb": 1.0, "live": False}


def test_the_demo_survives_three_kills_and_matches_the_fault_free_run(ray_cluster, tmp_path):
    out = tmp_path / "demo"
    assert run_demo(out=str(out), steps=10, faults=True, **SMALL) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps_done"] == 10 and report["syncs"] == 11
    assert [f["fault"] for f in report["faults_injected"]] == ["kill", "kill after 2 progress", "kill"]
    assert [f["role"] for f in report["failovers"]] == ["rollout", "rollout", "trainer"]
    assert report["identical_to_fault_free"] is True
    assert report["final_checksum"] == report["fault_free_checksum"]
    assert report["rewards"] == report["fault_free_rewards"]
    assert set(report["serving_checksums"]) == {report["final_checksum"]}
    rewards = report["rewards"]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.03, rewards
    assert report["budget_left"] == 2 and report["audit_violations"] == []
    assert check_trail(out / "audit.jsonl") == []
    for name in ("timeline.png", "group.mmd", "worker.mmd"):
        assert (out / name).stat().st_size > 0, name


def test_a_fault_it_cannot_survive_exits_non_zero_with_the_typed_error(ray_cluster, tmp_path):
    out = tmp_path / "demo"
    assert run_demo(out=str(out), steps=4, faults=True, max_failovers=0, **SMALL) == 2
    report = json.loads((out / "report.json").read_text())
    assert report["error"].startswith("FailoverBudgetExhausted: failover budget exhausted")
    assert report["failovers"] == []
    assert check_trail(out / "audit.jsonl") == []
