"""The simulated cluster and the real controller on it, in virtual time (issue 27; no Ray).

The first classes hold the simulated cluster to what the controller relies on of Ray: a
member answers once its process is up, a death fails the calls pending on it, a hung member
answers nothing, a node loss takes every process on it, placement keeps to its strategy. The
later ones run the real :class:`~ftstate.controller.runtime.Runtime` on it: a sync, a failover,
a node loss as one round, a drain, an exhausted budget, and a seed that gives the same trail
byte for byte.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import subprocess
import sys
import time

import pytest

from ftstate.controller.backend import ActorDied, ActorUnreachable, CallTimedOut, RemoteError
from ftstate.core.audit_check import check_trail
from ftstate.core.config import RolePlacement
from ftstate.core.errors import (
    ConfigError,
    FailoverBudgetExhausted,
    PlacementUnsatisfiable,
    StaleGroupVersion,
)
from ftstate.core.protocol import Beat, Commit, Info, Join, Vigil
from ftstate.simulation import clock
from ftstate.simulation.cluster import SimulatedCluster
from ftstate.simulation.costs import Costs
from ftstate.simulation.scenario import Shape, simulated_runtime

QUIET = Costs(jitter=0.0)


def run(coro):
    return clock.run(coro)


def spread(**kw) -> RolePlacement:
    return RolePlacement(**{"strategy": "SPREAD", **kw})


def started(cluster: SimulatedCluster, name: str, pool=None, slot: int = 0):
    pool = pool or cluster.resource_pool("r", name, 1, cpus=1, gpus=0, placement=spread())
    return cluster.start_actor(name=name, run_id="r", pool=pool, slot=slot, role="rollout", user_class=object,
                               args=(), kwargs={}, host={})


async def packed(cluster: SimulatedCluster, n: int) -> list:
    """``n`` rollouts packed on the first node, up (their ``info`` answered)."""
    pool = cluster.resource_pool("r", "rollout", n, cpus=1, gpus=0, placement=RolePlacement(strategy="PACK"))
    ms = [started(cluster, f"rollout-{i}", pool, i) for i in range(n)]
    await asyncio.gather(*(cluster.call(m, Info(), None) for m in ms))
    return ms


class TestVirtualTime:
    def test_an_hour_of_sleeping_costs_no_real_time(self):
        async def main():
            loop = asyncio.get_running_loop()
            await asyncio.sleep(3600)
            return loop.time()

        t0 = time.perf_counter()
        assert run(main()) == pytest.approx(3600)
        # real sleeping would take the whole hour: a hundredth of it is far beyond any stall of a loaded machine
        assert time.perf_counter() - t0 < 3600 / 100

    def test_timers_fire_in_order_of_their_virtual_times(self):
        async def main():
            order = []

            async def after(s, tag):
                await asyncio.sleep(s)
                order.append((asyncio.get_running_loop().time(), tag))

            await asyncio.gather(after(2.0, "b"), after(0.5, "a"), after(7.0, "c"))
            return order

        assert run(main()) == [(0.5, "a"), (2.0, "b"), (7.0, "c")]


class TestSimulatedMembers:
    def test_a_member_answers_once_its_process_is_up(self):
        async def main():
            cluster = SimulatedCluster(2, costs=QUIET)
            m = started(cluster, "rollout-0")
            info = await cluster.call(m, Info(), None)
            return asyncio.get_running_loop().time(), info

        t, info = run(main())
        assert t == pytest.approx(QUIET.start_s + QUIET.call_s)
        assert info.member == "rollout-0" and info.node_id == "n0000000"

    def test_a_death_fails_the_pending_call_after_the_detection_latency(self):
        async def main():
            cluster = SimulatedCluster(1, costs=QUIET)
            m = started(cluster, "rollout-0")
            await cluster.call(m, Info(), None)
            loop = asyncio.get_running_loop()
            vigil = asyncio.ensure_future(cluster.call(m, Vigil(), None))
            await asyncio.sleep(5)
            assert not vigil.done()  # a vigil stays pending while the process lives
            t0 = loop.time()
            cluster.kill_member("rollout-0")
            with pytest.raises(ActorDied, match="SIGKILL"):
                await vigil
            return loop.time() - t0

        assert run(main()) == pytest.approx(QUIET.death_detect_s)

    def test_a_hung_member_answers_nothing_and_a_bounded_call_times_out(self):
        async def main():
            cluster = SimulatedCluster(1, costs=QUIET)
            m = started(cluster, "rollout-0")
            await cluster.call(m, Info(), None)
            cluster.hang_member("rollout-0")
            with pytest.raises(CallTimedOut):
                await cluster.call(m, Beat(), 1.0)

        run(main())

    def test_a_bounded_call_times_out_only_when_its_answer_would_come_later(self):
        """A call answered before its timeout leaves no timer behind (it would only find the call
        settled); one whose answer would come later (its process still starting) times out at
        its timeout, as before."""
        async def main():
            loop = asyncio.get_running_loop()
            cluster = SimulatedCluster(1, costs=QUIET)
            m = started(cluster, "rollout-0")
            await cluster.call(m, Info(), None)
            beat = await cluster.call(m, Beat(), 5.0)
            left_after_answer = len(cluster.timers)
            late = started(cluster, "rollout-1")  # up only start_s from now
            t0 = loop.time()
            with pytest.raises(CallTimedOut):
                await cluster.call(late, Beat(), QUIET.start_s / 2)
            return beat, left_after_answer, loop.time() - t0

        beat, left, waited = run(main())
        assert beat.pid and left == 0
        assert waited == pytest.approx(QUIET.start_s / 2)

    def test_a_lost_node_goes_silent_then_unreachable_then_dead_as_on_ray(self):
        async def main():
            cluster = SimulatedCluster(2, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 4)
            loop = asyncio.get_running_loop()
            vigil = asyncio.ensure_future(cluster.call(ms[0], Vigil(), None))
            await asyncio.sleep(0)
            t0 = loop.time()
            assert cluster.lose_node("n0000000") == [f"rollout-{i}" for i in range(4)]
            assert [n["node_id"] for n in cluster.nodes()] == ["n0000001"]
            with pytest.raises(CallTimedOut):  # a heartbeat gets no answer
                await cluster.call(ms[1], Beat(), 1.0)
            with pytest.raises(ActorUnreachable):  # an unbounded call: unreachable after a while
                await cluster.call(ms[1], Info(), None)
            assert loop.time() - t0 == pytest.approx(1.0 + QUIET.unreachable_s)
            assert not vigil.done()  # nobody said it died: Ray's health check has not given up yet
            with pytest.raises(ActorDied, match="node lost"):
                await vigil
            return loop.time() - t0

        assert run(main()) == pytest.approx(QUIET.node_dead_s + QUIET.death_detect_s)

    def test_a_fenced_version_releases_its_waiters_as_stale(self):
        async def main():
            cluster = SimulatedCluster(1, costs=QUIET)
            store = cluster.rendezvous_store("10.0.0.1")
            m = started(cluster, "rollout-0")
            join = asyncio.ensure_future(cluster.call(
                m, Join(store.address.host, store.address.port, "weights", 1, 0, 2, 600.0), None))
            await asyncio.sleep(4)
            assert store.arrived("weights", 1) == [0] and not join.done()  # waiting for rank 1
            store.fence("weights", 2)
            with pytest.raises(RemoteError) as info:
                await join
            return info.value.cause

        assert isinstance(run(main()), StaleGroupVersion)


class TestSimulatedPlacement:
    def test_spread_deals_the_slots_round_the_nodes(self):
        cluster = SimulatedCluster(3, cpus_per_node=4)
        pool = cluster.resource_pool("r", "rollout", 6, cpus=1, gpus=0, placement=spread())
        assert list(pool.slot_nodes().values()) == ["n0000000", "n0000001", "n0000002"] * 2

    def test_a_pool_no_state_of_the_cluster_could_hold_is_refused_naming_it(self):
        cluster = SimulatedCluster(2, cpus_per_node=2)
        with pytest.raises(PlacementUnsatisfiable, match="rollout"):
            cluster.resource_pool("r", "rollout", 5, cpus=1, gpus=0, placement=spread())

    def test_a_spare_goes_off_the_nodes_it_must_avoid(self):
        cluster = SimulatedCluster(3, cpus_per_node=4)
        pool = cluster.spare_pool("r", "standby", 3, cpus=1, gpus=0, placement=spread())
        slot = pool.take({"n0000000", "n0000001"})
        assert pool.slot_nodes()[slot] == "n0000002"
        with pytest.raises(PlacementUnsatisfiable):
            pool.take({"n0000000", "n0000001", "n0000002"}, strict=True)

    def test_a_pool_aimed_at_one_nodes_resource_or_label_lands_there(self):
        per_node = [{"resources": {"node_a": 4}, "labels": {"n": "a"}}, {"labels": {"n": "b"}}, {"labels": {"n": "c"}}]
        cluster = SimulatedCluster(3, cpus_per_node=4, per_node=per_node)
        pinned = cluster.resource_pool("r", "trainer", 2, cpus=1, gpus=0, placement=spread(resources={"node_a": 1}))
        assert set(pinned.slot_nodes().values()) == {"n0000000"}
        labelled = cluster.resource_pool("r", "rollout", 3, cpus=1, gpus=0,
                                         placement=RolePlacement(strategy="PACK", labels={"n": "in(b,c)"}))
        assert list(labelled.slot_nodes().values()) == ["n0000001"] * 3
        with pytest.raises(PlacementUnsatisfiable, match="trainer"):
            cluster.resource_pool("r", "trainer", 5, cpus=0.1, gpus=0, placement=spread(resources={"node_a": 1}))
        with pytest.raises(ConfigError, match="per_node"):
            SimulatedCluster(1, per_node=[{"cpus": 3}])

    def test_a_transfers_fixed_cost_is_paid_per_receiver(self):
        costs = Costs(receiver_s=0.01, weights_bytes=2 * 10**9, bandwidth_Bps=2e9, hop_s=0.0)
        assert costs.transfer_s(2) == pytest.approx(1.01) and costs.transfer_s(4) == pytest.approx(1.03)

    def test_bad_shapes_are_refused_naming_the_field(self):
        with pytest.raises(ConfigError, match="nodes"):
            SimulatedCluster(0)
        with pytest.raises(ConfigError, match=r"costs\.bandwidth_Bps"):
            Costs(bandwidth_Bps=0)
        with pytest.raises(ConfigError, match="rollouts"):
            Shape(rollouts=0)


def transitions(rt, member: str) -> list[tuple[str, str, str]]:
    return [(r["from"], r["to"], r["trigger"]) for r in rt.audit.records
            if r["event"] == "transition" and r.get("member") == member]


class TestTheControllerOnASimulatedCluster:
    def test_a_sync_reaches_every_rollout_and_a_killed_one_is_replaced_by_its_spare(self):
        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=3, nodes=3, spares=1), costs=QUIET)
            await rt.start()
            report = await rt.sync()
            assert report.rollouts == ("rollout-0", "rollout-1", "rollout-2")
            cluster.kill_member("rollout-1")
            await asyncio.sleep(1)
            report = await rt.sync()
            await rt.close()
            return rt, report

        rt, report = run(main())
        assert report.weights_version == 2 and "spare-rollout-1" in report.rollouts
        assert [f.lost for f in rt.failovers] == ["rollout-1"] and rt.failovers[0].replacement == "spare-rollout-1"
        assert transitions(rt, "rollout-1")[-2:] == [("READY", "LOST", "died"), ("LOST", "RETIRED", "retire")]

    def test_a_trainer_suspected_during_the_commit_is_re_admitted_not_made_stale(self, tmp_path):
        """The vote makes the new version current before the rollouts' loads end; a trainer
        whose heartbeats stall meanwhile (a loaded host) and then answer shows that version and
        its checksum, which is the current pair: it is verified and serves on. (Found in the
        vLLM benchmark: the group's version was the new one and its checksum the old one during
        the commit, so such a trainer went STALE and the next ``train_step`` failed.)"""
        slow_load = Costs(jitter=0.0, load_Bps=25e6)  # 256 MiB: a commit of ~10 s

        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=2, nodes=1, spares=0), costs=slow_load,
                                            overrides={"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 60.0},
                                            audit_path=str(tmp_path / "audit.jsonl"))
            await rt.start()
            await rt.sync()
            await rt.trainer("train_step")
            trainer = cluster.member("trainer-0")
            real_call = cluster.call

            async def call(handle, req, timeout):
                if isinstance(req, Commit) and not trainer.hung:
                    trainer.hang()  # silent for three intervals, in the middle of the commit
                    cluster.loop.call_later(3.5, setattr, trainer, "hung", False)
                return await real_call(handle, req, timeout)

            cluster.call = call
            report = await rt.sync()
            await rt.trainer("train_step")  # the trainer still serves
            await rt.close()
            return rt, report

        rt, report = run(main())
        assert report.weights_version == 2
        seen = transitions(rt, "trainer-0")
        assert ("SYNCING", "SUSPECT", "heartbeat_missed") in seen, seen  # the stall was seen
        assert not any(to == "STALE" for _, to, _ in seen), seen
        assert ("SUSPECT", "RESYNCED", "verified") in seen, seen
        assert check_trail(tmp_path / "audit.jsonl") == []

    def test_a_lost_node_is_one_failover_round_under_one_group_version(self):
        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=8, nodes=4, spares=2), costs=QUIET,
                                            overrides={"fault_tolerance": {"max_failovers": 10}})
            await rt.start()
            await rt.sync()
            version = rt.group_version
            node = next(m.node_id for m in rt.members() if m.member == "rollout-1")
            lost = [n for n in cluster.lose_node(node) if not n.startswith("spare")]
            await asyncio.sleep(20)  # found by heartbeats (heartbeat_timeout_s 10), then replaced
            await rt.sync()
            await rt.close()
            return rt, lost, version

        rt, lost, version = run(main())
        assert len(lost) >= 2 and sorted(f.lost for f in rt.failovers) == sorted(lost)
        assert {f.group_version for f in rt.failovers} == {version + 1}  # one round
        assert any(r["event"] == "node_lost" for r in rt.audit.records)

    def test_a_drain_moves_the_members_off_the_node_and_spends_no_failover(self):
        async def main():
            rt, _ = simulated_runtime(Shape(rollouts=4, nodes=3, spares=1, headroom=4), costs=QUIET)
            await rt.start()
            await rt.sync()
            node = next(m.node_id for m in rt.members() if m.member == "rollout-1")
            record = await rt.drain(node, reason="host maintenance", source="simulation", kind="maintenance")
            await rt.sync()
            left = [m.member for m in rt.members() if m.node_id == node and m.state not in ("RETIRED", "LOST")]
            await rt.close()
            return rt, record, left

        rt, record, left = run(main())
        assert record.outcome == "drained" and "rollout-1" in record.moved
        assert left == [] and rt.failovers == []

    def test_a_node_the_cluster_drains_is_drained_through_the_maintenance_watchers(self):
        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=4, nodes=3, spares=1, headroom=4), costs=QUIET,
                                            overrides={"fault_tolerance": {"detect_node_maintenance": True,
                                                                           "maintenance_sources": ["ray"],
                                                                           "maintenance_check_interval": 1.0}})
            await rt.start()
            await rt.sync()
            node = next(m.node_id for m in rt.members() if m.member == "rollout-1")
            cluster.drain_node(node)
            await asyncio.sleep(10)  # the next poll reports it, the drain moves the members
            await rt.sync()
            left = [m.member for m in rt.members() if m.node_id == node and m.state not in ("RETIRED", "LOST")]
            await rt.close()
            return rt, node, left

        rt, node, left = run(main())
        [notice] = [r for r in rt.audit.records if r["event"] == "maintenance_notice"]
        assert (notice["source"], notice["kind"], notice["node_id"], notice["action"]) == ("ray", "drain", node, "drain")
        places = [r["place"] for r in rt.audit.records if r["event"] == "maintenance_sources"]
        assert places[0] == "controller" and places.count("node") == 3  # a watcher on each node with members
        assert left == [] and rt.failovers == []

    def test_a_loss_past_max_failovers_ends_the_run_with_the_budget_error(self):
        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=4, nodes=1, spares=1, headroom=4), costs=QUIET,
                                            overrides={"fault_tolerance": {"max_failovers": 1}})
            await rt.start()
            await rt.sync()
            cluster.kill_member("rollout-0")
            await rt.sync()
            cluster.kill_member("rollout-1")
            await asyncio.sleep(1)
            state = rt.state
            with pytest.raises(FailoverBudgetExhausted, match="max_failovers=1"):
                await rt.sync()
            await rt.close()
            return state

        assert run(main()) == "FAILED"

    def test_no_ray_and_no_torch_are_imported_by_a_simulated_run(self):
        code = ("import sys, asyncio\n"
                "from ftstate.simulation import clock\n"
                "from ftstate.simulation.scenario import Shape, simulated_runtime\n"
                "async def main():\n"
                "    rt, cluster = simulated_runtime(Shape(rollouts=2))\n"
                "    await rt.start(); await rt.sync(); cluster.kill_member('rollout-0')\n"
                "    await asyncio.sleep(1); await rt.sync(); await rt.close()\n"
                "clock.run(main())\n"
                "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "[]"


def seeded_trail(tmp_path, seed: int, name: str) -> bytes:
    async def main():
        path = tmp_path / name
        rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=3, spares=1), audit_path=str(path), seed=seed,
                                        overrides={"fault_tolerance": {"max_failovers": 10}})
        await rt.start()
        await rt.sync()
        cluster.kill_member("rollout-2")
        await rt.sync()
        cluster.kill_member("trainer-0")
        await asyncio.sleep(1)
        await rt.sync()
        cluster.lose_node(next(m.node_id for m in rt.members() if m.member == "rollout-4"))
        await asyncio.sleep(20)
        await rt.sync()
        await rt.close()
        return path.read_bytes()

    return run(main())


class TestReproducible:
    def test_a_seed_gives_the_same_trail_byte_for_byte(self, tmp_path):
        first, second = seeded_trail(tmp_path, 7, "a.jsonl"), seeded_trail(tmp_path, 7, "b.jsonl")
        assert first == second
        events = [json.loads(line)["event"] for line in first.splitlines()]
        assert events.count("failover") >= 3  # the faults happened: it is not an empty run twice

    def test_another_seed_gives_other_timings(self, tmp_path):
        assert seeded_trail(tmp_path, 7, "a.jsonl") != seeded_trail(tmp_path, 8, "b.jsonl")


class TestSeveralTrainerRanks:
    """The sharded sync and a rank's recovery (ftstate.controller.ranks) on simulated ranks."""

    @staticmethod
    def three_ranks(main):
        async def run_it():
            rt, cluster = simulated_runtime(Shape(rollouts=4, nodes=3, spares=1, trainers=3, headroom=3), costs=QUIET,
                                            overrides={"fault_tolerance": {"max_failovers": 10}})
            await rt.start()
            try:
                return rt, await main(rt, cluster)
            finally:
                await rt.close()

        return run(run_it())

    def test_every_rank_sends_its_part_and_every_rollout_commits_the_whole(self):
        async def main(rt, cluster):
            return await rt.sync()

        rt, report = self.three_ranks(main)
        assert report.checksum == "sim-v1" and len(report.rollouts) == 4
        [begun] = [r for r in rt.audit.records if r["event"] == "transition" and r.get("trigger") == "sync_start"]
        assert begun["plan"]["senders"] == ["trainer-0", "trainer-1", "trainer-2"]
        assert all(("SYNCING", "READY", "committed") in transitions(rt, f"trainer-{i}") for i in range(3))
        assert {m.weights_version for m in rt.members() if m.rank >= 0} == {1}

    def test_a_lost_rank_is_replaced_its_part_restored_and_the_calls_since_replayed(self):
        async def main(rt, cluster):
            await rt.sync()
            pids = {m.member: m.pid for m in rt.members()}
            await rt.trainer("train_step")
            cluster.kill_member("trainer-1")
            await asyncio.sleep(1)
            await rt.trainer("train_step")
            report = await rt.sync()
            return pids, report

        rt, (pids, report) = self.three_ranks(main)
        assert [(f.lost, f.replacement) for f in rt.failovers] == [("trainer-1", "spare-trainer-0")]
        [recovered] = [r for r in rt.audit.records if r["event"] == "trainer_ranks_recovered"]
        assert recovered["newcomers"] == ["spare-trainer-0"] and recovered["replayed"] == ["train_step"]
        assert sorted(recovered["restored"]) == ["spare-trainer-0", "trainer-0", "trainer-2"]
        after = {m.member: m for m in rt.members()}
        assert after["spare-trainer-0"].rank == 1 and after["trainer-0"].pid == pids["trainer-0"]
        assert report.weights_version == 2 and len(report.rollouts) == 4


