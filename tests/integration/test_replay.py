"""A replaced trainer loses no step, proven on its bytes: replay, and checkpoints with a version check.

The trainer's step is deterministic in its arguments (``ReplayTrainer.train_step(seed)``, as
docs/operations.md requires of replayed calls), so the state a fault-free run reaches is
computed in this process (``ReplayTrainer.reference``) and every rebuilt trainer's weights
are compared with it bit for bit (whole-state checksum), through the rollouts that the next
sync reaches and through the trainer itself. Making the replay a no-op, replaying a call
twice, or admitting an older checkpoint fails these tests.
"""

from __future__ import annotations

import asyncio

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.protocol import UserCall
from tests.integration.test_runtime import wait_until
from tests.integration.workers import ReplayTrainer, TinyRollout

pytestmark = pytest.mark.ray


def config(tmp_path, **ft) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": 2,
            "bucket_size_mb": 0.0625,
            "init_timeout_s": 60,
            "sync_timeout_s": 30,
            "failover_timeout_s": 30,
            "heartbeat_interval_s": 0.2,
            # the trainer's death is found by the calls it cuts; a rollout starved of CPU while a
            # cold replacement imports torch must not be taken for lost (the claim is the replay)
            "heartbeat_timeout_s": 10.0,
            "audit_log": str(tmp_path / "audit.jsonl"),
            "fault_tolerance": {"enable": True, "mode": "cold", "max_failovers": 5, "reverse_weight_sync": True, **ft},
        },
        environ={},
    )


def trainer_pid(rt) -> int:
    return next(m.pid for m in rt.members() if m.role == "trainer" and m.rank == 0
                and m.state not in ("LOST", "RETIRED", "STOPPED", "FAILED"))


async def kill_trainer(rt) -> int:
    pid = trainer_pid(rt)
    await rt.chaos.kill("trainer", 0)
    return pid


async def assert_everyone_holds(rt, seeds) -> None:
    expected = ReplayTrainer.reference(seeds)
    assert rt.checksum == expected, f"committed weights are not those of a fault-free run with steps {seeds}"
    assert await rt.trainer("checksum") == expected
    assert await rt.rollout("checksum") == [expected] * len(rt.serving_rollouts())


def replays(rt) -> list[list[str]]:
    return [r["calls"] for r in rt.audit.records if r["event"] == "trainer_replay"]


