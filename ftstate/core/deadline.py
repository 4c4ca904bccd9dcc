"""Deadlines, used by the state machines: an absolute point on a monotonic clock, owned by one stay in one
state, armed on entry and disarmed on exit (docs/concepts.md, "Deadlines"). The clock is injected:
:class:`LoopClock` in a run, :class:`ManualClock` in tests. Imports neither Ray nor torch."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the machines need of time: now, and a callback at an absolute time."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


class LoopClock:
    """The running asyncio loop's monotonic clock. Callbacks due in the same millisecond share one loop timer
    (never early, at most 1 ms late), since a loop timer per member's deadline is costly at scale."""

    def __init__(self) -> None:
        #: The last running loop's shared timers, which spares a deadline on that loop the lookup by loop.
        self._timers: _SharedTimers | None = None

    def now(self) -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:  # outside a loop: the same clock asyncio uses
            return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """Call ``callback`` at ``when`` on its millisecond's shared timer (a :class:`SharedTimer` is its
        own)."""
        entry = callback if isinstance(callback, SharedTimer) else _SharedHandle(callback)
        loop = asyncio.get_running_loop()
        timers = self._timers
        if timers is None or timers.loop is not loop:
            timers = _SHARED.get(loop)
            if timers is None:
                timers = _SHARED[loop] = _SharedTimers(loop)
            self._timers = timers
        timers.add(entry, when)
        return entry


class SharedTimer:
    """An entry of :class:`_SharedTimers`: called when its millisecond is due, unless cancelled."""

    __slots__ = ("_at", "_owner")

    def __init__(self) -> None:
        self._owner: _SharedTimers | None = None
        self._at = 0.0

    def __call__(self) -> None:  # pragma: no cover - every entry says what it does
        raise NotImplementedError

    def cancel(self) -> None:
        if self._owner is not None:
            self._owner.cancel(self)
            self._owner = None


class _SharedHandle(SharedTimer):
    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        super().__init__()
        self.callback = callback

    def __call__(self) -> None:
        self.callback()


class _SharedTimers:
    """One loop's callbacks by the millisecond they are due in, one loop timer a millisecond."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.due: dict[float, dict[SharedTimer, None]] = {}
        self.timers: dict[float, Any] = {}

    def add(self, entry: SharedTimer, when: float) -> None:
        at = math.ceil(when * 1000.0) / 1000.0
        if at < when:  # the float's own rounding: never early
            at = math.nextafter(at, math.inf)
        entry._owner, entry._at = self, at
        bucket = self.due.get(at)
        if bucket is None:
            bucket = self.due[at] = {}
            self.timers[at] = self.loop.call_at(at, self._fire, at)
        bucket[entry] = None

    def _fire(self, at: float) -> None:
        self.timers.pop(at, None)
        for entry in self.due.pop(at, ()):
            entry._owner = None
            try:
                entry()
            except Exception as exc:  # noqa: BLE001 - as the loop does for a timer's own callback
                self.loop.call_exception_handler({"message": "Exception in a deadline callback",
                                                  "exception": exc, "handle": entry})

    def cancel(self, entry: SharedTimer) -> None:
        bucket = self.due.get(entry._at)
        if bucket is None or bucket.pop(entry, 0) is not None:
            return
        if not bucket:
            del self.due[entry._at]
            timer = self.timers.pop(entry._at, None)
            if timer is not None:
                timer.cancel()


#: Each running loop's shared timers (gone with the loop).
_SHARED: weakref.WeakKeyDictionary[Any, _SharedTimers] = weakref.WeakKeyDictionary()


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


class ExpiryOwner(Protocol):
    """Who a :class:`Deadline` tells of its expiry (a state machine)."""

    def _on_expiry(self, entry: int) -> None: ...


class Deadline(SharedTimer):
    """One armed deadline: its ``state``, config ``key``, ``seconds``, ``armed_at``/``expires_at`` on the
    machine's clock and the state ``entry`` it belongs to; on expiry it calls ``_on_expiry(entry)``."""

    __slots__ = ("_handle", "_owner_machine", "armed_at", "entry", "expires_at", "key", "seconds", "state")

    def __init__(self, state: str, key: str, seconds: float, armed_at: float, expires_at: float, entry: int,
                 owner: ExpiryOwner | None = None) -> None:
        super().__init__()
        self.state = state
        self.key = key
        self.seconds = seconds
        self.armed_at = armed_at
        self.expires_at = expires_at
        self.entry = entry
        self._owner_machine = owner
        self._handle: TimerHandle | None = None

    @classmethod
    def arm(cls, clock: Clock, *, state: str, key: str, seconds: float, entry: int, owner: ExpiryOwner) -> Deadline:
        now = clock.now()
        d = cls(state, key, seconds, now, now + seconds, entry, owner)
        # The deadline is its own callback and timer entry: no handle or bound method lives as long as its
        # state.
        d._handle = clock.call_at(d.expires_at, d)
        return d

    def __call__(self) -> None:
        """The deadline's timer fired: its owner's ``_on_expiry(entry)``."""
        if self._owner_machine is not None:
            self._owner_machine._on_expiry(self.entry)

    def __repr__(self) -> str:
        return (f"Deadline(state={self.state!r}, key={self.key!r}, seconds={self.seconds!r}, "
                f"armed_at={self.armed_at!r}, expires_at={self.expires_at!r}, entry={self.entry!r})")

    def remaining(self, clock: Clock) -> float:
        return max(0.0, self.expires_at - clock.now())

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
