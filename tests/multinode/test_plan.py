"""The route plan across nodes: the trainer's node reads shared memory, one copy per other node.

Trainer on node ``a``; three rollouts spread over ``a`` and ``b`` (so both nodes hold some).
One sync then mixes the routes in one transfer: the rollouts on ``a`` read every bucket
from /dev/shm, the lowest rank on ``b`` receives it point to point over gloo and, when ``b``
holds another rollout, relays it there through ``b``'s shared memory. With all three
rollouts on ``b``, one copy crosses the network and two read the relay's slots; a relay
SIGKILLed in the middle of a sync ends the transfer for everyone, nothing is committed,
nothing is left in /dev/shm, and the sync goes through after the failover. With ``staging:
node`` the relay receives into its node's copy (owned by that node's agent) and its peers
verify it in place. Every rollout ends
with the trainer's weights (the workers' own checksums), the plan is in the sync's audit
record and ``SyncReport.routes`` matches the nodes the members report.
"""

from __future__ import annotations

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.protocol import ChaosKill
from ftstate.transport import nodecopy, shm
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import LABEL, resource
from tests.multinode.test_node_loss import config, consistent

pytestmark = pytest.mark.ray


def planned_routes(members: dict, trainer_node: str) -> dict[str, str]:
    """What the plan should say: shm on the trainer's node, the lowest rank of every other node
    the collective, its node peers the relay."""
    rollouts = sorted((m for m in members.values() if m.role == "rollout" and m.rank >= 0), key=lambda m: m.rank)
    routes, relays = {}, {}
    for m in rollouts:
        if m.node_id == trainer_node:
            routes[m.member] = "shm"
        elif m.node_id in relays:
            routes[m.member] = "relay"
        else:
            relays[m.node_id] = m.member
            routes[m.member] = "collective"
    return routes


async def two_syncs(rt, routes: dict[str, str]) -> dict:
    """Two steps and syncs, each leaving every rollout with the trainer's weights by ``routes``;
    returns the plan of the last sync's audit record."""
    for _ in range(2):
        await rt.trainer("train_step")
        report = await rt.sync()
        await consistent(rt)
        assert report.routes == routes and report.shm_fallback is None
    return [r for r in rt.audit.records if r.get("trigger") == "sync_start"][-1]["plan"]


def segments_of(pids) -> list[str]:
    return [n for n in shm.list_segments() if any(f"-p{p}-" in n for p in pids if p)]


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
        expected = planned_routes(members, trainer_node)
        assert {"shm", "collective"} <= set(expected.values()), {n: m.node_id for n, m in members.items()}
        plan = await two_syncs(rt, expected)
        assert plan["routes"] == expected and plan["sender"] == "trainer-0"
        remote = [n for n, how in expected.items() if how != "shm"]
        assert plan["remote_nodes"] == {multinode_cluster.node_id("b")[:8]: remote}
    finally:
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []


def all_on_b(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    placement = {"placement": {"trainer": {"resources": {resource("a"): 1}},
                               "rollout": {"resources": {resource("b"): 1}}}}
    return config(tmp_path, rollout_workers=3, **placement, **overrides)


async def test_one_copy_crosses_to_a_remote_node_and_its_relay_fans_it_out_there(multinode_cluster, tmp_path):
    cfg = all_on_b(tmp_path).replace(**{"fault_tolerance.enable": False})
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    await rt.start()
    try:
        members = {m.member: m for m in rt.members()}
        b = multinode_cluster.node_id("b")
        assert {m.node_id for m in members.values() if m.role == "rollout"} == {b}
        expected = planned_routes(members, members["trainer-0"].node_id)
        relay = next(n for n, how in expected.items() if how == "collective")
        peers = sorted(n for n, how in expected.items() if how == "relay")
        assert len(peers) == 2
        plan = await two_syncs(rt, expected)
        assert plan["routes"] == expected
        assert plan["relays"] == {b[:8]: {"relay": relay, "peers": peers}}
        assert segments_of([m.pid for m in members.values()]) == []
    finally:
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_with_staging_node_the_relay_receives_into_its_nodes_copy_and_its_peers_verify_it(
    multinode_cluster, tmp_path
):
    cfg = all_on_b(tmp_path, staging="node").replace(**{"fault_tolerance.enable": False})
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    await rt.start()
    try:
        members = {m.member: m for m in rt.members()}
        b = multinode_cluster.node_id("b")
        expected = planned_routes(members, members["trainer-0"].node_id)
        await two_syncs(rt, expected)
        # one agent, on b: the trainer's node holds no rollout, so no copy is made there
        assert [r["node"] for r in rt.audit.records if r["event"] == "node_agent_started"] == [b[:8]]
        committed = [r for r in rt.audit.records if r["event"] == "node_copy_committed"]
        assert [r["node"] for r in committed] == [b[:8]] * 2
        assert [n for n in shm.list_segments() if nodecopy.is_copy(n)] == [committed[-1]["segment"]]
    finally:
        await rt.close()
    assert [n for n in shm.list_segments() if nodecopy.is_copy(n)] == []
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_relay_killed_mid_transfer_nothing_committed_nothing_left_the_sync_recovers(
    multinode_cluster, tmp_path
):
    rt = ftstate.Runtime(all_on_b(tmp_path), trainer=TinyTrainer, rollout=TinyRollout,
                         trainer_kwargs={"big_floats": 200_000})  # ~13 buckets of 64 KiB
    await rt.start()
    try:
        await rt.sync()
        members = {m.member: m for m in rt.members()}
        expected = planned_routes(members, members["trainer-0"].node_id)
        relay = next(n for n, how in expected.items() if how == "collective")
        pids = {m.pid for m in members.values()}
        before = len(rt.audit.records)
        previous = rt.weights_version
        await rt.trainer("train_step")
        await rt.handle(relay).chaos_kill.remote(ChaosKill(3))  # after handing on its third bucket
        report = await rt.sync()
        assert report.failovers == 1 and report.weights_version == previous + 1
        assert [f.lost for f in rt.failovers] == [relay]
        records = rt.audit.records[before:]
        failed = next(i for i, r in enumerate(records) if r.get("trigger") == "sync_failed")
        # the first attempt committed nothing anywhere: every survivor aborted it
        assert not [r for r in records[:failed] if r.get("trigger") == "committed"], records[:failed]
        aborted = {r["member"] for r in records[:failed] if r.get("trigger") == "sync_aborted"}
        assert set(expected) - {relay} <= aborted, aborted
        await consistent(rt)
        assert len(rt.serving_rollouts()) == 3
        pids |= {m.pid for m in rt.members()}
        assert segments_of(pids) == []
    finally:
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
