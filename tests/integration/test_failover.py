"""Failover on a real local Ray cluster: real SIGKILL/SIGSTOP of real worker processes.

After every fault: the run goes on (or fails with the typed error the config implies),
every serving rollout holds exactly the trainer's last committed weights (checksum), the
audit trail passes `ftstate audit --check`, and the budget is spent once per promotion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import FailoverBudgetExhausted, HeldWeightsMismatch, LossyRecoveryRefused, MemberLost
from ftstate.core.protocol import UserCall
from tests.integration.test_runtime import assert_gone, wait_until
from tests.integration.workers import (
    BadNewcomerRollout,
    LossyTrainer,
    SteppingRollout,
    TinyRollout,
    TinyTrainer,
)
from tests.timing import SLACK_S

pytestmark = pytest.mark.ray


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def config(tmp_path, **ft) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": ft.pop("rollout_workers", 2),
            "bucket_size_mb": 0.0625,
            "init_timeout_s": 60,
            "sync_timeout_s": 60,
            "failover_timeout_s": 30,
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 1.0,
            "audit_log": str(tmp_path / "audit.jsonl"),
            "fault_tolerance": {"enable": True, "reverse_weight_sync": True, **ft},
        },
        environ={},
    )


def runtime(cfg, trainer=TinyTrainer, **kw) -> ftstate.Runtime:
    return ftstate.Runtime(cfg, trainer=trainer, rollout=TinyRollout, **kw)


async def spares_warm(rt, n: int, timeout: float = 30) -> None:
    await wait_until(lambda: sum(m.state == "STANDBY" for m in rt.members()) >= n, timeout, f"{n} warm spares")


async def rollout_replaced(rt, before_kill=lambda: None):
    """Sync once, SIGKILL rollout-1 (``before_kill()`` first) and wait until its failover is
    done; the failover's record."""
    await spares_warm(rt, 2)
    await rt.trainer("train_step")
    await rt.sync()
    before_kill()
    victim = await rt.chaos.kill("rollout", 1)
    await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the failover")
    record = rt.failovers[0]
    assert record.lost == victim and record.resynced
    return record


async def assert_consistent(rt) -> None:
    """Every serving rollout holds the trainer's last committed weights, bit for bit."""
    serving = rt.serving_rollouts()
    assert serving, rt.members()
    sums = await rt.rollout("checksum")
    assert sums == [rt.checksum] * len(serving), (sums, rt.checksum)
    versions = {m.weights_version for m in rt.members() if m.member in serving}
    assert versions == {rt.weights_version}


def budget_spends(rt) -> int:
    return sum(1 for r in rt.audit.records if r["event"] == "budget_spent")


def promotions(rt) -> int:
    return sum(1 for r in rt.audit.records if r["event"] == "transition" and r.get("machine") == "group"
               and r["to"] == "PROMOTING")


async def finish(rt, tmp_path) -> None:
    shrinks = sum(1 for r in rt.audit.records if r.get("trigger") == "shrink")
    assert budget_spends(rt) == promotions(rt) == len(rt.failovers) + shrinks
    pids = [m.pid for m in rt.members()]
    run_id = rt.run_id
    await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
    import ray

    assert_gone(ray, run_id, pids)


async def next_spare_hangs(rt, hang) -> int:
    """Kill a warm rollout spare while ``hang`` (a ``hang_while`` marker) exists: its successor
    starts and hangs in its constructor; returns the hung process's pid."""
    hang.touch()
    spare = next(m.member for m in rt.members() if m.state == "STANDBY" and m.role == "rollout")
    await rt.chaos.kill(spare)
    # the file's name is its pid: its content may not be written yet when it is first seen
    await wait_until(lambda: list(hang.parent.glob(f"{hang.name}.*.pid")), 60, "the next spare to hang")
    [pidfile] = hang.parent.glob(f"{hang.name}.*.pid")
    return int(pidfile.name.removeprefix(f"{hang.name}.").removesuffix(".pid"))


