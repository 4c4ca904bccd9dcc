"""Several trainer ranks (trainer_workers: 2 and 3): each sends what it owns, every rollout
gets the full state bit for bit; bad ownership is refused, naming tensor and ranks."""

from __future__ import annotations

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import OwnershipError
from ftstate.core.protocol import Beat, ChaosKill, UserCall
from tests.integration.workers import ShardTrainer, TinyRollout

pytestmark = pytest.mark.ray


def config(tmp_path, ranks: int, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "trainer_workers": ranks,
        "rollout_workers": 2,
        "bucket_size_mb": 0.001,  # ~1 KiB buckets: every part spans several
        "init_timeout_s": 60,
        "sync_timeout_s": 60,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 10.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
    }
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


async def synced_equal(rt) -> str:
    report = await rt.sync()
    reference = await rt.trainer("reference_checksum")
    assert report.checksum == reference == rt.checksum
    assert await rt.rollout("checksum") == [reference] * 2  # every rollout holds the full reference
    assert sorted(report.rollouts) == ["rollout-0", "rollout-1"]
    for m in rt.members():  # every rank's heartbeat reports the committed version and full checksum
        if m.role == "trainer":
            beat = await rt.handle(m.member).heartbeat.remote(Beat())
            assert (beat.weights_version, beat.checksum) == (report.weights_version, reference), m.member
    return reference


@pytest.mark.parametrize(("ranks", "style"), [(2, "slices"), (3, "slices"), (3, "gather"), (2, "pipeline"),
                                              (3, "pipeline")])
async def test_every_rollout_holds_the_full_reference_after_each_sync(ray_cluster, tmp_path, ranks, style):
    rt = ftstate.Runtime(config(tmp_path, ranks), trainer=ShardTrainer, rollout=TinyRollout,
                         trainer_kwargs={"style": style})
    async with rt:
        facts = [await rt._calls.call(m.name, m.handle, UserCall("facts"))
                 for m in rt._membership.live("trainer")]
        assert [(f["rank"], f["world"], f["setups"]) for f in facts] == [(r, ranks, 1) for r in range(ranks)]
        assert [f["env"] for f in facts] == [(str(r), str(ranks)) for r in range(ranks)]
        seen = set()
        for _ in range(3):
            seen.add(await synced_equal(rt))
            assert await rt.trainer("train_step") == ranks  # an all-reduce on the trainer group
        assert len(seen) == 3
        assert rt.weights_version == 3
    assert check_trail(tmp_path / "audit.jsonl") == []


@pytest.mark.parametrize(("style", "match"), [
    ("overlap", r"tensor 'emb' \(trainer ranks 0, 1\): slice 0 of 2 .* owned twice .*overlap"),
    ("gap", r"tensor 'emb' \(trainer ranks 0\): slices \[1\] of 2 .*gap"),
    ("twice", r"tensor 'layer0.w' \(trainer ranks 0, 1\): owned twice"),
    ("mismatch", r"tensor 'proj' \(trainer ranks 0, 1\): slices along dim 1 disagree on the other dims"),
])
async def test_bad_ownership_fails_the_sync_and_rollouts_keep_the_previous_version(
        ray_cluster, tmp_path, style, match):
    rt = ftstate.Runtime(config(tmp_path, 2), trainer=ShardTrainer, rollout=TinyRollout,
                         trainer_kwargs={"style": style, "bad_from_step": 1})
    async with rt:
        good = await synced_equal(rt)
        await rt.trainer("train_step")
        with pytest.raises(OwnershipError, match=match):
            await rt.sync()
        assert rt.weights_version == 1 and rt.checksum == good
        assert await rt.rollout("checksum") == [good] * 2
        assert await rt.rollout("generate", "x") == [("x", 1)] * 2
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_trainer_rank_killed_mid_sync_fails_the_run_and_rollouts_keep_the_previous_version(
        ray_cluster, tmp_path):
    """Replacing one rank is not implemented: with fault tolerance off (the only mode for
    several ranks) its loss fails the run at once, naming it, and no rollout holds a torn mix."""
    rt = ftstate.Runtime(config(tmp_path, 3), trainer=ShardTrainer, rollout=TinyRollout)
    async with rt:
        good = await synced_equal(rt)
        await rt.trainer("train_step")
        victim = rt.handle("trainer-1")
        pid = await victim.call.remote(UserCall("facts"))
        await victim.chaos_kill.remote(ChaosKill(2))  # its state_dict() prepared, then one bucket on the wire
        with pytest.raises(ftstate.MemberLost, match="trainer-1"):
            await rt.sync()
        assert not _alive(pid["pid"])
        held = [await rt.handle(f"rollout-{i}").call.remote(UserCall("checksum")) for i in range(2)]
        assert held == [good] * 2
        with pytest.raises(ftstate.MemberLost):
            await rt.rollout("generate", "x")


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_one_rank_whose_state_dict_raises_fails_that_sync_only(ray_cluster, tmp_path):
    rt = ftstate.Runtime(config(tmp_path, 2), trainer=ShardTrainer, rollout=TinyRollout)
    async with rt:
        good = await synced_equal(rt)
        await rt.trainer("train_step")
        await rt.trainer("fail_next_state_dict", 1)  # every rank is called; only rank 1 will raise
        with pytest.raises(RuntimeError, match="state_dict\\(\\) failed on rank 1"):
            await rt.sync()
        assert rt.weights_version == 1 and await rt.rollout("checksum") == [good] * 2
        assert await synced_equal(rt) != good  # the next sync goes through
        assert rt.weights_version == 2
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_trainer_rank_killed_mid_step_with_a_collective_in_flight_fails_the_run_naming_it(
        ray_cluster, tmp_path):
    import asyncio
    import os
    import signal

    marker = tmp_path / "in-step.pid"
    rt = ftstate.Runtime(config(tmp_path, 2), trainer=ShardTrainer, rollout=TinyRollout)
    async with rt:
        good = await synced_equal(rt)
        await rt.trainer("mark_and_wait_in_step", str(marker))
        step = asyncio.ensure_future(rt.trainer("train_step"))
        for _ in range(600):  # until rank 1 is inside its step (rank 0 then waits in the all-reduce)
            if marker.exists() and marker.read_text():
                break
            await asyncio.sleep(0.05)
        assert marker.exists(), "rank 1 never entered its step"
        os.kill(int(marker.read_text()), signal.SIGKILL)
        with pytest.raises(ftstate.MemberLost, match="trainer-1"):
            await asyncio.wait_for(step, 60)
        held = [await rt.handle(f"rollout-{i}").call.remote(UserCall("checksum")) for i in range(2)]
        assert held == [good] * 2
