"""A trainer call while the trainer is SUSPECT, with fault tolerance off (simulated cluster, no Ray).

Seen on the loaded 2-core CI machine (tests/multinode/test_plan.py): the trainer missed one
0.2 s heartbeat during a sync, went SUSPECT, and the test's next ``rt.trainer("checksum")``
failed at once with ``MemberLost: trainer-0 lost: not serving yet (SUSPECT)`` although nobody
was lost: the next heartbeat cleared it. A suspect is not lost: the call waits for the
watchdog's verdict (bounded by ``heartbeat_timeout_s``) and is made once more; a trainer that
is really hung is declared LOST by then, and the call fails naming it.
"""

from __future__ import annotations

import asyncio

import pytest

from ftstate.core.errors import FTError, MemberLost
from ftstate.simulation import clock
from ftstate.simulation.scenario import Shape, simulated_runtime

OVERRIDES = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "fault_tolerance": {"enable": False}}


def run(main):
    with asyncio.Runner(loop_factory=clock.VirtualTimeLoop) as runner:
        return runner.run(main())


def test_a_trainer_that_missed_one_heartbeat_is_waited_for_not_reported_lost():
    async def main():
        rt, _ = simulated_runtime(Shape(rollouts=2, spares=0), overrides=OVERRIDES)
        await rt.start()
        try:
            await rt.sync()
            trainer = rt._membership.trainer()
            await trainer.machine.fire("heartbeat_missed", reason="as if one heartbeat came late")
            assert trainer.machine.state == "SUSPECT"
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await rt.trainer("checksum")  # waits for the next heartbeat's verdict, then runs
            assert trainer.machine.state == "READY"
            assert loop.time() - t0 < OVERRIDES["heartbeat_timeout_s"]
            report = await rt.sync()
            assert report.rollouts == ("rollout-0", "rollout-1")
        finally:
            await rt.close()

    run(main)


def test_a_hung_trainer_is_still_reported_once_the_watchdog_declares_it_lost():
    async def main():
        rt, cluster = simulated_runtime(Shape(rollouts=2, spares=0), overrides=OVERRIDES)
        await rt.start()
        try:
            await rt.sync()
            cluster.hang_member("trainer-0")
            await asyncio.sleep(0.5)  # a heartbeat or two missed: SUSPECT
            assert rt._membership.trainer().machine.state == "SUSPECT"
            with pytest.raises((MemberLost, FTError), match="trainer-0"):
                await rt.trainer("train_step")
        finally:
            await rt.close()

    run(main)
