"""Virtual time, for the simulation: an asyncio event loop whose clock jumps to the next timer instead of
waiting, so a simulated day costs only the controller's CPU and a run is deterministic. Chosen over
``looptime``, whose per-jump polling a loop with no I/O does not need (docs/simulation.md). Real I/O or
threads still work, waited for in real time, 50 ms at a time."""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


#: With only the loop's self-pipe registered and no thread's wake-up seen, the real selector is
#: polled once in this many passes (for a signal's byte written by C): a poll is a system call.
POLL_EVERY = 64


class _JumpingSelector(selectors.DefaultSelector):
    """The loop's selector: polls without waiting and moves the clock by the time it would sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None
        #: A thread asked the loop to wake (``call_soon_threadsafe``): poll now.
        self.woken = False
        self._passes = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self._passes += 1
        if (self.woken or len(self._fd_to_key) > 1 or timeout is None or self.loop is None
                or self._passes % POLL_EVERY == 0):
            self.woken = False
            ready = super().select(0)
            if ready or self.loop is None:
                return ready
        else:  # only the self-pipe, and nobody wrote to it from Python: nothing to read
            ready = []
        if timeout is None:
            # Nothing scheduled or ready: what is awaited waits on real I/O or a thread, which virtual time
            # cannot advance (a thread's call_soon_threadsafe still wakes it, after a real wait).
            return super().select(0.05)
        if timeout > 0:
            self.loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop in virtual time, starting at ``start`` seconds."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = float(start)

    def time(self) -> float:
        return self._virtual_now

    def _write_to_self(self) -> None:
        # a thread's call_soon_threadsafe (or the runner's Ctrl-C): the selector polls next pass
        self._selector.woken = True  # type: ignore[attr-defined]
        super()._write_to_self()  # type: ignore[misc]

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (what the loop does itself when idle)."""
        self._virtual_now += seconds


class TimerQueue:
    """The simulation's own timers behind one loop timer: each a tuple on a heap compared in C, only the
    earliest holding a loop timer (loop timers compare in Python, a tenth of a large sync's CPU). Callbacks
    run in ``context`` as a loop timer's would; timers cannot be cancelled, so modelled outcomes check whether
    what they settle is still pending."""

    def __init__(self, context: contextvars.Context) -> None:
        self.context = context
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._armed: list[float] = []  # the loop timers held, by time
        self._loop: asyncio.AbstractEventLoop | None = None

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        """Call ``callback(*args)`` at ``when`` on the running loop's clock."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop: what was pending belonged to the last one
            self._loop, self._heap, self._armed = loop, [], []
        heapq.heappush(self._heap, (when, next(self._seq), callback, args))
        if not self._armed or when < self._armed[0]:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        heapq.heappush(self._armed, when)
        loop.call_at(when, self._run, loop, context=self.context)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop or not self._armed:
            return
        heapq.heappop(self._armed)  # loop timers fire in the order of their times: the earliest
        now, last = loop.time(), next(self._seq)
        heap = self._heap
        while heap and heap[0][0] <= now and heap[0][1] < last:
            _, _, callback, args = heapq.heappop(heap)
            try:
                callback(*args)
            except Exception as exc:  # noqa: BLE001 - as the loop does for a timer's own callback
                loop.call_exception_handler({"message": "Exception in a simulated timer's callback",
                                             "exception": exc})
        if heap and (not self._armed or heap[0][0] < self._armed[0]):
            self._arm(loop, heap[0][0])

    def __len__(self) -> int:
        return len(self._heap)


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop` (as ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(main)


__all__ = ["TimerQueue", "VirtualTimeLoop", "run"]