class TestHeartbeatsPerNode:
    """The watchdog asks each node's agent for its members' heartbeats in one call; the agent
    answers for each as its own call would have ended, and is never the only way to be heard."""

    def test_the_agent_answers_for_each_member_as_its_own_call_would_have_ended(self):
        async def main():
            cluster = SimulatedCluster(1, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 3)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            beats = await cluster.heartbeats("n0000000", ms, [Beat(False, True)] * 3, 1.0)
            assert loop.time() - t0 == pytest.approx(QUIET.call_s)  # one round trip for all
            # nothing dropped as forged: left out, as a real member leaves it out
            assert all(b.pid == m.pid and not b.forged for b, m in zip(beats, ms, strict=True))
            cluster.kill_member("rollout-0")
            cluster.hang_member("rollout-1")
            t0 = loop.time()
            dead, hung, alive = await cluster.heartbeats("n0000000", ms, [Beat(False, True)] * 3, 1.0)
            assert loop.time() - t0 == pytest.approx(1.0)  # the hung one holds the reply to its own bound
            assert isinstance(dead, ActorDied) and isinstance(hung, CallTimedOut) and alive.pid == ms[2].pid

        run(main())

    @pytest.mark.parametrize("change", ["progress", "weights", "checksum", "busy", "hung", "died"])
    def test_a_change_of_any_answer_on_the_node_ends_the_agents_quiet_replies(self, change):
        """The agent answers QUIET without reading its members while nothing on the node moved
        (NodeChanges); each thing a heartbeat shows, changed on one member, ends that."""
        from ftstate.controller.backend import QUIET as QUIET_REPLY
        from ftstate.simulation.collectives import Collective

        async def main():
            cluster = SimulatedCluster(1, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 3)
            ask = [Beat(False, True)] * 3
            first = await cluster.heartbeats("n0000000", ms, ask, 1.0, mark=1)
            assert isinstance(first, list)
            assert await cluster.heartbeats("n0000000", ms, ask, 1.0, mark=2, since=1) is QUIET_REPLY
            assert await cluster.heartbeats("n0000000", ms, ask, 1.0, mark=3, since=2) is QUIET_REPLY
            m = ms[1]
            if change == "progress":
                m.progress += 1
            elif change == "weights":
                m.weights_version += 1
            elif change == "checksum":
                m.checksum = "other"
            elif change == "busy":
                c = Collective(asyncio.get_running_loop(), "a broadcast", 2, 1.0, 0.0)
                c.arrive(0, m, asyncio.get_running_loop().create_future(), lambda: None)
            elif change == "hung":
                cluster.hang_member(m.name)
            else:
                cluster.kill_member(m.name)
            moved = await cluster.heartbeats("n0000000", ms, ask, 1.0, mark=4, since=3)
            assert isinstance(moved, list) and moved != first
            assert moved[0] == first[0] and moved[2] == first[2]

        run(main())

    def test_a_lost_nodes_agent_is_unreachable_and_then_dead_with_it(self):
        async def main():
            cluster = SimulatedCluster(2, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 2)
            await cluster.heartbeats("n0000000", ms, [Beat(False, True)] * 2, 1.0)
            assert cluster.lose_node("n0000000") == ["rollout-0", "rollout-1"]  # the agent is no member
            with pytest.raises(ActorUnreachable):
                await cluster.heartbeats("n0000000", ms, [Beat(False, True)] * 2, 2.0)
            await asyncio.sleep(QUIET.node_dead_s)
            with pytest.raises(ActorDied):
                await cluster.heartbeats("n0000000", ms, [Beat(False, True)] * 2, 2.0)

        run(main())

    def test_the_watchdog_makes_one_call_a_node_and_a_hung_member_alone_is_suspected_then_lost(self):
        calls: list[str] = []

        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=2, spares=1), costs=QUIET)
            real = cluster.heartbeats_future  # what the watchdog's round asks

            def counted(node_id, handles, args, timeout, **kw):
                calls.append(node_id)
                return real(node_id, handles, args, timeout, **kw)

            cluster.heartbeats_future = counted
            await rt.start()
            await rt.sync()
            calls.clear()
            await asyncio.sleep(rt.config.heartbeat_interval_s)
            nodes = {m.node_id for m in rt.members() if m.state != "INIT"}
            per_interval = sorted(calls)
            cluster.hang_member("rollout-2")
            await asyncio.sleep(rt.config.heartbeat_timeout_s + 5 * rt.config.heartbeat_interval_s)
            await rt.close()
            return rt, nodes, per_interval

        rt, nodes, per_interval = run(main())
        assert per_interval == sorted(nodes)  # one call per node and interval, none per member
        assert ("READY", "SUSPECT", "heartbeat_missed") in transitions(rt, "rollout-2")
        assert ("SUSPECT", "LOST") in [(a, b) for a, b, _ in transitions(rt, "rollout-2")]
        for other in ("rollout-0", "rollout-1", "rollout-3"):
            assert not any(to == "SUSPECT" for _, to, _ in transitions(rt, other))

    def test_an_agent_answers_quiet_without_reading_its_members_only_when_reading_them_would_too(self):
        """The simulated agent skips reading its members while nothing on its node changed
        (NodeChanges): each time it does, the answers it would have read are checked against the
        kept ones, through syncs, a rollout that hangs, one killed, a trainer rank killed and a
        node lost. The shortcut is taken (most quiet rounds) and never where the answers moved."""
        from ftstate.simulation.members import SimulatedLivenessAgent

        taken, wrong = [0], []
        real = SimulatedLivenessAgent._unchanged

        def checked(self, handles, since):
            unchanged = real(self, handles, since)
            if unchanged:
                taken[0] += 1
                now = self.cluster.loop.time()
                read = [h.local_heartbeat(Beat(False, True), now, 1.0) for h in handles]
                if read != self._memory.answers:
                    wrong.append((self.node_id, now, read, self._memory.answers))
            return unchanged

        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=20, trainers=3, nodes=4, spares=3),
                                            overrides={"fault_tolerance": {"max_failovers": 50}})
            await rt.start()
            try:
                for _ in range(2):
                    await rt.sync()
                await asyncio.sleep(10 * rt.config.heartbeat_interval_s)
                quiet = taken[0]
                cluster.hang_member("rollout-2")
                await asyncio.sleep(rt.config.heartbeat_timeout_s + 4 * rt.config.heartbeat_interval_s)
                await rt.sync()
                cluster.kill_member("rollout-5")
                await rt.sync()
                cluster.kill_member("trainer-1")
                await rt.sync()
                node = next(m.node_id for m in rt.members() if m.member == "rollout-9")
                cluster.lose_node(node)
                await asyncio.sleep(rt.config.heartbeat_timeout_s + 4 * rt.config.heartbeat_interval_s)
                await rt.sync()
                await asyncio.sleep(10 * rt.config.heartbeat_interval_s)
                return rt, quiet
            finally:
                await rt.close()

        SimulatedLivenessAgent._unchanged = checked
        try:
            rt, quiet = run(main())
        finally:
            SimulatedLivenessAgent._unchanged = real
        assert quiet >= 10 and taken[0] > quiet  # taken in the quiet rounds, and after the faults
        assert wrong == []
        assert all(rollout.startswith("rollout") for rollout in rt.serving_rollouts())

    @pytest.mark.parametrize("least", [100, 0])
    def test_a_node_below_heartbeat_agent_min_members_is_asked_member_by_member(self, least):
        """4-5 members a node: with ``heartbeat_agent_min_members`` 100 (or 0: never an agent) no
        agent is asked or started, each member is heard directly, and nobody is suspected."""
        agent_calls: list[str] = []
        direct: list[str] = []

        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=2, spares=1), costs=QUIET,
                                            overrides={"heartbeat_agent_min_members": least})
            real_agent, real_call = cluster.heartbeats_future, cluster.call

            def via_agent(node_id, handles, args, timeout, **kw):
                agent_calls.append(node_id)
                return real_agent(node_id, handles, args, timeout, **kw)

            async def call(handle, req, timeout):
                if isinstance(req, Beat):
                    direct.append(handle.name)
                return await real_call(handle, req, timeout)

            cluster.heartbeats_future, cluster.call = via_agent, call
            await rt.start()
            await rt.sync()
            direct.clear()
            await asyncio.sleep(2 * rt.config.heartbeat_interval_s)
            up = {m.member for m in rt.members() if m.state != "INIT"}
            agents = dict(cluster._agents)
            await rt.close()
            return rt, up, agents

        rt, up, agents = run(main())
        assert agent_calls == [] and agents == {}
        assert set(direct) == up  # every member heard directly
        assert not any(r["event"] == "transition" and r["to"] == "SUSPECT" for r in rt.audit.records)

    def test_members_whose_agent_died_are_asked_directly_and_nobody_is_suspected(self):
        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=2, spares=1), costs=QUIET)
            await rt.start()
            await rt.sync()
            await asyncio.sleep(rt.config.heartbeat_interval_s)
            agents = dict(cluster._agents)
            for agent in agents.values():
                agent.die("SIGKILL")
            await asyncio.sleep(3 * rt.config.heartbeat_interval_s)
            restarted = {n: a is not agents.get(n) and a.alive for n, a in cluster._agents.items()}
            await rt.close()
            return rt, agents, restarted

        rt, agents, restarted = run(main())
        assert agents and all(restarted.values())
        assert not any(r["event"] == "transition" and r["to"] == "SUSPECT" for r in rt.audit.records)
        assert not rt.failovers


