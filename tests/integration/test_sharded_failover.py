"""Several trainer ranks with fault tolerance on: a lost rank is replaced, the others keep
their processes, and nothing is lost.

Each test SIGKILLs real trainer-rank processes (between syncs, mid-sync, mid-step with an
all-reduce on the trainer group in flight, two at once) and then checks the bytes: every
serving rollout holds the full state of a fault-free run with the same steps
(:meth:`PartTrainer.reference`, computed in this process), bit for bit, and the survivors'
pids are the ones they started with.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import HeldWeightsMismatch
from ftstate.core.protocol import ChaosKill, UserCall
from tests.integration.workers import LocalPartTrainer, MisloadingPartTrainer, PartTrainer, TinyRollout

pytestmark = pytest.mark.ray


def config(tmp_path, ranks: int, **ft) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict({
        "trainer_workers": ranks,
        "rollout_workers": 2,
        "bucket_size_mb": 0.001,  # ~1 KiB buckets: every part spans several
        "init_timeout_s": 60,
        "sync_timeout_s": 60,
        "failover_timeout_s": 60,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 10.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "reverse_weight_sync": True, "mode": ft.pop("mode", "cold"), **ft},
    }, environ={})


async def facts(rt) -> dict[int, dict]:
    live = rt._membership.live("trainer")
    out = await asyncio.gather(*(rt._calls.call(m.name, m.handle, UserCall("facts")) for m in live))
    return {f["rank"]: f for f in out}


async def holds(rt, seeds, ranks: int) -> None:
    """A sync, then every rollout holds the fault-free reference of ``seeds``, bit for bit."""
    report = await rt.sync()
    reference = PartTrainer.reference(seeds, ranks)
    assert report.checksum == reference == rt.checksum
    assert await rt.rollout("checksum") == [reference] * 2
    assert sorted(report.rollouts) == ["rollout-0", "rollout-1"]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


async def replaced(rt, n: int = 1) -> None:
    """Until ``n`` failovers completed (a death is noticed at once and replaced in the background)."""
    for _ in range(1200):
        if len(rt.failovers) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{n} failovers expected, {len(rt.failovers)} done: {rt.members()}")


async def test_a_rank_killed_between_syncs_is_replaced_and_every_rank_replays_together(ray_cluster, tmp_path):
    """Calls since the sync hold an all-reduce: the newcomer cannot replay them alone, so every
    rank gets its part of the sync back and all replay; the survivors keep their processes."""
    rt = ftstate.Runtime(config(tmp_path, 3), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await holds(rt, [], 3)
        for s in (1, 2):
            assert await rt.trainer("train_step", s) == 6  # 1 + 2 + 3 over the trainer group
        before = await facts(rt)
        kill(before[1]["pid"])
        assert await rt.trainer("train_step", 3) == 6  # waits for the replacement, then runs on all three
        await holds(rt, [1, 2, 3], 3)
        after = await facts(rt)
        assert [after[r]["pid"] for r in (0, 2)] == [before[r]["pid"] for r in (0, 2)]
        assert after[1]["pid"] != before[1]["pid"]
        assert all(f["setups"] == 2 for r, f in after.items() if r != 1)  # setup again with the new group
        assert [after[r]["loads"] for r in range(3)] == [1, 1, 1]  # every rank restored its part
        [record] = rt.failovers
        assert record.lost == "trainer-1" and record.role == "trainer" and record.resynced
        [rec] = [r for r in rt.audit.records if r.get("event") == "trainer_ranks_recovered"]
        assert rec["restored"] == ["trainer-0", record.replacement, "trainer-2"]
        assert rec["replayed"] == ["train_step"] * 2 and rec["newcomers"] == [record.replacement]
        await rt.trainer("train_step", 4)
        await holds(rt, [1, 2, 3, 4], 3)
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_right_after_a_sync_only_the_newcomer_is_restored(ray_cluster, tmp_path):
    """Standby mode: a prewarmed spare takes the rank; the survivor is untouched."""
    rt = ftstate.Runtime(config(tmp_path, 2, mode="standby"), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await rt.trainer("train_step", 1)
        await holds(rt, [1], 2)
        for _ in range(600):  # the trainer spare is warm
            if any(m.state == "STANDBY" and m.role == "trainer" for m in rt.members()):
                break
            await asyncio.sleep(0.05)
        before = await facts(rt)
        kill(before[1]["pid"])
        await replaced(rt)  # an idle loss: no call raced it, so the survivor holds what the log says
        assert await rt.trainer("train_step", 2) == 3
        await holds(rt, [1, 2], 2)
        after = await facts(rt)
        assert after[0]["pid"] == before[0]["pid"] and after[0]["loads"] == 0  # untouched
        assert after[1]["loads"] == 1 and after[1]["setups"] == 1
        assert rt.failovers[0].replacement.startswith("spare-trainer")
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_rank_local_calls_leave_the_survivors_untouched(ray_cluster, tmp_path):
    rt = ftstate.Runtime(config(tmp_path, 3), trainer=LocalPartTrainer, rollout=TinyRollout)
    async with rt:
        await holds(rt, [], 3)
        await rt.trainer("train_step", 1)
        await rt.trainer("train_step", 2)
        before = await facts(rt)
        kill(before[2]["pid"])
        await holds(rt, [1, 2], 3)  # the sync waits for the replacement, which replayed both calls alone
        after = await facts(rt)
        assert [after[r]["loads"] for r in range(3)] == [0, 0, 1]
        assert [after[r]["steps"] for r in range(3)] == [2, 2, 2]
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_rank_killed_mid_sync_is_replaced_and_the_sync_completes(ray_cluster, tmp_path):
    rt = ftstate.Runtime(config(tmp_path, 3), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await holds(rt, [], 3)
        await rt.trainer("train_step", 1)
        before = await facts(rt)
        await rt.handle("trainer-1").chaos_kill.remote(ChaosKill(2))  # its part prepared, one bucket out
        report = await rt.sync()
        assert report.failovers == 1 and report.weights_version == 2
        assert report.checksum == PartTrainer.reference([1], 3)
        assert await rt.rollout("checksum") == [report.checksum] * 2
        after = await facts(rt)
        assert [after[r]["pid"] for r in (0, 2)] == [before[r]["pid"] for r in (0, 2)]
        await rt.trainer("train_step", 2)
        await holds(rt, [1, 2], 3)
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_rank_killed_mid_step_with_an_all_reduce_in_flight(ray_cluster, tmp_path):
    """Rank 0 waits in the all-reduce when rank 1 dies: its call fails part-way, so it is
    restored and replays with the newcomer, and the step is made again on all ranks."""
    marker = tmp_path / "in-step.pid"
    rt = ftstate.Runtime(config(tmp_path, 2), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await holds(rt, [], 2)
        await rt.trainer("train_step", 1)
        before = await facts(rt)
        # straight to rank 1's process, not through rt.trainer: a logged call would be replayed
        await rt.handle("trainer-1").call.remote(UserCall("mark_and_wait_in_step", (str(marker),)))
        step = asyncio.ensure_future(rt.trainer("train_step", 2))
        for _ in range(600):
            if marker.exists() and marker.read_text():
                break
            await asyncio.sleep(0.05)
        kill(int(marker.read_text()))
        assert await asyncio.wait_for(step, 90) == 3  # made again once rank 1 was replaced
        await holds(rt, [1, 2], 2)
        after = await facts(rt)
        assert after[0]["pid"] == before[0]["pid"] and after[0]["loads"] == 1
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_two_ranks_lost_at_once_are_one_reconciliation(ray_cluster, tmp_path):
    rt = ftstate.Runtime(config(tmp_path, 3, max_failovers=2), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await holds(rt, [], 3)
        await rt.trainer("train_step", 1)
        before = await facts(rt)
        kill(before[1]["pid"])
        kill(before[2]["pid"])
        await asyncio.sleep(0.5)  # both deaths reach the controller
        await holds(rt, [1], 3)
        after = await facts(rt)
        assert after[0]["pid"] == before[0]["pid"]
        assert {f.lost for f in rt.failovers} == {"trainer-1", "trainer-2"}
        recs = [r for r in rt.audit.records if r.get("event") == "trainer_ranks_recovered"]
        assert len(recs) == 1, recs
        assert recs[0]["newcomers"] == sorted(f.replacement for f in rt.failovers)
        await rt.trainer("train_step", 2)
        await holds(rt, [1, 2], 3)
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_rank_lost_while_the_ranks_are_recovered_joins_that_round(ray_cluster, tmp_path):
    """Rank 2 dies inside its new setup() while rank 1's loss is being recovered: the round
    takes it in (one more of max_failovers spent), replaces it too, and recovers both."""
    marker = tmp_path / "in-setup.pid"
    rt = ftstate.Runtime(config(tmp_path, 3, max_failovers=2), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await holds(rt, [], 3)
        await rt.trainer("train_step", 1)
        before = await facts(rt)
        await rt.handle("trainer-2").call.remote(UserCall("hold_next_setup", (str(marker),)))  # not logged: not replayed
        kill(before[1]["pid"])
        for _ in range(1200):
            if marker.exists() and marker.read_text():
                break
            await asyncio.sleep(0.05)
        kill(int(marker.read_text()))
        await replaced(rt, 2)
        await holds(rt, [1], 3)
        after = await facts(rt)
        assert after[0]["pid"] == before[0]["pid"] and {after[1]["pid"], after[2]["pid"]}.isdisjoint(
            {before[1]["pid"], before[2]["pid"]})
        assert sorted(f.lost for f in rt.failovers) == ["trainer-1", "trainer-2"]
        assert [r["members"] for r in rt.audit.records if r.get("event") == "failover_joined"] == [["trainer-2"]]
        spent = [r["reason"] for r in rt.audit.records if r.get("event") == "budget_spent"]
        assert [s.split(":")[0] for s in spent] == ["trainer-1", "trainer-2"]
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_before_the_first_sync_a_loss_that_needs_a_survivor_restored_fails_the_run_naming_it(
        ray_cluster, tmp_path):
    """A call with an all-reduce was made and no version committed: the survivor cannot be
    taken back to before it, so the run fails with RankNotRecoverable naming it, at once."""
    rt = ftstate.Runtime(config(tmp_path, 2), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await rt.trainer("train_step", 1)
        kill((await facts(rt))[1]["pid"])
        with pytest.raises(ftstate.RankNotRecoverable, match=r"trainer-0: would have to be taken back") as info:
            await asyncio.wait_for(rt.trainer("train_step", 2), 60)
        assert info.value.members == ("trainer-0",) and rt.state == "FAILED"


async def test_a_restored_rank_that_does_not_reproduce_its_part_is_never_admitted(ray_cluster, tmp_path):
    """Proof, not trust: the replacement's load_state_dict returns normally but what its
    state_dict() then owns does not hash to what rank 1 sent at the commit, so it is not
    admitted; the failover tries again (resync_retries) and fails the run with
    HeldWeightsMismatch naming it, and the rollouts keep serving the committed version."""
    marker = tmp_path / "misload"
    cfg = config(tmp_path, 2, resync_retries=1)
    rt = ftstate.Runtime(cfg, trainer=MisloadingPartTrainer, rollout=TinyRollout,
                         trainer_kwargs={"marker": str(marker)})
    async with rt:
        await holds(rt, [], 2)
        committed = rt.checksum
        before = await facts(rt)
        marker.touch()  # the replacement, built after the kill, misloads
        kill(before[1]["pid"])
        for _ in range(1200):
            if rt.state == "FAILED":
                break
            await asyncio.sleep(0.05)
        assert rt.state == "FAILED", rt.members()
        newcomer = next(m.member for m in rt.members() if m.role == "trainer" and m.member != "trainer-0"
                        and m.member != "trainer-1")
        with pytest.raises(HeldWeightsMismatch, match="after load_state_dict of its part") as info:
            await rt.sync()
        assert newcomer in str(info.value)
        assert not any(r.get("member") == newcomer and r.get("to") in ("RESYNCED", "READY")
                       for r in rt.audit.records if r["event"] == "transition")
        assert rt.failovers == []
        rollouts = rt._membership.live("rollout")
        held = await asyncio.gather(*(rt._calls.call(m.name, m.handle, UserCall("checksum")) for m in rollouts))
        assert held == [committed] * 2  # the failed run's rollouts still hold the committed version
    assert check_trail(tmp_path / "audit.jsonl") == []
