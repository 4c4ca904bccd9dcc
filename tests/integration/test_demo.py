"""`ftstate demo` end to end at its smallest size, on the session's Ray cluster: real RL,
three real SIGKILLs, and the proof that nothing was lost (final weights and reward curve
identical to the same seeds run without faults); with one trainer, and sharded over two
trainer ranks (`--trainers 2`), rank 1 killed mid-step."""

from __future__ import annotations

import json
import re

import pytest

from ftstate.cli.demo import run_demo
from ftstate.cli.demo.run import demo_config, demo_options
from ftstate.core.audit_check import check_trail

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = {"batch_size": 32, "pad_mb": 1.0, "live": False}


def test_the_demo_survives_three_kills_and_matches_the_fault_free_run(ray_cluster, tmp_path, capsys):
    out = tmp_path / "demo"
    assert run_demo(out=str(out), steps=10, faults=True, **SMALL) == 0
    report = json.loads((out / "report.json").read_text())
    # Without a terminal (pytest captures stdout): plain progress lines, as `make demo > log` shows.
    printed = capsys.readouterr().out.splitlines()
    assert any(re.fullmatch(r"starting 3 workers: \d ready", ln) for ln in printed), printed[:20]
    assert "starting 3 workers: 3 ready" in printed
    steps = [ln for ln in printed if re.match(r"step \d+/10: reward ", ln)]
    assert [int(ln.split()[1].split("/")[0]) for ln in steps] == list(range(1, 11)), steps
    told = [ln for ln in printed if ln.startswith("failover ")]
    assert [ln.split(":")[0] for ln in told] == ["failover 1", "failover 2", "failover 3"], told
    # The report, the view and the picture read the same failover records: the same figures.
    from ftstate.cli.audit_view import failover_rows
    from ftstate.cli.plot import _failovers
    from ftstate.core.audit import as_records

    records = as_records(out / "audit.jsonl")
    rows = failover_rows(records)
    assert [(f["lost"], f["total_s"], f["detection_s"]) for f in report["failovers"]] == \
        [(r["lost"], r["total_s"], r["detection_s"]) for r in rows]
    bands = _failovers(records, max(r["t"] for r in records))
    assert [round(b.end - b.start, 6) for b in bands] == [round(r["total_s"], 6) for r in rows]
    # each kill is seen as its process' death: one seen only by the heartbeat timeout would take all of it
    timeout = demo_config(demo_options(str(out), 10, True, dict(SMALL)), out).heartbeat_timeout_s
    assert all(r["detection_s"] is not None and 0 <= r["detection_s"] < timeout for r in rows), rows
    # the failed-then-completed sync is explained
    assert len(report["syncs_failed_explained"]) == report["syncs_failed"]
    assert all("committed on every serving rollout" in e for e in report["syncs_failed_explained"])
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


def test_two_trainer_ranks_survive_losing_rank_1_mid_step_and_match_the_two_rank_reference(ray_cluster, tmp_path):
    out = tmp_path / "demo"
    # 6 steps: the faults at steps 1, 3 and 4 (the spares have a few steps to warm up)
    code = run_demo(out=str(out), steps=6, faults=True, trainers=2, **{**SMALL, "batch_size": 16, "pad_mb": 0.5})
    report = json.loads((out / "report.json").read_text())
    what = json.dumps({k: report[k] for k in ("error", "faults_injected", "failovers", "trainer_ranks",
                                               "trainer_ranks_recovered", "identical_to_fault_free", "rewards",
                                               "fault_free_rewards", "final_checksum", "fault_free_checksum",
                                               "serving_checksums", "audit_violations")}, indent=1)
    assert code == 0, what
    assert report["trainers"] == 2 and report["steps_done"] == 6, what
    assert [(f["member"], f["fault"]) for f in report["faults_injected"]][2] == ("trainer-1", "kill"), what
    lost = [(f["role"], f["lost"]) for f in report["failovers"]]
    assert ("rollout", "rollout-1") in lost and ("rollout", "rollout-0") in lost, what
    [trainer_failover] = [f for f in report["failovers"] if f["role"] == "trainer"]
    assert trainer_failover["lost"] == "trainer-1", what
    replacement = trainer_failover["replacement"]
    rank0, rank1 = report["trainer_ranks"]
    assert rank0["member_end"] == "trainer-0" and rank0["same_process"], what
    assert rank0["pid_end"] == rank0["pid_start"], what
    assert rank1["member_end"] == replacement and rank1["pid_end"] != rank1["pid_start"], what
    assert [replacement] in [r["newcomers"] for r in report["trainer_ranks_recovered"]], what
    assert report["identical_to_fault_free"] is True, what
    assert report["final_checksum"] == report["fault_free_checksum"], what
    assert report["rewards"] == report["fault_free_rewards"], what
    assert set(report["serving_checksums"]) == {report["final_checksum"]}, what
    assert report["audit_violations"] == [] and check_trail(out / "audit.jsonl") == [], what