class TestRolloutFailover:
    async def test_an_idle_rollout_killed_is_replaced_by_a_standby_that_gets_the_current_weights(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path))
        await rt.start()
        try:
            record = await rollout_replaced(rt)
            victim = record.lost
            assert record.replacement.startswith("spare-rollout") and record.group_version == 2
            members = {m.member: m for m in rt.members()}
            assert members[victim].state == "RETIRED"
            assert members[record.replacement].rank == 2 and members[record.replacement].state == "READY"
            await assert_consistent(rt)
            await spares_warm(rt, 2)  # a new spare replaced the one used
            # The group works at version 2: a full sync reaches everyone.
            await rt.trainer("train_step")
            report = await rt.sync()
            assert report.group_version == 2 and report.failovers == 0
            await assert_consistent(rt)
            print(f"rollout failover: rerendezvous {record.rerendezvous_s:.3f}s transfer {record.transfer_s:.3f}s "
                  f"total {record.total_s:.3f}s")
        finally:
            await finish(rt, tmp_path)

    async def test_warm_spares_hold_a_resident_staging_buffer_the_size_of_the_weights(self, ray_cluster, tmp_path):
        """After a sync of 32 MiB every warm spare's resident memory grows by that much (its
        staging buffer allocated and touched), and a promoted spare still gets the weights."""
        floats = 8 * 2**20  # 32 MiB of float32
        rt = runtime(config(tmp_path), trainer_kwargs={"big_floats": floats})
        await rt.start()
        try:
            await spares_warm(rt, 2)
            spares = {m.member: m.pid for m in rt.members() if m.state == "STANDBY"}
            before = {n: _rss(pid) for n, pid in spares.items()}
            await rt.sync()
            await wait_until(lambda: all(_rss(pid) - before[n] >= floats * 4 for n, pid in spares.items()), 30,
                             "every spare's staging buffer resident")
            await rt.chaos.kill("rollout", 1)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the failover")
            assert rt.failovers[0].replacement in spares
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)

    async def test_a_rollout_killed_mid_sync_is_replaced_and_the_sync_completes_for_everyone(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path), trainer_kwargs={"big_floats": 1_000_000})
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.sync()
            await rt.trainer("train_step")
            await rt.chaos.kill("rollout", 0, after_progress=3)
            report = await rt.sync()
            assert report.failovers == 1 and report.weights_version == 2
            assert report.checksum == await rt.trainer("checksum")
            await assert_consistent(rt)
            assert len(rt.serving_rollouts()) == 2
        finally:
            await finish(rt, tmp_path)

    async def test_a_hung_rollout_is_declared_lost_and_replaced(self, ray_cluster, tmp_path):
        rt = runtime(config(tmp_path))
        await rt.start()
        pid = None
        try:
            await spares_warm(rt, 2)
            await rt.sync()
            victim = next(m for m in rt.members() if m.member == "rollout-0")
            pid = victim.pid
            await rt.chaos.hang("rollout", 0)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the failover")
            trail = [r["to"] for r in rt.audit.records if r.get("member") == "rollout-0" and r["event"] == "transition"]
            assert trail[-3:] == ["SUSPECT", "LOST", "RETIRED"]
            await assert_consistent(rt)
        finally:
            if pid:
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            await finish(rt, tmp_path)

    async def test_a_hung_rollout_is_declared_lost_within_the_heartbeat_timeout_plus_an_interval(
        self, ray_cluster, tmp_path
    ):
        """Detection time with a timeout much larger than the interval: SUSPECT at the first
        missed heartbeat (within two intervals of the stop), LOST ``heartbeat_timeout_s`` later;
        never earlier than the timeout, and no extra timeout on top."""
        cfg = ftstate.RuntimeConfig.from_dict({**config(tmp_path).to_dict(), "heartbeat_interval_s": 0.25,
                                               "heartbeat_timeout_s": 4.0}, environ={})
        rt = runtime(cfg)
        await rt.start()
        pid = None
        try:
            await rt.sync()
            pid = next(m.pid for m in rt.members() if m.member == "rollout-0")
            t0 = time.monotonic()
            await rt.chaos.hang("rollout", 0)
            state = lambda: next(m.state for m in rt.members() if m.member == "rollout-0")  # noqa: E731
            await wait_until(lambda: state() == "SUSPECT", 10, "rollout-0 suspect")
            suspect_s = time.monotonic() - t0
            await wait_until(lambda: state() in ("LOST", "RETIRED"), 20, "rollout-0 lost")
            lost_s = time.monotonic() - t0
            interval, timeout = cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s
            # slack for scheduling: half the timeout, which a slow detection (a poll bounded by the
            # timeout instead of the interval) adds in full to each figure
            slack = timeout / 2
            assert suspect_s < 2 * interval + slack, suspect_s
            assert timeout <= lost_s < timeout + 3 * interval + slack, (suspect_s, lost_s)
        finally:
            if pid:
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            await rt.close()

    async def test_a_newcomer_whose_every_resync_fails_ends_the_failover_after_resync_retries(
        self, ray_cluster, tmp_path
    ):
        """A newcomer whose every transfer fails without it dying (its engine holds a corrupted
        copy after each load) is never admitted: the failover makes ``resync_retries + 1``
        transfers and fails with that transfer's error, well before ``failover_timeout_s``."""
        marker = tmp_path / "newcomers-are-bad"
        cfg = config(tmp_path, mode="cold", resync_retries=2)
        rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=BadNewcomerRollout,
                             rollout_kwargs={"marker": str(marker)})
        await rt.start()
        try:
            await rt.sync()
            marker.touch()  # the replacement, built after the kill, is bad
            t0 = time.monotonic()
            await rt.chaos.kill("rollout", 0)
            await wait_until(lambda: rt.state == "FAILED", cfg.failover_timeout_s, "the failover to give up")
            elapsed = time.monotonic() - t0
            assert elapsed < cfg.failover_timeout_s / 2, elapsed
            newcomer = next(m.member for m in rt.members() if m.member.startswith("rollout-1-r"))
            resyncs = [r for r in rt.audit.records
                       if r.get("member") == newcomer and r["event"] == "transition" and r.get("trigger") == "resync"]
            assert len(resyncs) == cfg.fault_tolerance.resync_retries + 1, resyncs
            assert newcomer not in rt.serving_rollouts()
            assert not any(r.get("member") == newcomer and r.get("to") == "READY" for r in rt.audit.records)
            with pytest.raises(HeldWeightsMismatch, match=newcomer):
                await rt.sync()
        finally:
            pids = [m.pid for m in rt.members()]
            run_id = rt.run_id
            await rt.close()
        assert check_trail(tmp_path / "audit.jsonl") == []
        import ray

        assert_gone(ray, run_id, pids)

    async def test_a_corrupted_bucket_is_retried_without_spending_the_budget(self, ray_cluster, tmp_path):
        rt = runtime(config(tmp_path))
        await rt.start()
        try:
            await rt.sync()
            await rt.trainer("train_step")
            await rt.chaos.corrupt("rollout", 1)
            report = await rt.sync()
            assert report.weights_version == 2 and report.failovers == 0
            await assert_consistent(rt)
            assert any(r["event"] == "sync_retry" and "ChecksumMismatch" in r["reason"] for r in rt.audit.records)
        finally:
            await finish(rt, tmp_path)

    async def test_cold_mode_starts_a_fresh_actor(self, ray_cluster, tmp_path):
        rt = runtime(config(tmp_path, mode="cold"))
        await rt.start()
        try:
            await rt.sync()
            t0 = time.monotonic()
            await rt.chaos.kill("rollout", 0)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 60, "the cold failover")
            assert rt.failovers[0].replacement.startswith("rollout-1-r")
            await assert_consistent(rt)
            print(f"cold failover: {time.monotonic() - t0:.3f}s")
        finally:
            await finish(rt, tmp_path)


