"""LoopClock's timers: callbacks due in the same millisecond share one loop timer, never run
early, and a cancelled one never runs (the deadlines of thousands of members armed at once)."""

from __future__ import annotations

import asyncio

from ftstate.core.deadline import _SHARED, Deadline, LoopClock
from ftstate.simulation import clock as virtual


def test_callbacks_due_in_one_millisecond_share_one_loop_timer_and_never_run_early():
    async def main():
        loop = asyncio.get_running_loop()
        ran: list[tuple[str, float]] = []
        clocks = [LoopClock() for _ in range(3)]  # one a machine: the timers are the loop's
        t0 = loop.time()
        handles = [c.call_at(t0 + 1.0002 + i * 1e-5, lambda i=i: ran.append((f"a{i}", loop.time())))
                   for i, c in enumerate(clocks)]
        later = clocks[0].call_at(t0 + 2.0, lambda: ran.append(("b", loop.time())))
        assert len(_SHARED[loop].timers) == 2  # one for the three in the same millisecond, one later
        handles[1].cancel()
        handles[1].cancel()  # twice: nothing more
        await asyncio.sleep(3)
        later.cancel()  # ran already: nothing to cancel
        return t0, ran, dict(_SHARED[loop].timers)

    t0, ran, left = virtual.run(main())
    assert [name for name, _ in ran] == ["a0", "a2", "b"]
    assert all(when >= t0 + 1.0002 + 2e-5 for name, when in ran if name.startswith("a"))
    assert all(when - t0 <= 1.0012 for name, when in ran if name.startswith("a"))  # at most 1 ms late
    assert left == {}


def test_a_bucket_whose_callbacks_are_all_cancelled_cancels_its_loop_timer():
    async def main():
        loop = asyncio.get_running_loop()
        ran: list[int] = []
        c = LoopClock()
        hs = [c.call_at(loop.time() + 1.0, lambda: ran.append(1)) for _ in range(2)]
        timer = next(iter(_SHARED[loop].timers.values()))
        for h in hs:
            h.cancel()
        await asyncio.sleep(2)
        return ran, timer.cancelled(), dict(_SHARED[loop].due)

    ran, cancelled, due = virtual.run(main())
    assert ran == [] and cancelled and due == {}


def test_a_deadline_is_its_own_entry_of_the_shared_timer_and_calls_its_owner_back():
    """An armed deadline on the loop's clock is one object (no handle, no bound method): it sits
    in its millisecond's bucket itself, is called back with its entry, and disarming it takes
    it out (a bucket left empty cancels its loop timer)."""

    class Owner:
        def __init__(self) -> None:
            self.expired: list[int] = []

        def _on_expiry(self, entry: int) -> None:
            self.expired.append(entry)

    async def main():
        loop = asyncio.get_running_loop()
        clock, owner = LoopClock(), Owner()
        fires = Deadline.arm(clock, state="SYNCING", key="sync_timeout_s", seconds=1.0, entry=7, owner=owner)
        disarmed = Deadline.arm(clock, state="SYNCING", key="sync_timeout_s", seconds=2.0, entry=8, owner=owner)
        buckets = [list(b) for b in _SHARED[loop].due.values()]
        disarmed.disarm()
        disarmed.disarm()  # twice: nothing more
        after_disarm = len(_SHARED[loop].timers)
        await asyncio.sleep(3)
        return fires, buckets, after_disarm, owner.expired, loop.time()

    fires, buckets, after_disarm, expired, _ = virtual.run(main())
    assert buckets == [[fires], [buckets[1][0]]] and buckets[1][0] is not fires
    assert after_disarm == 1  # the disarmed one's bucket and its loop timer are gone
    assert expired == [7]
