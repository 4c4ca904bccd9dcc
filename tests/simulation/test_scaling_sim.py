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
        assert all(s is not None and s.startswith(("rollout-", "node copy")) for s in grown.sources.values()), grown.sources
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