class TestShrinking:
    async def test_with_no_replacement_possible_the_group_carries_on_degraded(self, ray_cluster, tmp_path):
        marker = tmp_path / "no-more-rollouts"
        rt = runtime(config(tmp_path, mode="cold", rollout_workers=3), rollout_kwargs={"fail_marker": str(marker)})
        await rt.start()
        try:
            await rt.sync()
            marker.write_text("")  # from now on no rollout can start
            await rt.chaos.kill("rollout", 2)
            # (READY with 2 serving also holds for a moment before the loss is handled: wait for the shrink)
            await wait_until(lambda: any(r.get("trigger") == "shrink" for r in rt.audit.records)
                             and rt.state == "READY" and len(rt.serving_rollouts()) == 2, 60, "the shrink")
            await rt.trainer("train_step")
            report = await rt.sync()
            assert report.rollouts == ("rollout-0", "rollout-1")
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)

    async def test_below_min_rollout_workers_the_run_fails_naming_why(self, ray_cluster, tmp_path):
        marker = tmp_path / "no-more-rollouts"
        rt = runtime(config(tmp_path, mode="cold", min_rollout_workers=2), rollout_kwargs={"fail_marker": str(marker)})
        await rt.start()
        try:
            await rt.sync()
            marker.write_text("")
            await rt.chaos.kill("rollout", 1)
            await wait_until(lambda: rt.state == "FAILED", 60, "the run to fail")
            with pytest.raises(MemberLost, match="fewer than min_rollout_workers=2"):
                await rt.sync()
        finally:
            await rt.close()


    async def test_spares_that_cannot_start_are_not_restarted_forever(self, ray_cluster, tmp_path):
        """A spare's constructor that keeps failing (a bad node, a bug) must not churn actors
        forever: after fault_tolerance.spare_start_attempts spares died warming, the role goes without one
        (recorded), and a later loss is handled as with no spare: here, by shrinking."""
        marker = tmp_path / "no-more-rollouts"
        rt = runtime(config(tmp_path, min_rollout_workers=1), rollout_kwargs={"fail_marker": str(marker)})
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.sync()
            marker.touch()  # from now on a rollout's constructor raises

            def rollout_spares() -> int:
                return sum(1 for m in rt.members() if m.role == "rollout" and m.rank < 0)

            spare = next(m.member for m in rt.members() if m.state == "STANDBY" and m.role == "rollout")
            await rt.chaos.kill(spare)
            await wait_until(lambda: any(r["event"] == "spare_unavailable" for r in rt.audit.records), 60,
                             "the runtime to give up on rollout spares")
            [gave_up] = [r for r in rt.audit.records if r["event"] == "spare_unavailable"]
            attempts = rt.config.fault_tolerance.spare_start_attempts
            assert (gave_up["role"], gave_up["attempts"]) == ("rollout", attempts)
            started = rollout_spares()
            assert started == 1 + attempts
            await asyncio.sleep(2)
            assert rollout_spares() == started, "no more spares after giving up"
            # the run goes on: a rollout lost now has neither spare nor startable actor
            await rt.chaos.kill("rollout", 1)
            await wait_until(lambda: rt.state == "READY" and len(rt.serving_rollouts()) == 1, 30, "the group to shrink")
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            marker.unlink(missing_ok=True)
            await finish(rt, tmp_path)


    async def test_a_spare_hung_while_warming_is_abandoned_for_a_fresh_actor(self, ray_cluster, tmp_path):
        """A spare that hangs in its constructor (a bad node) would make the next failover
        wait out failover_timeout_s and fail the run. It is abandoned once it takes more than
        twice as long as any spare that got warm, killed, and a fresh actor replaces the loss."""
        hang = tmp_path / "hang-while"
        # The bound is twice the slowest warm-up, and on a loaded machine a warm-up reaches ~22 s:
        # the abandon (~44 s) plus a fresh actor's warm-up must fit the failover's deadline.
        cfg = ftstate.RuntimeConfig.from_dict({**config(tmp_path).to_dict(), "failover_timeout_s": 120},
                                              environ={})
        rt = runtime(cfg, rollout_kwargs={"hang_while": str(hang)})
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.sync()
            hung_pid = await next_spare_hangs(rt, hang)
            hang.unlink()  # a fresh actor started from now on constructs normally
            await rt.chaos.kill("rollout", 1)
            # Waiting for the hung spare would last the failover's deadline out and fail the run.
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", cfg.failover_timeout_s,
                             "the failover")
            [f] = rt.failovers
            assert not f.replacement.startswith("spare-"), f  # a fresh actor
            [abandoned] = [r for r in rt.audit.records if r["event"] == "spare_abandoned"]
            assert abandoned["warming_s"] >= abandoned["bound_s"] > 0
            await wait_until(lambda: not os.path.exists(f"/proc/{hung_pid}"), 10, "the hung spare to be killed")
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            hang.unlink(missing_ok=True)
            await finish(rt, tmp_path)

    async def test_a_spare_that_never_starts_is_replaced_after_init_timeout(self, ray_cluster, tmp_path):
        """A spare stuck in its constructor past init_timeout_s (its INIT deadline) is FAILED;
        its actor is killed and another spare takes its place (a chaos soak found spares
        that failed so and were never replaced: the role silently ran short)."""
        hang = tmp_path / "hang-while"
        cfg = ftstate.RuntimeConfig.from_dict({**config(tmp_path).to_dict(), "init_timeout_s": 25}, environ={})
        rt = runtime(cfg, rollout_kwargs={"hang_while": str(hang)})
        await rt.start()
        try:
            await spares_warm(rt, 2)
            hung_pid = await next_spare_hangs(rt, hang)
            hang.unlink()  # the one after it constructs normally
            await wait_until(lambda: any(r.get("trigger") == "start_timeout" for r in rt.audit.records), 60,
                             "the hung spare's INIT deadline")
            await wait_until(lambda: not os.path.exists(f"/proc/{hung_pid}"), 15, "the hung spare to be killed")
            await spares_warm(rt, 2, timeout=60)
            await rt.sync()
            await assert_consistent(rt)
        finally:
            hang.unlink(missing_ok=True)
            pids = [m.pid for m in rt.members()]
            run_id = rt.run_id
            await rt.close()
        assert check_trail(tmp_path / "audit.jsonl") == []
        import ray

        assert_gone(ray, run_id, [*pids, hung_pid])


