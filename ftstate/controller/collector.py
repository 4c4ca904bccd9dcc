"""The controller's garbage collector, paused while calls are in flight (``gc_pause_s``): during a sync, a
failover round and a heartbeat round. At thousands of members every call in flight is alive at a young
collection and gets promoted, to be walked again by every full collection; paused, they die by reference
counting first (docs/benchmarks.md, "Controller at scale"). A pause lasts at most ``gc_pause_s`` of loop time,
is process-wide and counted, and leaves the collector off if the process had turned it off itself."""

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
    """One pause of at most ``max_s`` loop seconds (0: none), used as ``async with`` around a sync or a round;
    ending it twice ends it once."""

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
