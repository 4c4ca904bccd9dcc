"""The fleet grown and shrunk while syncs run, against simulated members in virtual time (issue 44).

The real controller on a :class:`~ftstate.simulation.cluster.SimulatedCluster`: a run that syncs
every step is scaled 2 -> 8 -> 2 rollouts meanwhile. Every sync commits, none fails, no newcomer
is fed by the trainer, no budget is spent, and the standby pool follows the fleet.
"""

from __future__ import annotations

import asyncio

from ftstate.simulation import clock
from ftstate.simulation.scenario import Shape, simulated_runtime


def rollout_spares(rt) -> int:
    return sum(1 for m in rt.members() if m.role == "rollout" and m.rank < 0 and m.state in ("INIT", "STANDBY"))


def fleet(rt) -> int:
    return sum(1 for m in rt.members() if m.role == "rollout" and m.rank >= 0 and m.state not in ("RETIRED", "LOST"))


def test_a_run_syncing_every_step_scales_two_to_eight_to_two_and_every_sync_commits():
    async def main():
        rt, _ = simulated_runtime(Shape(rollouts=2, nodes=4, headroom=4), keep_records=True)
        await rt.start()
        reports = []
        stop = asyncio.Event()

        async def train():
            while not stop.is_set():
                await rt.trainer("train_step")
                reports.append(await rt.sync())

        loop = asyncio.ensure_future(train())
        while not reports:  # a version committed: newcomers are fed it by the rollouts holding it
            await asyncio.sleep(0.1)
        grown = await rt.scale_rollouts(8)
        assert grown is not None and grown.kind == "add" and len(grown.members) == 6
        assert fleet(rt) == 8 and grown.trainer_sources == 0  # (a sync may be committing: not all serve now)
        # each fed by a rollout (a warm spare promoted may feed the next wave) or a node copy
        assert all(s is not None and s.startswith(("rollout-", "spare-rollout-", "node copy"))
                   for s in grown.sources.values()), grown.sources
        assert grown.promoted and set(grown.promoted) <= set(grown.members)  # the warm spares went first
        while len(reports[-1].rollouts) != 8:  # a sync of the grown fleet
            await asyncio.sleep(0.1)
        assert rollout_spares(rt) == 4  # one per two rollouts, as configured (1 per 2)
        shrunk = await rt.scale_rollouts(2)
        assert shrunk is not None and shrunk.kind == "remove" and len(shrunk.members) == 6
        synced = len(reports)
        while len(reports) < synced + 2:  # and of the shrunk one
            await asyncio.sleep(0.1)
        stop.set()
        await loop
        assert len(rt.serving_rollouts()) == 2 and rollout_spares(rt) == 1
        assert not [r for r in rt.audit.records if r["event"] in ("sync_retry", "sync_gave_up", "budget_spent")]
        sizes = [len(r.rollouts) for r in reports]
        assert 8 in sizes and sizes[-1] == 2 and len(reports) >= 3
        assert [r.weights_version for r in reports] == list(range(1, len(reports) + 1))  # every one committed
        holds = {m.weights_version for m in rt.members() if m.member in rt.serving_rollouts()}
        assert holds == {rt.weights_version} and rt.failovers == []
        await rt.close()

    clock.run(main())