class TestSyncCallsPerNode:
    """A sync's calls to a node's members go in one call of the node's agent, which reports each
    member's outcome as it ends: a member that fails mid-transfer is heard of at once, with the
    same records and at the same (virtual) time as its own call would have been."""

    def test_the_agent_reports_each_members_outcome_as_it_ends(self):
        async def main():
            cluster = SimulatedCluster(1, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 3)
            loop = asyncio.get_running_loop()
            cluster.hang_member("rollout-1")
            t0 = loop.time()
            seen = []
            stream = cluster.calls("n0000000", ms[::2], [Info(), Info()])
            first = await anext(stream)
            seen.append((loop.time() - t0, first))
            cluster.kill_member("rollout-0")  # answered already: nothing more to report for it
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
            stream = cluster.calls("n0000000", ms, [Info()] * 3)
            cluster.kill_member("rollout-1")
            ended = []
            async for batch in stream:
                ended.append((round(loop.time() - t0, 6), sorted((j, type(o).__name__) for j, o in batch)))
            return seen, ended

        seen, ended = run(main())
        assert seen[0][0] == pytest.approx(QUIET.call_s) and sorted(j for j, _ in seen[0][1]) == [0, 1]
        # the dead ones after the detection latency, the live one at its own call's time
        kinds = {j: kind for _, batch in ended for j, kind in batch}
        assert kinds == {0: "ActorDied", 1: "ActorDied", 2: "Located"}

    def test_a_lost_nodes_agent_fails_the_batch_when_the_node_is_declared_dead(self):
        async def main():
            cluster = SimulatedCluster(2, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 2)
            loop = asyncio.get_running_loop()
            cluster.hang_member("rollout-0")
            stream = cluster.calls("n0000000", ms, [Info(), Info()])
            first = await anext(stream)  # rollout-1 answered
            t0 = loop.time()
            cluster.lose_node("n0000000")
            with pytest.raises(ActorDied):
                await anext(stream)
            return first, loop.time() - t0

        first, waited = run(main())
        assert [j for j, _ in first] == [1]
        assert waited == pytest.approx(QUIET.node_dead_s + QUIET.death_detect_s)

    def test_a_sync_makes_one_call_a_node_of_the_agent(self):
        batches: list[tuple[str, tuple[str, ...]]] = []

        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=2, spares=1), costs=QUIET)
            real = cluster.calls

            def counted(node_id, handles, requests):
                batches.append((node_id, tuple(sorted({r.method for r in requests}))))
                return real(node_id, handles, requests)

            cluster.calls = counted
            await rt.start()
            await rt.sync()
            await rt.close()
            return rt

        rt = run(main())
        nodes = {m.node_id for m in rt.members() if m.role == "rollout"}
        commits = [n for n, methods in batches if methods == ("commit_weights",)]
        assert sorted(commits) == sorted(n for n in nodes if n in commits) and len(commits) == len(set(commits))
        assert any(len(methods) == 2 for _, methods in batches)  # the trainer's send and its node's receives

    @pytest.mark.parametrize("victim", ["rollout-1", "trainer-0"])
    def test_a_member_killed_mid_transfer_is_found_as_fast_and_recorded_the_same_as_by_its_own_call(self, victim):
        def once(least: int):
            async def main():
                rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=2, spares=1), costs=QUIET,
                                                overrides={"heartbeat_agent_min_members": least})
                await rt.start()
                await rt.sync()
                sync = asyncio.ensure_future(rt.sync())
                while not cluster.member(victim).collectives:  # in the transfer
                    await asyncio.sleep(0.0005)
                cluster.kill_member(victim)
                report = await sync
                await rt.close()
                return rt, report

            rt, report = run(main())
            return ([(r.get("member"), r["from"], r["to"], r["trigger"], r["ts"]) for r in rt.audit.records
                     if r["event"] == "transition"],
                    [(r["event"], r.get("reason"), r["ts"]) for r in rt.audit.records
                     if r["event"] in ("transfer_abandoned", "failover_start", "failover_done")],
                    report)

        direct, agent = once(0), once(4)
        assert any(e == "transfer_abandoned" for e, _, _ in agent[1])
        assert agent[0] == direct[0]  # every transition of every member, at the same virtual time
        assert agent[1] == direct[1]
        assert agent[2].rollouts == direct[2].rollouts and agent[2].weights_version == direct[2].weights_version


    @pytest.mark.parametrize("victim", ["rollout-1", "trainer-0"])
    def test_a_reform_joins_a_nodes_members_in_one_call_and_records_the_same_as_direct_calls(self, victim):
        """After a loss every member joins the next group version: through its node's agent,
        one call a node, with every transition at the same virtual time as by direct calls."""
        def once(least: int):
            joins: list[tuple[str, int]] = []

            async def main():
                rt, cluster = simulated_runtime(Shape(rollouts=6, nodes=2, spares=1), costs=QUIET,
                                                overrides={"heartbeat_agent_min_members": least})
                real = cluster.calls

                def counted(node_id, handles, requests):
                    if any(isinstance(r, Join) for r in requests):
                        joins.append((node_id, len(handles)))
                    return real(node_id, handles, requests)

                cluster.calls = counted
                await rt.start()
                await rt.sync()
                cluster.kill_member(victim)
                while not rt.failovers or rt.state != "READY":
                    await asyncio.sleep(0.01)
                await rt.sync()
                await rt.close()
                return rt

            rt = run(main())
            return [(r.get("member"), r["from"], r["to"], r["trigger"], r["ts"]) for r in rt.audit.records
                    if r["event"] == "transition"], joins, rt

        (direct, no_agent, _), (agent, joins, rt) = once(0), once(4)
        assert no_agent == [] and joins and all(n >= 4 for _, n in joins)
        assert len(joins) == len(set(joins))  # one call a node and version
        assert agent == direct
        assert rt.failovers[0].lost == victim and rt.failovers[0].resynced


