"""The garbage collector paused while calls are in flight (``gc_pause_s``,
:mod:`ftstate.controller.collector`): off inside, on after, bounded, shared by two runtimes, and
left off for a process that had turned it off; the real runtime pauses it for a sync, a failover
round and while a heartbeat round awaits its answers, and not between."""

from __future__ import annotations

import asyncio
import gc

import pytest

from ftstate.controller.collector import CollectorPause
from ftstate.simulation import clock
from ftstate.simulation.costs import Costs
from ftstate.simulation.scenario import Shape, simulated_runtime


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


class TestCollectorPause:
    def test_the_collector_is_off_inside_and_on_again_after(self):
        async def main():
            async with CollectorPause(30.0) as pause:
                inside = gc.isenabled(), pause.active
            return inside, gc.isenabled(), pause.active

        assert clock.run(main()) == ((False, True), True, False)

    def test_it_is_on_again_after_an_error_inside(self):
        async def main():
            with pytest.raises(KeyError):
                async with CollectorPause(30.0):
                    raise KeyError("x")
            return gc.isenabled()

        assert clock.run(main()) is True

    def test_a_pause_past_its_bound_lets_the_collector_run_again(self):
        async def main():
            async with CollectorPause(2.0) as pause:
                await asyncio.sleep(1.0)
                before = gc.isenabled()
                await asyncio.sleep(1.5)
                return before, gc.isenabled(), pause.active

        assert clock.run(main()) == (False, True, False)

    def test_zero_seconds_means_no_pause(self):
        async def main():
            async with CollectorPause(0.0) as pause:
                return gc.isenabled(), pause.active

        assert clock.run(main()) == (True, False)

    def test_two_pauses_at_once_keep_it_off_until_the_last_ends(self):
        async def main():
            first, second = CollectorPause(30.0), CollectorPause(30.0)
            await first.__aenter__()
            await second.__aenter__()
            await first.__aexit__(None, None, None)
            between = gc.isenabled()
            await second.__aexit__(None, None, None)
            return between, gc.isenabled()

        assert clock.run(main()) == (False, True)

    def test_a_collector_the_process_turned_off_stays_off(self):
        gc.disable()

        async def main():
            async with CollectorPause(30.0):
                pass
            return gc.isenabled()

        assert clock.run(main()) is False

    def test_ending_twice_ends_once(self):
        async def main():
            outer = CollectorPause(30.0)
            await outer.__aenter__()
            async with CollectorPause(1.0):
                await asyncio.sleep(2.0)  # the inner one's bound ended it; its exit must not end the outer
                still_off = not gc.isenabled()
            off_after_inner = not gc.isenabled()
            outer.end()
            return still_off, off_after_inner, gc.isenabled()

        assert clock.run(main()) == (True, True, True)


class TestTheRuntimePausesIt:
    @staticmethod
    def _seen_during_sync(overrides):
        """Whether the collector was on, sampled every millisecond of virtual time while a
        sync of a simulated runtime ran, and once the sync had returned."""

        async def main():
            rt, _ = simulated_runtime(Shape(rollouts=4, nodes=2, spares=0), costs=Costs(jitter=0.0),
                                      overrides=overrides)
            await rt.start()
            seen: list[bool] = []
            done = asyncio.Event()

            async def sample():
                while not done.is_set():
                    seen.append(gc.isenabled())
                    await asyncio.sleep(0.001)

            sampler = asyncio.get_running_loop().create_task(sample())
            await asyncio.sleep(0.0005)
            try:
                await rt.sync()
            finally:
                done.set()
                await sampler
            after = gc.isenabled()
            await rt.close()
            return seen, after

        return clock.run(main())

    def test_a_sync_runs_with_the_collector_off_and_turns_it_on_again(self):
        seen, after = self._seen_during_sync(None)
        assert len(seen) > 3 and not any(seen[1:])
        assert after is True

    def test_gc_pause_s_0_leaves_it_on(self):
        seen, after = self._seen_during_sync({"gc_pause_s": 0})
        assert len(seen) > 3 and all(seen) and after is True

    @staticmethod
    def _seen_while_idle(overrides):
        """Whether the collector was on, sampled every 0.2 ms of virtual time over five heartbeat
        intervals of a started runtime that does nothing else."""

        async def main():
            rt, _ = simulated_runtime(Shape(rollouts=8, nodes=2, spares=0), costs=Costs(jitter=0.0),
                                      overrides=overrides)
            await rt.start()
            seen: list[bool] = []
            end = asyncio.get_running_loop().time() + 5 * rt.config.heartbeat_interval_s
            while asyncio.get_running_loop().time() < end:
                seen.append(gc.isenabled())
                await asyncio.sleep(0.0002)
            await rt.close()
            return seen, gc.isenabled()

        return clock.run(main())

    def test_a_heartbeat_round_awaits_its_answers_with_the_collector_off_and_on_between_rounds(self):
        seen, after = self._seen_while_idle(None)
        assert seen.count(False) >= 5 and seen.count(True) > seen.count(False)
        assert after is True

    def test_gc_pause_s_0_leaves_it_on_between_syncs_too(self):
        seen, after = self._seen_while_idle({"gc_pause_s": 0})
        assert all(seen) and after is True

    def test_a_failover_round_runs_with_the_collector_off(self):
        async def main():
            rt, cluster = simulated_runtime(Shape(rollouts=3, nodes=3, spares=1), costs=Costs(jitter=0.0))
            await rt.start()
            await rt.sync()
            failover = rt._parts()[4]
            seen: list[bool] = []
            replace = failover._replace

            async def replace_seen(batch):
                seen.append(gc.isenabled())
                return await replace(batch)

            failover._replace = replace_seen
            cluster.kill_member("rollout-1")
            await asyncio.sleep(1)
            report = await rt.sync()
            await rt.close()
            return seen, report, gc.isenabled()

        seen, report, after = clock.run(main())
        assert seen == [False] and "spare-rollout-1" in report.rollouts and after is True
