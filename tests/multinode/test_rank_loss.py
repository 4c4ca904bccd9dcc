"""Across nodes: a node holding one trainer rank of two (and a rollout) is lost, or drained.

Trainer ranks spread over nodes ``a`` and ``c``, rollouts over ``b`` and ``c``. Killing node
``c`` (its raylet and every process on it, in one instant) loses trainer rank k and a rollout
together: one failover round under one group version, the rank first (its part of the last
sync back from the rollout that survived on ``b``, and with calls since the sync every rank
back to it and replaying together), then the rollout. The surviving rank keeps its process;
every serving rollout ends with the full state of a fault-free run of the same steps.
"""

from __future__ import annotations

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from tests.integration.workers import PartTrainer, TinyRollout
from tests.multinode.harness import LABEL
from tests.multinode.test_node_loss import assert_nothing_left, by_name, config, spares_warm, spent

pytestmark = pytest.mark.ray


async def test_a_node_with_a_trainer_rank_and_a_rollout_is_one_round(restore_nodes, tmp_path) -> None:
    import ray

    mn = restore_nodes
    placement = {"placement": {"trainer": {"strategy": "STRICT_SPREAD", "labels": {LABEL: "in(a,c)"}},
                               "rollout": {"strategy": "STRICT_SPREAD", "labels": {LABEL: "in(b,c)"}}}}
    rt = ftstate.Runtime(config(tmp_path, trainer_workers=2, **placement), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt)
        await rt.sync()
        await rt.trainer("train_step", 1)
        members = by_name(rt)
        node_c = mn.node_id("c")
        on_c = sorted(n for n, m in members.items() if m.node_id == node_c and m.rank >= 0)
        assert len(on_c) == 2 and sum(n.startswith("trainer-") for n in on_c) == 1, members
        survivor = next(m for m in members.values() if m.role == "trainer" and m.rank >= 0 and m.node_id != node_c)
        v0, before = rt.group_version, spent(rt)
        mn.kill("c")
        assert await rt.trainer("train_step", 2) == 3  # made on both ranks once the lost one is replaced
        report = await rt.sync()
        assert report.checksum == PartTrainer.reference([1, 2], 2)
        assert await rt.rollout("checksum") == [report.checksum] * 2
        rounds = [r for r in rt.audit.records if r["event"] == "failover"]
        assert sorted(r["lost"] for r in rounds) == on_c and {r["group_version"] for r in rounds} == {v0 + 1}
        assert rounds[0]["lost"].startswith("trainer-") and spent(rt) - before == 1  # one node, one unit
        after = by_name(rt)
        assert after[survivor.member].pid == survivor.pid  # the surviving rank kept its process
        assert all(m.node_id != node_c for m in after.values() if m.rank >= 0 and m.state == "READY")
        pids = [m.pid for m in rt.members()]
        run_id = rt.run_id
    assert_nothing_left(ray, run_id, pids)
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_node_with_a_trainer_rank_is_drained_without_spending_the_budget(restore_nodes, tmp_path) -> None:
    """A drain moves trainer rank k ahead of the node's maintenance: the rank retires (trainer
    calls paused), a replacement on another node takes rank k and gets its part back, the
    calls since the sync replayed; nothing of max_failovers is spent, rank 0 keeps its process."""
    mn = restore_nodes
    placement = {"placement": {"trainer": {"strategy": "STRICT_SPREAD", "labels": {LABEL: "in(a,c)"}},
                               "rollout": {"labels": {LABEL: "in(a,b)"}}}}
    rt = ftstate.Runtime(config(tmp_path, trainer_workers=2, **placement), trainer=PartTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt)
        await rt.sync()
        await rt.trainer("train_step", 1)
        members = by_name(rt)
        node_c = mn.node_id("c")
        [on_c] = [m for m in members.values() if m.node_id == node_c and m.rank >= 0]
        assert on_c.role == "trainer", members
        survivor = next(m for m in members.values() if m.role == "trainer" and m.rank >= 0 and m is not on_c)
        before = spent(rt)
        record = await rt.drain(node_c, reason="host maintenance", source="api", kind="terminate")
        assert record.outcome == "drained" and list(record.moved) == [on_c.member], record
        assert spent(rt) == before and rt.failovers == []
        assert await rt.trainer("train_step", 2) == 3
        report = await rt.sync()
        assert report.checksum == PartTrainer.reference([1, 2], 2)
        assert await rt.rollout("checksum") == [report.checksum] * 2
        after = by_name(rt)
        assert after[survivor.member].pid == survivor.pid
        moved = after[record.moved[on_c.member]]
        assert moved.rank == on_c.rank and moved.node_id != node_c and moved.state == "READY"
        [recovered] = [r for r in rt.audit.records if r["event"] == "trainer_ranks_recovered"]
        assert recovered["newcomers"] == [moved.member] and recovered["replayed"] == ["train_step"]
    assert check_trail(tmp_path / "audit.jsonl") == []
