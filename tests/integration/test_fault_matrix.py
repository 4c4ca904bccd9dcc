"""The fault matrix: every fault x target x phase on real processes, on a local Ray cluster.

fault:  kill (SIGKILL), hang (SIGSTOP: alive, no progress), corrupt (a flipped byte in the
        next bucket the target receives)
target: a rollout, the trainer, a standby, two rollouts at once
phase:  idle (between syncs), mid-sync (inside a broadcast), during a train step, during
        a re-rendezvous (the target is armed to fail on its next unit of progress, which is
        joining the next group version, and a bystander rollout is killed to start a failover)

To fit CI on 2 cores, one runtime per (phase, fault) absorbs the four targets in turn
(a long-running job meeting one failure after another, which is also what production
looks like). After each target: the step's sync completes, every serving rollout holds
exactly the trainer's committed weights (checksum), the failover budget was spent exactly
once per promotion. At the end: `ftstate audit --check` passes on the run's trail (so no
serving worker ever held a torn or stale version) and no actor or process is left.

Corrupting a trainer or a standby is a no-op (neither receives buckets in a sync); those
cells check that nothing breaks. The slowest set is marked `slow`; it runs in `make test`.
"""

from __future__ import annotations

import asyncio

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from tests.integration.test_runtime import assert_gone, wait_until
from tests.integration.workers import TinyRollout, TinyTrainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TARGETS = ("rollout", "trainer", "standby", "two rollouts")


def config(tmp_path) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": 2,
            "bucket_size_mb": 0.0625,
            "init_timeout_s": 60,
            "sync_timeout_s": 60,
            "failover_timeout_s": 30,
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 2.0,
            "audit_log": str(tmp_path / "audit.jsonl"),
            "fault_tolerance": {"enable": True, "reverse_weight_sync": True, "max_failovers": 20,
                                "standby_workers": 1},
        },
        environ={},
    )


async def hit(rt, fault: str, name: str, *, after_progress: int | None = None) -> None:
    """One fault on one member (corrupt always hits the next bucket it receives)."""
    if fault == "kill":
        await rt.chaos.kill(name, after_progress=after_progress)
    elif fault == "hang":
        await rt.chaos.hang(name, after_progress=after_progress)
    else:
        await rt.chaos.corrupt(name)


async def inject(rt, fault: str, target: str, *, after_progress: int | None = None,
                 spare_role: str | None = None) -> list[str]:
    """Inject ``fault`` at ``target``; returns the members hit."""
    if target == "standby":
        spare = next((m.member for m in rt.members() if m.state == "STANDBY"
                      and (spare_role is None or m.role == spare_role)), None)
        assert spare is not None, rt.members()
        names = [spare]
        if spare_role is None:
            after_progress = None  # an idle spare makes no progress: hit it now
    elif target == "two rollouts":
        names = rt.serving_rollouts()[:2]
    elif target == "trainer":
        names = [next(m.member for m in rt.members() if m.role == "trainer" and m.rank == 0)]
    else:
        names = rt.serving_rollouts()[-1:]
    for name in names:
        await hit(rt, fault, name, after_progress=after_progress)
    return names


async def step(rt) -> ftstate.SyncReport:
    await rt.trainer("train_step")
    return await rt.sync()


async def assert_consistent(rt) -> None:
    serving = rt.serving_rollouts()
    assert serving, rt.members()
    assert await rt.rollout("checksum") == [rt.checksum] * len(serving)
    assert rt.checksum == await rt.trainer("checksum")


def budget_ok(rt) -> None:
    spent = sum(1 for r in rt.audit.records if r["event"] == "budget_spent")
    promoted = sum(1 for r in rt.audit.records if r["event"] == "transition" and r.get("machine") == "group"
                   and r["to"] == "PROMOTING")
    # One unit per replaced member; one entry into PROMOTING per failover round (members lost
    # together, e.g. the "two rollouts" target, are replaced in one round).
    rounds = {f.group_version for f in rt.failovers}
    assert spent == len(rt.failovers) and promoted == len(rounds), (spent, promoted, len(rt.failovers), rounds)


@pytest.mark.parametrize("fault", ["kill", "hang", "corrupt"])
@pytest.mark.parametrize("phase", ["idle", "mid-sync", "train-step", "rendezvous"])
async def test_fault_matrix(ray_cluster, tmp_path, phase, fault):
    rt = ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=TinyRollout,
                         trainer_kwargs={"big_floats": 200_000})
    await rt.start()
    version = 0
    try:
        await wait_until(lambda: sum(m.state == "STANDBY" for m in rt.members()) >= 2, 60, "warm spares")
        version = (await step(rt)).weights_version
        for target in TARGETS:
            if fault == "corrupt" and phase == "train-step" and target != "rollout":
                continue  # no buckets move during a train step: covered by the idle phase
            await wait_until(lambda: sum(m.state == "STANDBY" for m in rt.members()) >= 1, 60, "a warm spare")
            if phase == "idle":
                await inject(rt, fault, target)
                report = await step(rt)
            elif phase == "mid-sync":
                await rt.trainer("train_step")
                await inject(rt, fault, target, after_progress=3)
                report = await rt.sync()
            elif phase == "rendezvous":
                await rt.trainer("train_step")
                serving = rt.serving_rollouts()
                if target == "two rollouts":
                    # One is killed outright, the other fails while the group re-forms.
                    await rt.chaos.kill(serving[0])
                    await hit(rt, fault, serving[1], after_progress=1)
                else:
                    await wait_until(lambda: any(m.state == "STANDBY" and m.role == "rollout"
                                                 for m in rt.members()), 60, "a warm rollout spare")
                    armed = await inject(rt, fault, target, after_progress=1, spare_role="rollout")
                    bystander = next(n for n in serving if n not in armed)
                    await rt.chaos.kill(bystander)
                report = await rt.sync()
            else:  # a fault while the trainer is inside a (long) train step
                call = asyncio.ensure_future(rt.trainer("train_step", 0.1, 0.6))
                await asyncio.sleep(0.2)
                await inject(rt, fault, target)
                await call
                report = await rt.sync()
            version += 1
            assert report.weights_version == version, (target, report)
            await assert_consistent(rt)
            budget_ok(rt)
    finally:
        pids = [m.pid for m in rt.members()]
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
    import ray

    assert_gone(ray, rt.run_id, pids)