class TestTimerQueue:
    """The simulation's own timers: in time order (first come first for equal times), only the
    earliest holding a loop timer, one made while the queue runs waiting for the loop's next
    pass as a loop timer would, a failing callback reported and the others run."""

    def test_callbacks_run_at_their_times_in_order_behind_one_loop_timer(self):
        async def main():
            loop = asyncio.get_running_loop()
            q = clock.TimerQueue(contextvars.Context())
            ran: list[tuple[str, float]] = []
            t0 = loop.time()
            for name, dt in (("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0)):
                q.call_at(t0 + dt, lambda n=name: ran.append((n, loop.time() - t0)))
            held = len(q._armed)
            await asyncio.sleep(4)
            return ran, held, len(q)

        ran, held, left = run(main())
        assert ran == [("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("c", 3.0)]
        assert held == 2  # the first (c at 3 s), then a (1 s) earlier: never one a callback
        assert left == 0

    def test_a_timer_made_while_the_queue_runs_waits_for_the_next_pass(self):
        async def main():
            loop = asyncio.get_running_loop()
            q = clock.TimerQueue(contextvars.Context())
            order: list[str] = []

            def first() -> None:
                order.append("first")
                loop.call_soon(order.append, "ready")  # what the loop has ready runs before...
                q.call_at(loop.time(), order.append, "due now")  # ...a timer due at once

            q.call_at(loop.time() + 1.0, first)
            await asyncio.sleep(2)
            return order

        assert run(main()) == ["first", "ready", "due now"]

    def test_a_failing_callback_is_reported_and_the_others_run(self):
        async def main():
            loop = asyncio.get_running_loop()
            reported: list[BaseException] = []
            loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx["exception"]))
            q = clock.TimerQueue(contextvars.Context())
            ran: list[int] = []
            q.call_at(loop.time() + 1.0, lambda: 1 / 0)
            q.call_at(loop.time() + 1.0, ran.append, 2)
            await asyncio.sleep(2)
            return reported, ran

        reported, ran = run(main())
        assert [type(e) for e in reported] == [ZeroDivisionError] and ran == [2]


class TestAgentReply:
    """A member's call through its node's agent answers into the batch at once and is settled
    once, as a future is; a collective's done-callback still runs soon after, not inside."""

    def test_settled_once_into_the_batch_with_callbacks_soon_after(self):
        from ftstate.simulation.agentcalls import AgentBatch

        async def main():
            cluster = SimulatedCluster(1, cpus_per_node=4, costs=QUIET)
            ms = await packed(cluster, 1)
            batch = AgentBatch(asyncio.get_running_loop(), cluster._agent("n0000000"), ms, [Info()])
            reply = batch.reply(0)
            called: list[object] = []
            reply.add_done_callback(called.append)
            reply.add_done_callback(lambda r: called.append("second"))
            reply.set_result({"ok": True})
            inside = list(called)
            with pytest.raises(asyncio.InvalidStateError):
                reply.set_exception(RuntimeError("late"))
            await asyncio.sleep(0)
            late: list[object] = []
            reply.add_done_callback(late.append)  # added once done: run soon, as a future's
            await asyncio.sleep(0)
            return batch.ended, inside, called, late, reply

        ended, inside, called, late, reply = run(main())
        assert ended == [(0, {"ok": True})] and reply.done()
        assert inside == [] and called == [reply, "second"] and late == [reply]