class TestBudgets:
    async def test_the_next_loss_after_the_budget_is_spent_fails_the_run_naming_the_spent_failures(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path, max_failovers=1))
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.sync()
            first = await rt.chaos.kill("rollout", 0)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the first failover")
            await spares_warm(rt, 2)
            await rt.chaos.kill("rollout", 1)
            await wait_until(lambda: rt.state == "FAILED", 30, "the run to fail")
            with pytest.raises(FailoverBudgetExhausted, match=rf"max_failovers=1 already spent on: {first}"):
                await rt.sync()
        finally:
            await finish(rt, tmp_path)


class TestTrainerFailover:
    async def test_a_killed_trainer_is_rebuilt_from_a_rollout_and_the_step_is_rerun(self, ray_cluster, tmp_path):
        rt = runtime(config(tmp_path))
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.trainer("train_step")
            report = await rt.sync()
            await rt.chaos.kill("trainer", 0)
            # The loop just calls on: the call lands on the replacement once it holds version 1.
            await asyncio.sleep(0.05)
            await rt.trainer("pid")
            assert rt.failovers and rt.failovers[0].role == "trainer" and rt.failovers[0].resynced
            assert await rt.trainer("checksum") == report.checksum, "the new trainer holds the committed weights"
            await rt.trainer("train_step")
            report2 = await rt.sync()
            assert report2.weights_version == 2
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)

    async def test_without_reverse_sync_a_new_trainer_loads_the_checkpoint(self, ray_cluster, tmp_path):
        ckpt = tmp_path / "ckpt"
        rt = runtime(config(tmp_path, reverse_weight_sync=False, checkpoint_dir=str(ckpt)))
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.trainer("train_step")
            saved = await rt.trainer("save_checkpoint", str(ckpt))
            await rt.sync()
            await rt.chaos.kill("trainer", 0)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the trainer failover")
            assert await rt.trainer("checksum") == saved
            report = await rt.sync()
            await assert_consistent(rt)
            assert report.checksum == saved
        finally:
            await finish(rt, tmp_path)

    @pytest.mark.parametrize("role", ["rollout", "trainer"])
    async def test_a_member_killed_before_the_first_group_forms_is_replaced(self, ray_cluster, tmp_path, role):
        """Fault tolerance on: a member SIGKILLed while the initial rendezvous waits for it is
        replaced (cold mode: a fresh actor) and group version 2 forms with everyone; the
        survivors waiting in version 1 are released by the fence, not by init_timeout_s."""
        marker = tmp_path / "hang-once"
        cfg = config(tmp_path, mode="cold", max_failovers=1)
        rt = runtime(cfg, **{f"{role}_kwargs": {"hang_marker": str(marker)}})
        starting = asyncio.ensure_future(rt.start())
        try:
            await wait_until(lambda: marker.exists() and marker.read_text().strip(), 60, "a rollout to hang in init")
            os.kill(int(marker.read_text()), signal.SIGKILL)
            # released by the fence: a wait for the dead member would last init_timeout_s out
            await asyncio.wait_for(starting, cfg.init_timeout_s / 2)
            assert rt.state == "READY" and rt.group_version == 2
            [f] = rt.failovers
            assert f.role == role and f.replacement and f.group_version == 2
            lost = next(r for r in rt.audit.records if r.get("member") == f.lost and r.get("to") == "LOST")
            assert lost["from"] == "RENDEZVOUS" and lost["trigger"] == "died"
            await rt.trainer("train_step")
            report = await rt.sync()
            if role == "rollout":
                assert not f.resynced  # nothing to resync before the first sync
                assert set(report.rollouts) == {"rollout-0", "rollout-1"} - {f.lost} | {f.replacement}
            else:  # a new trainer starts from its own construction, as the first one would have
                assert f.lost == "trainer-0" and await rt.trainer("pid") != int(marker.read_text())
            await assert_consistent(rt)
        finally:
            if not starting.done():
                starting.cancel()
            await finish(rt, tmp_path)

    async def test_optimizer_state_comes_from_the_checkpoint_and_weights_from_a_rollout(self, ray_cluster, tmp_path):
        ckpt = tmp_path / "ckpt"
        rt = runtime(config(tmp_path, optimizer_state="checkpoint", checkpoint_dir=str(ckpt)))
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.trainer("train_step")
            await rt.trainer("save_checkpoint", str(ckpt))
            saved_optimizer = await rt.trainer("optimizer_checksum")
            await rt.trainer("train_step")  # weights move on past the checkpoint
            report = await rt.sync()
            fresh_optimizer = await rt.handle(
                next(m.member for m in rt.members() if m.state == "STANDBY" and m.role == "trainer")
            ).call.remote(UserCall("optimizer_checksum"))
            assert fresh_optimizer != saved_optimizer  # so the check below can fail
            await rt.chaos.kill("trainer", 0)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the trainer failover")
            # weights: the last committed version, from a rollout (not the older checkpoint)
            assert await rt.trainer("checksum") == report.checksum
            # optimizer: what the checkpoint holds (no rollout has it)
            assert await rt.trainer("optimizer_checksum") == saved_optimizer
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)

    async def test_lossy_weights_are_not_turned_back_into_a_trainer(self, ray_cluster, tmp_path):
        rt = runtime(config(tmp_path), trainer=LossyTrainer)
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.sync()
            await rt.chaos.kill("trainer", 0)
            await wait_until(lambda: rt.state == "FAILED", 30, "the run to fail")
            with pytest.raises(LossyRecoveryRefused, match="lossy_state_dict is true"):
                await rt.trainer("train_step")
        finally:
            await rt.close()


