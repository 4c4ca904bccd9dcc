"""Vigils, kept by the controller: one ``vigil()`` call pending on every worker, so a death surfaces as a
failing call at once even when the worker is idle (a heartbeat poll takes far longer). A vigil ending any
other way is dropped and kept again: an accelerator, never the only way a death is noticed. Heartbeats stay
for the hung."""

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
        """Have a vigil pending on each constructed, not-gone member of ``members`` and drop those of gone
        ones. ``generation`` changes whenever ``members`` may have; while it holds and no vigil ended, nothing
        is walked (None: always look)."""
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
        # A death is reported by calls.call itself; whatever else ends the call is the heartbeat's to judge.
        with contextlib.suppress(Exception):
            await self.calls.call(m.name, m.handle, Vigil())

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Vigils"]
