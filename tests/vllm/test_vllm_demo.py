"""``ftstate demo --engine vllm``, run short through the command line, faults on, and its proof read
from report.json.

The demo runs in a process of its own (its own local Ray cluster on loopback, the fault-free
reference's engine in its own driver), as a user runs it. Nothing is mocked: the policy is a
real Qwen2 trained in transformers, the rollouts real vLLM engines, the three faults real
SIGKILLs (one of them from inside vLLM's loader, part-way through a version's tensors).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from ftstate.cli.demo.llm import ASYNC_ANSWER_TOKENS
from ftstate.cli.demo.run import fault_plan
from ftstate.core.audit import as_records
from ftstate.core.audit_check import check_trail
from tests.integration.test_runtime import _alive
from tests.own_venv import ROOT
from tests.vllm.harness import engine_environment

pytestmark = pytest.mark.ray

STEPS, BATCH = 8, 16
#: ``--async``: the fewest steps that hold the three faults, each step's generation on two engines.
ASYNC_STEPS, ASYNC_BATCH = 4, 8
#: The demo's bound here: ~80 s on 2 shared cores (load ~4); the rest is headroom.
DEMO_TIMEOUT_S = 400


def _run_demo(tmp_path, out, *flags: str) -> dict:
    """``ftstate demo --engine vllm`` with ``flags`` in a process of its own; its report, once it exited 0."""
    env = {**os.environ, **engine_environment(), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = "from ftstate.cli import main; main()"
    args = ["demo", "--engine", "vllm", *flags, "--no-live", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=DEMO_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


def test_the_vllm_demo_survives_three_sigkills_with_every_engine_holding_the_trainers_weights(tmp_path) -> None:
    out = tmp_path / "demo"
    report = _run_demo(tmp_path, out, "--steps", str(STEPS), "--batch-size", str(BATCH))

    # the three faults, each a real death recovered from by a failover
    assert [f["member"].split("-")[0] for f in report["faults_injected"]] == ["rollout", "rollout", "trainer"]
    assert len(fault_plan(STEPS)) == 3 and len(report["failovers"]) == 3
    (mid_update,) = report["engine"]["killed_mid_update"]
    assert not _alive(mid_update["pid"]), "the engine killed inside vLLM's loader is dead"
    lost = {row["lost"] for row in report["failovers"]}
    assert mid_update["member"] in lost
    # it died in the sync (the loader runs at the commit), and never committed that version
    mine = [r for r in as_records(out / "audit.jsonl") if r.get("event") == "transition"
            and r.get("member") == mid_update["member"]]
    (died,) = [r for r in mine if r.get("trigger") == "died"]
    assert died["from"] == "SYNCING", died
    committed = [r["weights_version"] for r in mine if r.get("trigger") == "committed"]
    assert max(committed) == died["weights_version"], (committed, died)  # the version it was loading: never
    retired = [m for m in report["members"] if m["state"] == "RETIRED"]
    assert {m["member"] for m in retired} >= set(lost)
    assert all(m["pid"] and not _alive(m["pid"]) for m in retired), retired  # SIGKILLed processes, gone

    # after every sync, every serving engine's weights read back from it equal the trainer's
    proofs = report["engine"]["held_after_sync"]
    assert len(proofs) == STEPS + 1 == report["syncs"]
    for proof in proofs:
        engines = list(proof["engines"].values()) if isinstance(proof["engines"], dict) else proof["engines"]
        assert engines and all(c == proof["trainer"] for c in engines), proof
    assert report["engine"]["held_all_equal"] is True
    assert report["serving_checksums"] == [report["final_checksum"]] * 2

    # the run equals the fault-free one (same seeds, seeded sampling), and it learned
    assert report["identical_to_fault_free"] is True
    assert report["final_checksum"] == report["fault_free_checksum"] == report["engine"]["fault_free_held_checksum"]
    assert report["rewards"] == report["fault_free_rewards"]
    assert report["reward_last"] > report["reward_first"]
    assert report["audit_violations"] == [] and check_trail(out / "audit.jsonl") == []


def test_the_async_vllm_demo_swaps_mid_answer_and_equals_the_replay_of_its_own_stamps(tmp_path) -> None:
    out, steps = tmp_path / "demo", ASYNC_STEPS
    report = _run_demo(tmp_path, out, "--steps", str(steps), "--batch-size", str(ASYNC_BATCH), "--async")

    # the three faults, each a real death recovered from; the loader kill lands in a sync or at a safe point
    assert [f["member"].split("-")[0] for f in report["faults_injected"]] == ["rollout", "rollout", "trainer"]
    assert len(report["failovers"]) == 3
    (mid_update,) = report["engine"]["killed_mid_update"]
    assert not _alive(mid_update["pid"]) and mid_update["member"] in {row["lost"] for row in report["failovers"]}

    # every sample's tokens stamped by the engine, within max_staleness, some swapped between two engine steps
    flight = report["in_flight"]
    assert flight["stamp_problems"] == [] and flight["replay_problems"] == []
    assert set(flight["samples_by_staleness"]) <= {"0", "1"}
    assert sum(flight["samples_by_staleness"].values()) == steps * ASYNC_BATCH
    assert flight["swapped_mid_answer"] >= 1, flight["stamps"]
    for row in flight["stamps"]:
        for spans in row:
            assert spans[0][1] == 0 and spans[-1][2] == ASYNC_ANSWER_TOKENS, spans
            assert all(a[2] == b[1] and a[0] < b[0] for a, b in itertools.pairwise(spans)), spans

    # held weights equal to the trainer's after every sync, read once the engines were idle
    proofs = report["engine"]["held_after_sync"]
    assert len(proofs) == steps + 1 and report["engine"]["held_all_equal"] is True
    idle = report["engine"]["trainer_idle"]
    assert idle["mode"] == "in_flight" and len(idle["per_step_s"]) == steps

    # the faulted run equals, bit for bit, the one-process replay of its own stamps
    assert report["identical_to_fault_free"] is True
    assert report["final_checksum"] == report["fault_free_checksum"] == report["engine"]["fault_free_held_checksum"]
    assert report["rewards"] == report["fault_free_rewards"]
    assert report["audit_violations"] == [] and check_trail(out / "audit.jsonl") == []
