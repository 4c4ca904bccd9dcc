"""Proactive drains on a real 3-node cluster: a node that announced maintenance is emptied
before it goes, without a failed sync, a dropped call, or a unit of the failover budget.

Each scenario checks the bytes: after the drain every serving rollout holds exactly the
trainer's weights (the workers' own checksums), and a trainer moved ahead of time holds
exactly what the old one held (the weights of the last sync plus the calls since, replayed).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import ftstate
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import LABEL, resource
from tests.multinode.test_node_loss import (
    assert_nothing_left,
    by_name,
    config,
    consistent,
    spares_warm,
    wait_until,
)

pytestmark = pytest.mark.ray


class SeededTrainer(TinyTrainer):
    """A train step seeded by its argument, as the docs ask of user steps: a replay on a
    new trainer reproduces it bit for bit."""

    def seeded_step(self, seed: int) -> float:
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in self.state.values():
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, generator=g) * 0.01)
        return float(seed)


def records(rt, event: str) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == event]


def rollouts_on_one_node() -> dict:
    return {"placement": {"trainer": {"resources": {resource("a"): 1}},
                          "rollout": {"strategy": "PACK", "labels": {LABEL: "in(b,c)"}}}}


SERVING = ("READY", "SYNCING", "DRAINING")  # machines/worker.yaml: serving


def assert_retired_after_replacements_served(rt, moved: dict[str, str]) -> None:
    """From the trail: each drained member retired only after its replacement reached READY
    (it held the current weights, proven), and from the drain's start to its end the rollouts
    in a serving state never numbered fewer than before it (they kept serving throughout)."""
    trail = rt.audit.records
    index: dict[tuple[str, str], int] = {}  # the first time each member entered each state
    for i, r in enumerate(trail):
        if r["event"] == "transition":
            index.setdefault((r.get("member"), r["to"]), i)
    for old, new in moved.items():
        assert index[(new, "READY")] < index[(old, "RETIRED")], (old, new)
    start = next(i for i, r in enumerate(trail) if r["event"] == "drain_started")
    end = next(i for i, r in enumerate(trail) if r["event"] == "drain_drained")
    assert all(index[(o, "RETIRED")] <= end for o in moved)

    def rollout_transition(r: dict) -> bool:
        return r["event"] == "transition" and str(r.get("member", "")).startswith(("rollout", "spare-rollout"))

    state = {r["member"]: r["to"] for r in trail[:start] if rollout_transition(r)}
    before = sum(s in SERVING for s in state.values())
    assert before >= 2
    for r in trail[start:end + 1]:
        if rollout_transition(r):
            state[r["member"]] = r["to"]
            serving = sum(s in SERVING for s in state.values())
            assert serving >= before, f"only {serving} rollouts serving during the drain, at {r}"


async def test_a_node_with_two_rollouts_is_drained_while_serving(restore_nodes, tmp_path) -> None:
    import ray

    mn = restore_nodes
    rt = ftstate.Runtime(config(tmp_path, **rollouts_on_one_node()), trainer=TinyTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt)
        await rt.sync()
        members = by_name(rt)
        node = members["rollout-0"].node_id
        assert members["rollout-1"].node_id == node
        v0 = rt.group_version
        served, syncs, stop = [], [], asyncio.Event()

        async def traffic() -> None:  # calls and syncs all along the drain: none may fail
            while not stop.is_set():
                served.extend(await rt.rollout_map("generate", [f"p{i}" for i in range(4)]))
                await rt.trainer("train_step")
                syncs.append(await rt.sync())

        load = asyncio.ensure_future(traffic())
        await wait_until(lambda: len(syncs) >= 1, 30, "traffic to flow")
        record = await rt.drain(node, reason="host maintenance in 60 s", deadline=time.time() + 60,
                                source="api", kind="terminate")
        await wait_until(lambda: len(syncs) >= 3, 30, "syncs after the drain")
        stop.set()
        await load  # raises if any call or sync failed
        assert record.outcome == "drained" and set(record.moved) == {"rollout-0", "rollout-1"}
        assert not records(rt, "budget_spent") and rt.failovers == [] and len(rt.drains) == 1
        after = by_name(rt)
        serving = rt.serving_rollouts()
        assert len(serving) == 2 and all(after[n].node_id != node for n in serving)
        assert {after[n].member for n in serving} == set(record.moved.values())
        assert rt.group_version >= v0 + 2 and len(served) >= 4
        states = [r["to"] for r in rt.audit.records if r.get("member") == "rollout-0" and r["event"] == "transition"]
        # drained, then retired, never lost (a heartbeat missed on a loaded box may pass it
        # through SUSPECT and back to READY on the way: the drain goes on from there)
        drained = states[states.index("DRAINING"):]
        assert drained[-1] == "RETIRED" and "LOST" not in drained, states
        assert_retired_after_replacements_served(rt, record.moved)
        await consistent(rt)
        # The node then goes: nothing of the run was there any more, so no failover is needed.
        mn.kill(mn.name_of(node))
        await rt.trainer("train_step")
        await rt.sync()
        await consistent(rt)
        assert rt.failovers == []
        pids = [m.pid for m in rt.members()]
        run_id = rt.run_id
    assert_nothing_left(ray, run_id, pids)


async def test_the_trainers_node_is_drained_and_the_trainer_replays_the_calls_since_the_last_sync(
        restore_nodes, tmp_path) -> None:
    mn = restore_nodes
    placement = {"placement": {"trainer": {"resources": {resource("c"): 1}},
                               "rollout": {"labels": {LABEL: "in(a,b)"}}}}
    rt = ftstate.Runtime(config(tmp_path, **placement), trainer=SeededTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt)
        await rt.sync()
        await rt.trainer("seeded_step", 7)
        await rt.trainer("seeded_step", 11)
        expected = await rt.trainer("checksum")  # the old trainer: last sync + two steps
        old = by_name(rt)["trainer-0"]
        record = await rt.drain(old.node_id, reason="preemption", deadline=time.time() + 60, kind="preempt")
        assert record.outcome == "drained" and list(record.moved) == ["trainer-0"]
        new = next(m for m in rt.members() if m.role == "trainer" and m.rank == 0)
        assert new.member == record.moved["trainer-0"] and new.node_id != old.node_id
        assert await rt.trainer("checksum") == expected  # the replay reproduced both steps
        # Every call since the last sync is replayed (a read, like checksum, is a call too).
        assert [r["calls"] for r in records(rt, "trainer_replay")] == [["seeded_step", "seeded_step", "checksum"]]
        assert not records(rt, "budget_spent") and rt.failovers == []
        await rt.sync()
        await consistent(rt)
        assert mn.name_of(old.node_id) == "c"


async def test_a_ray_drain_of_a_node_is_a_notice_the_runtime_acts_on(restore_nodes, tmp_path) -> None:
    """Ray's own DrainNode (what `ray drain-node`, the autoscaler and KubeRay's SIGTERM do):
    the runtime sees it through the GCS and moves its members off before the deadline; the
    node, idle then, leaves by itself."""
    import ray
    from ray.core.generated import autoscaler_pb2

    mn = restore_nodes
    cfg = config(tmp_path, **rollouts_on_one_node(),
                 fault_tolerance={"enable": True, "mode": "standby", "reverse_weight_sync": True,
                                  "detect_node_maintenance": True, "maintenance_sources": ["ray"],
                                  "maintenance_check_interval": 0.2})
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    async with rt:
        await spares_warm(rt)
        await rt.sync()
        node = by_name(rt)["rollout-0"].node_id
        name = mn.name_of(node)
        gcs = ray._private.worker.global_worker.gcs_client
        accepted, why = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       "ftstate test: spot reclaim", int(time.time() * 1000) + 120_000)
        assert accepted, why
        await wait_until(lambda: bool(records(rt, "drain_drained")), 60, "the drain")
        notice = records(rt, "maintenance_notice")[0]
        assert (notice["source"], notice["kind"], notice["node_id"]) == ("ray", "drain", node)
        assert all(by_name(rt)[n].node_id != node for n in rt.serving_rollouts())
        await rt.trainer("train_step")
        await rt.sync()
        await consistent(rt)
        assert rt.failovers == [] and not records(rt, "budget_spent")
    if name in mn.alive():
        mn.kill(name)  # its raylet is gone or going: let restore_nodes bring it back


async def test_a_withdrawn_notice_cancels_the_drain(restore_nodes, tmp_path) -> None:
    notice_file = tmp_path / "notice.json"
    # Cold mode: the replacement is a fresh process (seconds to start), so the withdrawal
    # lands while the drain is still under way.
    cfg = config(tmp_path, **rollouts_on_one_node(),
                 fault_tolerance={"enable": True, "mode": "cold", "detect_node_maintenance": True,
                                  "maintenance_sources": ["file"], "maintenance_file": str(notice_file),
                                  "maintenance_check_interval": 0.2})
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    async with rt:
        first = await rt.sync()
        node = by_name(rt)["rollout-0"].node_id
        notice_file.write_text(json.dumps({"kind": "migrate", "node": node}))
        await wait_until(lambda: bool(records(rt, "drain_started")), 30, "the drain to start")
        notice_file.write_text("[]")  # the notice went back to NONE
        await wait_until(lambda: bool(rt.drains), 60, "the drain to end")
        assert rt.drains[0].outcome == "cancelled", rt.drains[0]
        assert records(rt, "maintenance_withdrawn")
        members = by_name(rt)
        assert sorted(rt.serving_rollouts()) == ["rollout-0", "rollout-1"]
        assert all(members[n].node_id == node for n in rt.serving_rollouts())
        report = await rt.sync()
        assert report.weights_version == first.weights_version + 1
        await consistent(rt)


async def test_a_gce_maintenance_notice_on_one_node_drains_it(restore_nodes, tmp_path) -> None:
    """A fourth node whose GCE metadata server (a loopback one, found through its own
    GCE_METADATA_HOST, as Google's libraries do) announces TERMINATE_ON_HOST_MAINTENANCE: the
    runtime's watcher on that node sees it and the node is drained; the other nodes, off any
    cloud, watch nothing (the default detection) and nothing else moves. NONE again withdraws it."""
    import os

    from tests.integration.metadata_servers import GceServer

    mn = restore_nodes
    with GceServer() as gce:
        os.environ["GCE_METADATA_HOST"] = gce.url.removeprefix("http://")
        try:
            mn.add("d")  # inherits the variable: its raylet and every worker it starts
        finally:
            del os.environ["GCE_METADATA_HOST"]
        mn.cluster.wait_for_nodes()
        try:
            cfg = config(tmp_path, placement={"trainer": {"resources": {resource("a"): 1}},
                                              "rollout": {"resources": {resource("d"): 1}}},
                         fault_tolerance={"enable": True, "mode": "standby", "reverse_weight_sync": True,
                                          "detect_node_maintenance": True, "maintenance_check_interval": 0.2})
            rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
            async with rt:
                await spares_warm(rt)
                await rt.sync()
                node_d = mn.node_id("d")
                assert {by_name(rt)[n].node_id for n in rt.serving_rollouts()} == {node_d}
                watching = {r.get("node"): r["sources"] for r in records(rt, "maintenance_sources")
                            if r["place"] == "node"}
                assert "gce" in watching[node_d] and all("gce" not in s for n, s in watching.items() if n != node_d)
                gce.state["maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
                await wait_until(lambda: bool(records(rt, "drain_drained")), 60, "the drain")
                notice = records(rt, "maintenance_notice")[0]
                assert (notice["source"], notice["kind"], notice["node_id"]) == ("gce", "terminate", node_d)
                assert all(by_name(rt)[n].node_id != node_d for n in rt.serving_rollouts())
                gce.state["maintenance-event"] = "NONE"
                await wait_until(lambda: bool(records(rt, "maintenance_withdrawn")), 30, "the withdrawal")
                await rt.trainer("train_step")
                await rt.sync()
                await consistent(rt)
                assert rt.failovers == [] and not records(rt, "budget_spent")
                assert not records(rt, "maintenance_problem")
        finally:
            if "d" in mn.alive():
                mn.kill("d")
            mn.nodes.pop("d", None)