@pytest.mark.parametrize("steps", [[11], [11, 12]], ids=["one call", "two calls"])
async def test_calls_since_the_last_sync_are_replayed_on_the_new_trainer(ray_cluster, tmp_path, steps):
    async with ftstate.Runtime(config(tmp_path), trainer=ReplayTrainer, rollout=TinyRollout) as rt:
        await rt.trainer("train_step", 10)
        await rt.sync()
        for seed in steps:
            await rt.trainer("train_step", seed)
        old = await kill_trainer(rt)
        report = await rt.sync()  # finds the trainer dead, rebuilds it, replays, then syncs
        assert report.weights_version == 2
        assert [f.role for f in rt.failovers] == ["trainer"] and trainer_pid(rt) != old
        assert replays(rt) == [["train_step"] * len(steps)]
        await assert_everyone_holds(rt, [10, *steps])
        # and the run goes on from there
        await rt.trainer("train_step", 13)
        await rt.sync()
        await assert_everyone_holds(rt, [10, *steps, 13])
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_call_cut_short_by_the_death_runs_once_on_the_new_trainer(ray_cluster, tmp_path):
    marker = tmp_path / "in-step"
    async with ftstate.Runtime(config(tmp_path), trainer=ReplayTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        await rt.trainer("train_step", 11)
        old = trainer_pid(rt)
        call = asyncio.ensure_future(rt.trainer("train_step", 12, 30.0, str(marker)))
        await wait_until(lambda: marker.exists() and marker.read_text().strip() == str(old), 30,
                         "the trainer inside train_step(12)")
        assert not call.done()
        await kill_trainer(rt)  # inside the step: it never completed on the old trainer
        assert await asyncio.wait_for(call, 90) == 12  # made again, once, on the new trainer
        pids = [int(p) for p in marker.read_text().split()]
        assert len(pids) == 2 and pids[0] == old and pids[1] == trainer_pid(rt) != old
        # The completed call (11) was replayed before the cut one ran again.
        assert replays(rt) == [["train_step"]]
        await rt.sync()
        await assert_everyone_holds(rt, [11, 12])
    assert check_trail(tmp_path / "audit.jsonl") == []


class TestCheckpointRecovery:
    """reverse_weight_sync off: the new trainer loads checkpoint_dir, and is admitted only if
    what it then holds is the current weights version (hashed from its state_dict())."""

    async def test_a_checkpoint_of_the_current_version_is_admitted_and_the_calls_since_replayed(
        self, ray_cluster, tmp_path
    ):
        ckpt = tmp_path / "ckpt"
        cfg = config(tmp_path, reverse_weight_sync=False, checkpoint_dir=str(ckpt))
        async with ftstate.Runtime(cfg, trainer=ReplayTrainer, rollout=TinyRollout) as rt:
            await rt.trainer("train_step", 10)
            await rt.sync()
            await rt.trainer("save_checkpoint", str(ckpt))  # right after the sync: version 1
            await rt.trainer("train_step", 11)
            await kill_trainer(rt)
            await rt.sync()
            # save_checkpoint was itself a call since the sync: replayed too (it rewrites the same state)
            assert replays(rt) == [["save_checkpoint", "train_step"]]
            await assert_everyone_holds(rt, [10, 11])
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_an_older_checkpoint_is_refused_naming_the_version_it_holds(self, ray_cluster, tmp_path):
        ckpt = tmp_path / "ckpt"
        cfg = config(tmp_path, reverse_weight_sync=False, checkpoint_dir=str(ckpt))
        rt = ftstate.Runtime(cfg, trainer=ReplayTrainer, rollout=TinyRollout)
        async with rt:
            await rt.trainer("train_step", 10)
            v1 = (await rt.sync()).checksum
            await rt.trainer("save_checkpoint", str(ckpt))
            await rt.trainer("train_step", 11)
            v2 = (await rt.sync()).checksum
            await kill_trainer(rt)
            with pytest.raises(ftstate.StaleCheckpointRefused) as info:
                await rt.sync()
            err = info.value
            assert (err.matches_version, err.current_version, err.held, err.expected) == (1, 2, v1, v2)
            assert str(ckpt) in str(err) and "allow_checkpoint_rollback" in str(err)
            assert rt.state == "FAILED"
            # Nobody was rolled back: the rollouts still hold version 2 (asked directly: a
            # failed run routes no calls).
            rollouts = [m.member for m in rt.members() if m.role == "rollout"]
            held = [await rt.handle(n).call.remote(UserCall("checksum")) for n in rollouts]
            assert rt.weights_version == 2 and held == [v2, v2]

    async def test_with_the_switch_on_the_rollback_is_accepted_and_recorded(self, ray_cluster, tmp_path):
        ckpt = tmp_path / "ckpt"
        cfg = config(tmp_path, reverse_weight_sync=False, checkpoint_dir=str(ckpt), allow_checkpoint_rollback=True)
        async with ftstate.Runtime(cfg, trainer=ReplayTrainer, rollout=TinyRollout) as rt:
            await rt.trainer("train_step", 10)
            v1 = (await rt.sync()).checksum
            await rt.trainer("save_checkpoint", str(ckpt))
            await rt.trainer("train_step", 11)
            await rt.sync()
            await rt.trainer("train_step", 12)
            await kill_trainer(rt)
            report = await rt.sync()
            (rollback,) = [r for r in rt.audit.records if r["event"] == "checkpoint_rollback"]
            assert rollback["matches_version"] == 1 and rollback["checksum"] == v1
            assert rollback["calls_dropped"] == ["train_step"] and rollback["weights_version"] == 2
            # The run goes on from the checkpoint: version 3 is version 1's weights.
            assert report.weights_version == 3 and report.checksum == v1 == ReplayTrainer.reference([10])
        assert check_trail(tmp_path / "audit.jsonl") == []


def test_reference_is_deterministic_in_the_arguments():
    assert ReplayTrainer.reference([1, 2]) == ReplayTrainer.reference([1, 2]) != ReplayTrainer.reference([2, 1])
