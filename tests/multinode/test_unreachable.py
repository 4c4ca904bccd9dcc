"""A sync that meets a member which is unreachable but not yet declared lost, with the default
heartbeats (``heartbeat_interval_s`` 1, ``heartbeat_timeout_s`` 10).

Found by random fault schedules on a multi-node cluster (issue 22): a node is lost abruptly, so
its actors are *unreachable* (Ray's ``ActorUnavailableError``), not reported dead, until Ray's
own node health check gives up on them; with a heartbeat timeout of 10 s the watchdog has not
declared them LOST either when the next sync runs. That sync failed on the unreachable rollout,
then formed the next group version with it (the join failed, the others were left joining in
the background) and retried under that version, which no member held: every member answered
"not a member of any group version" and the run died with a bare ``FTError``.

Now a sync that meets an unreachable member waits for the watchdog's verdict on it (LOST, then
replaced; or alive again), and never transfers under a version that was not formed. Each test
below is one of the schedules that failed, on real processes with a real node loss (the
raylet and every process it started SIGKILLed), and checks that nothing was lost: every serving
rollout holds the trainer's bytes (the workers' own hashes) at the reported version.
"""

from __future__ import annotations

import pytest

import ftstate
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import resource
from tests.multinode.test_node_loss import assert_nothing_left, by_name, consistent, spares_warm

pytestmark = pytest.mark.ray


def default_heartbeats(tmp_path) -> ftstate.RuntimeConfig:
    """1 trainer on node a, 3 rollouts spread, 2 spares per role, fault tolerance on, and the
    heartbeat settings left at their defaults (the defect needs a timeout longer than a sync's
    failure takes)."""
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": 3,
        "bucket_size_mb": 0.0625,
        "init_timeout_s": 60,
        "sync_timeout_s": 120,
        "failover_timeout_s": 60,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "mode": "standby", "standby_workers": 2, "max_failovers": 6},
        "placement": {"trainer": {"resources": {resource("a"): 1}}},
    }, environ={})


def never_unformed(rt) -> None:
    """No member was ever asked to transfer under a version it had not joined, and every sync
    that ran went through a formed version."""
    text = "\n".join(str(r.get("reason", "")) for r in rt.audit.records)
    assert "not a member of any group version" not in text
    formed = {1} | {r["group_version"] for r in rt.audit.records if r["event"] == "group_formed"}
    synced = {r["group_version"] for r in rt.audit.records
              if r["event"] == "transition" and r.get("member") == "group" and r.get("trigger") == "sync_start"}
    assert synced <= formed, (synced, formed)


async def test_a_node_with_a_rollout_and_a_trainer_spare_lost_then_a_sync(restore_nodes, tmp_path) -> None:
    import ray

    mn = restore_nodes
    cfg = default_heartbeats(tmp_path)
    assert (cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s) == (1.0, 10.0)
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt, 4)
        first = await rt.sync()
        members = by_name(rt)
        # A node (not the driver's) that holds a rollout and a trainer's spare: spares keep off
        # the trainer's node a, and the three rollouts spread over a, b and c.
        nodes = {mn.name_of(m.node_id) for m in members.values()
                 if m.role == "trainer" and m.rank < 0 and m.state == "STANDBY"}
        victim = next(n for n in sorted(nodes - {"a"})
                      if any(m.role == "rollout" and m.rank >= 0 and mn.name_of(m.node_id) == n
                             for m in members.values()))
        lost_rollouts = sorted(n for n, m in members.items()
                               if m.role == "rollout" and m.rank >= 0 and mn.name_of(m.node_id) == victim)
        lost_node = mn.node_id(victim)
        mn.kill(victim)
        await rt.trainer("train_step")
        report = await rt.sync()
        assert report.weights_version == first.weights_version + 1 == rt.weights_version
        assert sorted(f.lost for f in rt.failovers) == lost_rollouts
        # The sync met the unreachable rollout, waited for its verdict, and retried only once
        # the membership had changed (not a transient retry into an unformed version).
        retries = [r for r in rt.audit.records if r["event"] == "sync_retry"]
        assert retries and all(r["membership_changed"] for r in retries), retries
        never_unformed(rt)
        serving = rt.serving_rollouts()
        assert len(serving) == 3 and not set(serving) & set(lost_rollouts)
        assert all(by_name(rt)[n].node_id != lost_node for n in serving)
        await consistent(rt)
        await rt.trainer("train_step")
        again = await rt.sync()
        assert again.weights_version == report.weights_version + 1
        await consistent(rt)
        pids = [m.pid for m in rt.members()]
        run_id = rt.run_id
    assert_nothing_left(ray, run_id, pids)


async def test_two_hung_rollouts_then_a_node_loss(restore_nodes, tmp_path) -> None:
    """The seeded schedule that failed: two rollouts SIGSTOPped, then the third one's node lost."""
    import ray

    mn = restore_nodes
    rt = ftstate.Runtime(default_heartbeats(tmp_path), trainer=TinyTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt, 4)
        first = await rt.sync()
        members = by_name(rt)
        rollouts = sorted((n, mn.name_of(m.node_id)) for n, m in members.items() if m.role == "rollout" and m.rank >= 0)
        victim_rollout, victim = next((n, node) for n, node in rollouts if node != "a")
        hung = [n for n, _ in rollouts if n != victim_rollout]
        for name in hung:
            await rt.chaos.hang("rollout", int(name.rsplit("-", 1)[1]))
        await rt.trainer("train_step")
        lost_node = mn.node_id(victim)
        mn.kill(victim)
        try:
            report = await rt.sync()
        except ftstate.FTError as exc:
            # Ending is allowed only with a typed error the budget or the cluster explains.
            assert type(exc) is not ftstate.FTError, f"a bare FTError reached the user: {exc}"
            raise
        assert report.weights_version == first.weights_version + 1 == rt.weights_version
        assert sorted(f.lost for f in rt.failovers) == sorted([*hung, victim_rollout])
        never_unformed(rt)
        serving = rt.serving_rollouts()
        assert serving and not set(serving) & {*hung, victim_rollout}
        assert all(by_name(rt)[n].node_id != lost_node for n in serving)
        await consistent(rt)
        pids = [m.pid for m in rt.members()]
        run_id = rt.run_id
    assert_nothing_left(ray, run_id, pids)