class TestRefusals:
    """What cannot be done is refused before anything changes, naming the field and what it expected."""

    def test_bad_requests_and_a_removal_below_the_minimum_change_nothing(self):
        import pytest

        from ftstate.core.errors import ScaleRefused

        async def main():
            rt, _ = simulated_runtime(Shape(rollouts=3, nodes=2, headroom=4), keep_records=True,
                                      overrides={"fault_tolerance": {"min_rollout_workers": 2}})
            await rt.start()
            await rt.sync()
            version, members = rt.group_version, len(rt.members())
            for n in (0, -1, True, 1.5):
                with pytest.raises(ScaleRefused, match=r"^n: expected a positive int"):
                    await rt.add_rollouts(n)
            for names, got in ((["rollout-9"], "rollout-9"), (["rollout-0", "rollout-0"], "rollout-0, rollout-0"),
                               (["trainer-0"], "trainer-0")):
                with pytest.raises(ScaleRefused, match=rf"^names: expected distinct rollouts of the fleet .*got {got}$"):
                    await rt.remove_rollouts(names)
            with pytest.raises(ScaleRefused, match=r"^names: expected a non-empty list"):
                await rt.remove_rollouts([])
            with pytest.raises(ScaleRefused) as info:
                await rt.remove_rollouts(["rollout-0", "rollout-1"])
            assert info.value.field == "fault_tolerance.min_rollout_workers"
            assert "at least 2 rollouts left" in str(info.value) and "1 left" in str(info.value)
            with pytest.raises(ScaleRefused, match="min_rollout_workers"):
                await rt.scale_rollouts(1)
            assert (rt.group_version, len(rt.members())) == (version, members)
            assert len(rt.serving_rollouts()) == 3 and not rt.scalings
            assert await rt.scale_rollouts(3) is None  # already there: nothing to do
            await rt.close()

        clock.run(main())

    def test_a_newcomer_before_the_first_sync_waits_stale_and_the_first_sync_brings_it_up(self):
        async def main():
            rt, _ = simulated_runtime(Shape(rollouts=2, nodes=2, headroom=4), keep_records=True)
            await rt.start()
            [name] = await rt.add_rollouts(1)
            assert rt.scalings[0].sources == {name: None}  # nothing committed to feed it yet
            assert {m.member: m.state for m in rt.members()}[name] == "STALE"
            report = await rt.sync()
            assert name in report.rollouts and name in rt.serving_rollouts()
            await rt.close()

        clock.run(main())


def test_with_fault_tolerance_off_the_fleet_still_grows_and_shrinks_and_a_newcomer_lost_fails_nothing():
    """Scaling is no failover: it works with fault tolerance off, and a newcomer lost while it is
    started is started again there too, where any other loss would fail the run."""
    async def main():
        rt, cluster = simulated_runtime(Shape(rollouts=2, nodes=2, headroom=4, spares=0), keep_records=True,
                                        overrides={"fault_tolerance": {"enable": False}})
        await rt.start()
        await rt.sync()
        adding = asyncio.ensure_future(rt.add_rollouts(2))
        while not any(m.member == "rollout-2" and m.state == "RENDEZVOUS" for m in rt.members()):
            await asyncio.sleep(0.01)
        cluster.kill_member("rollout-2")  # a newcomer lost before it was fed
        names = await adding
        assert "rollout-2" not in names and len(names) == 2 and rt.scalings[0].restarted == ("rollout-2",)
        assert rt.state == "READY" and len(rt.serving_rollouts()) == 4
        report = await rt.sync()
        assert set(names) <= set(report.rollouts)
        await rt.remove_rollouts(names)
        assert sorted(rt.serving_rollouts()) == ["rollout-0", "rollout-1"]
        assert (await rt.sync()).rollouts == ("rollout-0", "rollout-1")
        await rt.close()

    clock.run(main())


def test_a_node_that_joins_is_given_rollouts_by_name_and_a_bad_node_is_refused_before_anything_changes():
    """The user's loop sees a node join (``rt.nodes()``) and adds rollouts there only
    (``add_rollouts(n, nodes=[...])``); a node id that is not alive, or that cannot hold a
    rollout (a cpu-less node here), is refused with ScaleRefused naming ``nodes``."""
    import pytest

    from ftstate.core.errors import ScaleRefused

    async def main():
        rt, cluster = simulated_runtime(Shape(rollouts=2, nodes=2, headroom=4), keep_records=True)
        await rt.start()
        report = await rt.sync()
        before = {n["node_id"] for n in rt.nodes()}
        joined = cluster.add_node(cpus=1)  # the least room: without `nodes` the placement would go elsewhere
        tiny = cluster.add_node(cpus=0.001)
        [new] = [n for n in rt.nodes() if n["node_id"] == joined]
        assert joined not in before and new["members"] == []
        version, members = rt.group_version, len(rt.members())
        for nodes, got in ((["n9999999"], "'n9999999': not an alive node"), ([tiny], f"'{tiny}': a node that cannot"),
                           ([], "[]"), (joined, repr(joined))):
            with pytest.raises(ScaleRefused, match=r"^nodes: expected .*got " + got.replace("[", r"\[").replace("]", r"\]")):
                await rt.add_rollouts(1, nodes=nodes)
        assert (rt.group_version, len(rt.members())) == (version, members) and not rt.scalings
        names = await rt.add_rollouts(2, nodes=[joined])
        on = {m.member: m.node_id for m in rt.members()}
        assert {on[n] for n in names} == {joined}
        assert next(n for n in rt.nodes() if n["node_id"] == joined)["members"] == sorted(names)
        record = rt.scalings[-1]
        assert record.trainer_sources == 0 and all(record.sources.values())
        assert set(names) <= set(rt.serving_rollouts())
        held = {m.member: m.weights_version for m in rt.members()}
        assert {held[n] for n in rt.serving_rollouts()} == {report.weights_version}
        after = await rt.sync()  # the next sync reaches them too
        assert set(names) <= set(after.rollouts)
        await rt.close()

    clock.run(main())


