"""The route plan across nodes: the trainer's node reads shared memory, another node the collective.

Trainer on node ``a``; three rollouts spread over ``a`` and ``b`` (so both nodes hold some).
One sync then mixes both routes in one transfer: the rollouts on ``a`` read every bucket
from /dev/shm, those on ``b`` receive it point to point over gloo. Every rollout ends with
the trainer's weights (the workers' own checksums), the plan is in the sync's audit record
and ``SyncReport.routes`` matches the nodes the members report.
"""

from __future__ import annotations

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import LABEL, resource
from tests.multinode.test_node_loss import config, consistent

pytestmark = pytest.mark.ray


async def test_one_sync_mixes_shared_memory_on_the_trainers_node_and_the_collective_to_another(
    multinode_cluster, tmp_path
):
    placement = {"placement": {"trainer": {"resources": {resource("a"): 1}},
                               "rollout": {"strategy": "SPREAD", "labels": {LABEL: "in(a,b)"}}}}
    cfg = config(tmp_path, rollout_workers=3, **placement).replace(**{"fault_tolerance.enable": False})
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    await rt.start()
    try:
        members = {m.member: m for m in rt.members()}
        trainer_node = members["trainer-0"].node_id
        assert trainer_node == multinode_cluster.node_id("a")
        expected = {n: "shm" if m.node_id == trainer_node else "collective"
                    for n, m in members.items() if m.role == "rollout"}
        assert set(expected.values()) == {"shm", "collective"}, {n: m.node_id for n, m in members.items()}
        for _ in range(2):
            await rt.trainer("train_step")
            report = await rt.sync()
            await consistent(rt)
            assert report.routes == expected and report.shm_fallback is None
        plan = [r for r in rt.audit.records if r.get("trigger") == "sync_start"][-1]["plan"]
        assert plan["routes"] == expected and plan["sender"] == "trainer-0"
        remote = [n for n, how in expected.items() if how == "collective"]
        assert plan["remote_nodes"] == {multinode_cluster.node_id("b")[:8]: remote}
    finally:
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
