"""Deadlines: an absolute point on a monotonic clock, owned by one stay in one state.

A deadline belongs to a state the way trio's deadline belongs to a cancel scope, not to
each call: entering a state that declares one arms it (``seconds`` from the config key the
spec names), leaving the state disarms it, and expiry makes the machine take the spec's
named transition and record a typed error. Code that waits on something outside the
process while the machine is in that state runs inside
:meth:`ftstate.core.machine.StateMachine.deadline_scope`, which cancels it explicitly on expiry
and raises the recorded error; nobody sprinkles ``asyncio.wait_for`` over calls.

The clock is injected. :class:`LoopClock` uses the running asyncio loop; tests use
:class:`ManualClock` and advance time by hand, so no test sleeps to see a deadline pass.
This module imports neither Ray nor torch.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the machines need of time: now, and a callback at an absolute time."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


class LoopClock:
    """The running asyncio loop's monotonic clock (create machines inside the loop)."""

    def now(self) -> float:
        import asyncio

        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:  # outside a loop: the same clock asyncio uses
            import time

            return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        import asyncio

        return asyncio.get_running_loop().call_at(when, callback)


class ManualClock:
    """A clock that moves only when told to; :meth:`advance` runs what falls due, in order."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _ManualHandle]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        handle = _ManualHandle(callback)
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        return handle

    def advance(self, seconds: float) -> int:
        """Move time forward; returns how many callbacks ran."""
        target = self._now + seconds
        ran = 0
        while self._heap and self._heap[0][0] <= target:
            when, _, handle = heapq.heappop(self._heap)
            self._now = max(self._now, when)
            if not handle.cancelled:
                handle.callback()
                ran += 1
        self._now = target
        return ran

    @property
    def pending(self) -> int:
        return sum(1 for _, _, h in self._heap if not h.cancelled)


class _ManualHandle:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclasses.dataclass(slots=True)
class Deadline:
    """One armed deadline.

    state: the state it belongs to; key: the config key that set it; seconds: its length;
    armed_at / expires_at: absolute times on the machine's clock; entry: the state entry
    it belongs to (a later entry into the same state has a new deadline).
    """

    state: str
    key: str
    seconds: float
    armed_at: float
    expires_at: float
    entry: int
    _handle: TimerHandle | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def arm(
        cls, clock: Clock, *, state: str, key: str, seconds: float, entry: int, on_expiry: Callable[[int], None]
    ) -> Deadline:
        now = clock.now()
        d = cls(state=state, key=key, seconds=seconds, armed_at=now, expires_at=now + seconds, entry=entry)
        # a partial, not a closure: one object, where a member's deadline lives as long as its
        # state (10,000 of them through a sync at scale, promoted and walked by the collector)
        d._handle = clock.call_at(d.expires_at, functools.partial(on_expiry, entry))
        return d

    def remaining(self, clock: Clock) -> float:
        return max(0.0, self.expires_at - clock.now())

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