def test_newcomers_are_fed_in_waves_each_holder_feeding_one_and_each_newcomer_fed_feeding_the_next():
    """Eight newcomers on their own nodes, two rollouts holding the version: the first wave has
    two transfers at once, the next four (the two fed among the sources), then the rest, never
    two on one node, and none from the trainer; every newcomer proven."""
    async def main():
        rt, cluster = simulated_runtime(Shape(rollouts=2, nodes=2, headroom=4), keep_records=True)
        await rt.start()
        report = await rt.sync()
        joined = [cluster.add_node(cpus=2) for _ in range(8)]
        names = await rt.add_rollouts(8, nodes=joined)
        record = rt.scalings[-1]
        assert record.trainer_sources == 0 and set(names) <= set(rt.serving_rollouts())
        assert set(record.sources.values()) & set(names), record.sources  # a newcomer fed another
        on = {m.member: m.node_id for m in rt.members()}
        began, ended, most, running = {}, {}, 0, set()
        for r in rt.audit.records:  # the transfers in flight at once, from the newcomers' transitions
            if r["event"] != "transition" or r.get("member") not in names:
                continue
            if r["to"] == "RESYNCING":
                running.add(r["member"])
                began[r["member"]] = r.get("source")
                assert len({on[n] for n in running}) == len(running)  # never two on one node
                most = max(most, len(running))
            elif r["from"] == "RESYNCING":
                running.discard(r["member"])
                ended[r["member"]] = r["to"]
        assert most >= 4 and set(ended) == set(names) and set(ended.values()) == {"RESYNCED"}, (most, ended)
        held = {m.member: m.weights_version for m in rt.members()}
        assert {held[n] for n in names} == {report.weights_version}
        await rt.close()

    clock.run(main())


def test_with_several_trainer_ranks_the_fleet_grows_and_shrinks_fed_by_rollouts_only():
    """A sharded trainer (two ranks) changes nothing of scaling: newcomers are fed by the
    rollouts, the next sync reaches them, and a removal leaves the ranks as they were."""
    async def main():
        rt, _ = simulated_runtime(Shape(rollouts=2, nodes=4, headroom=4, trainers=2), keep_records=True)
        await rt.start()
        await rt.trainer("train_step")
        await rt.sync()
        names = await rt.add_rollouts(3)
        record = rt.scalings[-1]
        trainers = {m.member for m in rt.members() if m.role == "trainer" and m.rank >= 0}
        assert len(trainers) == 2 and record.trainer_sources == 0
        assert all(s is not None and s not in trainers for s in record.sources.values()), record.sources
        await rt.trainer("train_step")
        report = await rt.sync()
        assert set(names) <= set(report.rollouts) and len(report.rollouts) == 5
        await rt.remove_rollouts(names[:2])
        after = await rt.sync()
        assert sorted(after.rollouts) == sorted(rt.serving_rollouts()) and len(after.rollouts) == 3
        assert {m.member for m in rt.members() if m.role == "trainer" and m.rank >= 0} == trainers
        assert rt.failovers == [] and after.weights_version == report.weights_version + 1
        await rt.close()

    clock.run(main())
