"""The controller's garbage collector, paused while calls are in flight (``gc_pause_s``):
during a sync, a failover round, and a heartbeat round while it awaits the nodes' answers.

Why: each of them keeps one call in flight per member or node (a task, its coroutines, a
future, a reply) for as long as the members take to answer. CPython's collector examines the
young objects every few hundred allocations and moves those still alive to the next
generation; at thousands of members nearly every call in flight is alive at a young
collection, so the calls end up in the oldest generation, and every object promoted there is
walked again, with every other live object of the process, by the full collections that
promotions set off (one per a quarter of the long-lived heap promoted). Measured at 10,000
simulated members (``benchmarks/controller_scale.py``): 170,000 objects promoted a sync and a
third of its CPU in full collections; the heartbeat rounds' and the failover rounds'
promotions set off more. With the collector paused, those objects die by reference counting
when their call ends, before any collection sees them; what is left alive at the end is
examined once, by the first young collection after.

What it changes for the process: the automatic collector (``gc.enable``) is off while a pause
holds, at most ``gc_pause_s`` seconds of the event loop's clock each time (then it is on
again: a sync that waits on a slow transfer, a round that waits on a cold start), as the
standard library's ``timeit`` turns it off around what it times. Reference counting frees
everything that is not in a cycle as before; cycles made meanwhile wait for the next
collection. ``gc.collect()`` still collects. The pause is process-wide and counted: two
pauses at once (a sync and a heartbeat round, two runtimes in one process) share one, the
collector is turned back on when the last ends, and only if it was on when the first began (a
process that turned it off itself keeps it off).
"""

from __future__ import annotations

import asyncio
import gc
import threading

_lock = threading.Lock()
_holders = 0  # pauses under way in this process
_resume = False  # the collector was on when the first of them began


def _pause() -> None:
    global _holders, _resume
    with _lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1


def _end() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0 and _resume:
            gc.enable()


class CollectorPause:
    """One pause of the collector, at most ``max_s`` seconds of the running loop's clock
    (0: no pause at all). Entered and left as an ``async with`` around a sync or a round; ending
    it twice (the bound, then the exit) ends it once."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self._on = False
        self._timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> CollectorPause:
        if self.max_s > 0:
            _pause()
            self._on = True
            self._timer = asyncio.get_running_loop().call_later(self.max_s, self.end)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        """The collector is on again (unless another pause holds it, or it was off before)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._on:
            self._on = False
            _end()

    @property
    def active(self) -> bool:
        """Whether this pause holds the collector off now."""
        return self._on


__all__ = ["CollectorPause"]