async def test_a_generation_wedged_while_its_actor_answers_is_lost_and_replaced_and_a_long_one_is_not(ray_cluster, tmp_path):
    """A rollout whose ``activity()`` reports its generation's steps: one that keeps stepping for
    longer than the heartbeat timeout is left alone; one whose steps stop (a kernel stuck with the
    GIL released: the actor answers every heartbeat) is suspected after half the timeout, LOST at
    its SUSPECT deadline, killed and replaced by a spare holding the trainer's weights, and the
    call that waited on it fails instead of waiting for ever."""
    cfg = config(tmp_path, mode="standby", standby_workers=1)
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=SteppingRollout)
    await rt.start()
    try:
        await spares_warm(rt, 2)
        await rt.sync()
        long_s = 2 * cfg.heartbeat_timeout_s
        await rt.rollout("generate", "steady", int(long_s / 0.05), 0.05)  # moving all along: nobody suspected
        assert all(m.state in ("READY", "STANDBY") for m in rt.members()), rt.members()
        assert not rt.failovers

        wedged = rt.serving_rollouts()[0]
        await rt.handle(wedged).call.remote(UserCall("wedge_next_generate"))
        t0 = time.monotonic()
        stuck = asyncio.ensure_future(rt.handle(wedged).call.remote(UserCall("generate", ("stuck",))))
        await wait_until(lambda: any(m.member == wedged and m.state == "SUSPECT" for m in rt.members()), 10,
                         f"{wedged} suspected")
        suspected_s = time.monotonic() - t0
        await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the failover")
        lost_s = time.monotonic() - t0
        assert cfg.heartbeat_timeout_s / 2 - cfg.heartbeat_interval_s <= suspected_s, suspected_s
        # its SUSPECT deadline and the polls to see it, plus scheduling (and the spare's resync);
        # a wedge nobody detects is never lost (the actor answers every heartbeat)
        assert lost_s < 1.5 * cfg.heartbeat_timeout_s + 4 * cfg.heartbeat_interval_s + SLACK_S, lost_s
        with pytest.raises(Exception):  # noqa: B017 - its actor was killed: Ray's death, whatever its class
            await asyncio.wait_for(stuck, 30)
        (record,) = rt.failovers
        assert record.lost == wedged and record.resynced
        await assert_consistent(rt)
    finally:
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
