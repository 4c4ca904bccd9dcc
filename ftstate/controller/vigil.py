"""Vigils: one call kept pending on every worker, so a death surfaces at once, idle or not.

Ray reports an actor's death as ``ActorDiedError`` on the calls pending when it dies, within
~15-20 ms of a SIGKILL (DESIGN.md); a worker with nothing pending was found only by the next
heartbeat poll (median 124 ms, p95 202 ms at a 0.2 s interval, docs/benchmarks.md). Each
member therefore gets one ``vigil()`` call that never returns while the process lives (an
async actor method waiting on an event that is never set: it occupies no thread and one of
the actor's concurrency slots). When the process dies, that call fails through
:meth:`~ftstate.controller.calls.ActorCalls.call`, which fires the member's ``died`` event
exactly as any other failing call would. Heartbeats stay for what a vigil cannot see: a
process alive but hung.

A vigil that ends for any other reason (the actor is unreachable, a bug) is simply dropped,
and kept again by the next :meth:`Vigils.keep`: it is an accelerator, never the only way a
death is noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.membership import Member
from ftstate.core.protocol import Vigil


class Vigils:
    """One pending ``vigil()`` call per live member."""

    def __init__(self, calls: ActorCalls) -> None:
        self.calls = calls
        self._tasks: dict[str, tuple[object, asyncio.Task[None]]] = {}
        self._kept: int | None = None  # the generation of the members last kept
        self._ended = False  # a vigil ended since

    def keep(self, members: Iterable[Member], generation: int | None = None) -> None:
        """Have a vigil pending on each of ``members`` that is constructed and not gone; drop
        those of members gone. A member still constructing (INIT) has its start call pending
        already, and the launcher decides what a spare that dies or hangs while warming means.

        ``generation``: a number that the caller changes whenever ``members`` may have changed
        (the watchdog's :class:`~ftstate.controller.watchdog.NodeRounds`); while it stays the
        same and no vigil ended, there is nothing to do and nothing is walked. None: always look."""
        if generation is not None and generation == self._kept and not self._ended:
            return
        self._kept, self._ended = generation, False
        live = {m.name: m for m in members if not m.gone and m.machine.state != "INIT"}
        for name in [n for n, (_, t) in self._tasks.items() if n not in live or t.done()]:
            _, task = self._tasks.pop(name)
            task.cancel()
        for name, m in live.items():
            if name not in self._tasks:
                task = asyncio.get_running_loop().create_task(self._watch(m), name=f"vigil-{name}")
                task.add_done_callback(self._on_end)
                self._tasks[name] = (m.handle, task)

    def _on_end(self, _task: Any) -> None:
        self._ended = True

    async def _watch(self, m: Member) -> None:
        # A death is reported by calls.call itself (the member's ``died`` event); whatever
        # else ends the call is the heartbeat's to judge.
        with contextlib.suppress(Exception):
            await self.calls.call(m.name, m.handle, Vigil())

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Vigils"]