def test_the_async_demo_samples_while_it_trains_and_is_the_replay_of_its_stamps(ray_cluster, tmp_path):
    # ftstate demo --async: step s + 1 generates while step s trains and syncs (in-flight updates),
    # through the same three kills; which version a sample ran on depends on when its rollout
    # reached a safe point, so the proof is the replay of the stamps the run recorded
    out = tmp_path / "demo"
    assert run_demo(out=str(out), steps=6, faults=True, in_flight=True, **SMALL) == 0
    report = json.loads((out / "report.json").read_text())
    flight = report["in_flight"]
    assert flight["stamp_problems"] == [] and set(flight["samples_by_staleness"]) <= {"0", "1"}
    assert flight["samples_by_staleness"].get("1", 0) > 0, flight  # it did generate on the old version
    assert [len(row) for row in flight["stamps"]] == [SMALL["batch_size"]] * 6
    assert [f["role"] for f in report["failovers"]] == ["rollout", "rollout", "trainer"]
    assert report["identical_to_fault_free"] is True and set(report["serving_checksums"]) == {report["final_checksum"]}
    # the stamps are in the trail too: the run can be replayed from its seed and its trail
    from ftstate.core.audit import as_records

    stamped = [r["stamps"] for r in as_records(out / "audit.jsonl") if r["event"] == "samples_stamped"]
    assert stamped == flight["stamps"] and check_trail(out / "audit.jsonl") == []


def test_the_fleet_grows_and_shrinks_mid_run_and_the_run_stays_identical_to_the_fixed_fleet(ray_cluster, tmp_path):
    """`--grow-to 4`: two rollouts added at step 2 (fed by the rollouts, not the trainer), two
    removed at step 4; the weights and rewards equal the fault-free run with a fixed fleet."""
    out = tmp_path / "demo"
    code = run_demo(out=str(out), steps=6, faults=False, grow_to=4, **{**SMALL, "batch_size": 16, "pad_mb": 0.5})
    report = json.loads((out / "report.json").read_text())
    what = json.dumps({k: report[k] for k in ("error", "scaling", "failovers", "identical_to_fault_free",
                                               "audit_violations")}, indent=1)
    assert code == 0, what
    added, removed = report["scaling"]
    assert added["event"] == "rollouts_added" and len(added["members"]) == 2, what
    assert added["trainer_sources"] == 0 and all(s.startswith("rollout-") for s in added["sources"].values()), what
    assert removed["event"] == "rollouts_removed" and sorted(removed["members"]) == sorted(added["members"]), what
    assert report["failovers"] == [] and report["syncs_failed"] == 0, what
    assert report["identical_to_fault_free"] is True, what
    assert len(report["serving_checksums"]) == 2 and set(report["serving_checksums"]) == {report["final_checksum"]}
    assert check_trail(out / "audit.jsonl") == []
