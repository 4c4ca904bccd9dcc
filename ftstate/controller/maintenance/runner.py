"""The maintenance runner, in the controller: polls every watcher once per ``interval`` (each bounded by its
``bound_s`` plus slack) and reports changes through callbacks: ``on_notice`` (new, or its deadline moved),
``on_withdrawn`` (gone from a complete poll; a poll with a problem withdraws nothing), ``on_problem`` (once
when it starts or changes) and ``on_recovered``. New notices are reported before withdrawals, so a replacing
notice leaves no gap; a raising callback is the caller's bug and ends the poll. Synchronous watchers run in
the runner's own thread pool, so a silent server never occupies the loop's default executor (where the
transport blocks)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ftstate.controller.maintenance.base import Notice, PollProblem, PollResult, Watcher

Callback = Callable[..., Any]
#: Seconds added to a watcher's own bound before the runner gives up waiting for its poll.
SLACK_S = 0.5


@dataclasses.dataclass
class _Slot:
    watcher: Any
    label: str
    notices: dict[tuple[Any, ...], Notice] = dataclasses.field(default_factory=dict)
    problems: set[tuple[str, str, str]] = dataclasses.field(default_factory=set)
    failed_polls: int = 0
    pending: asyncio.Future[Any] | None = None


def label_of(watcher: Watcher) -> str:
    return getattr(watcher, "label", None) or watcher.source


class MaintenanceWatcher:
    """Polls maintenance watchers and reports new notices, withdrawals and poll problems."""

    def __init__(
        self,
        watchers: Sequence[Watcher],
        *,
        interval: float,
        on_notice: Callback | None = None,
        on_withdrawn: Callback | None = None,
        on_problem: Callback | None = None,
        on_recovered: Callback | None = None,
        slack_s: float = SLACK_S,
    ) -> None:
        self.interval = interval
        self.on_notice = on_notice
        self.on_withdrawn = on_withdrawn
        self.on_problem = on_problem
        self.on_recovered = on_recovered
        self.slack_s = slack_s
        self._slots: list[_Slot] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_threads = 0
        self.polls = 0
        self.add(watchers)

    @property
    def watchers(self) -> list[Watcher]:
        return [s.watcher for s in self._slots]

    @property
    def current(self) -> list[Notice]:
        """Every notice standing now (reported and not withdrawn)."""
        return [n for s in self._slots for n in s.notices.values()]

    def add(self, watchers: Sequence[Watcher]) -> None:
        """Poll these watchers too from the next round (e.g. a new node's ``ActorWatcher``)."""
        self._slots += [_Slot(w, label_of(w)) for w in watchers]
        threads = max(1, sum(1 for s in self._slots if not hasattr(s.watcher, "apoll")))
        if self._pool is None or self._pool_threads < threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # its running polls finish on their own timeouts
            self._pool_threads = threads
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="ftstate-maintenance")

    def remove(self, labels: Sequence[str]) -> list[Notice]:
        """Stop polling the watchers with these labels (a node gone); returns their standing notices, not
        reported as withdrawn."""
        gone = [s for s in self._slots if s.label in labels]
        self._slots = [s for s in self._slots if s.label not in labels]
        return [n for s in gone for n in s.notices.values()]

    async def run(self) -> None:
        """Poll forever, one round every ``interval`` seconds (the caller cancels it)."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> list[PollResult]:
        """One round: every watcher polled at once, then the changes reported."""
        results = await asyncio.gather(*(self._poll(slot) for slot in self._slots))
        self.polls += 1
        for slot, result in zip(self._slots, results, strict=True):
            await self._apply(slot, result)
        return list(results)

    def close(self) -> None:
        """Release the thread pool (polls still running finish on their own timeouts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- one watcher ---------------------------------------------------------------------------

    async def _poll(self, slot: _Slot) -> PollResult:
        w = slot.watcher
        bound = float(w.bound_s) + self.slack_s
        if slot.pending is not None and not slot.pending.done():
            return PollResult(w.source, (), (PollProblem(
                w.source, slot.label, "timeout", f"the previous poll is still running past its bound of {bound:g}s"),))
        loop = asyncio.get_running_loop()
        if hasattr(w, "apoll"):
            future: asyncio.Future[Any] = asyncio.ensure_future(w.apoll())
        else:
            future = loop.run_in_executor(self._pool, w.poll)
        future.add_done_callback(_consume)
        slot.pending = future
        t0 = loop.time()
        try:
            result = await asyncio.wait_for(asyncio.shield(future), bound)
        except TimeoutError:
            return PollResult(w.source, (), (PollProblem(
                w.source, slot.label, "timeout", f"the poll took longer than its bound of {bound:g}s",
                round(loop.time() - t0, 3)),))
        except Exception as exc:  # noqa: BLE001 - a watcher (or its actor) failing is a warning, not a crash
            return PollResult(w.source, (), (PollProblem(
                w.source, slot.label, "error", f"{type(exc).__name__}: {exc}", round(loop.time() - t0, 3)),))
        if not isinstance(result, PollResult):
            return PollResult(w.source, (), (PollProblem(
                w.source, slot.label, "error", f"poll() returned {type(result).__name__}, not a PollResult"),))
        return result

    async def _apply(self, slot: _Slot, result: PollResult) -> None:
        seen = {n.key: n for n in result.notices}
        before = slot.notices
        new = [n for k, n in seen.items() if k not in before or before[k].deadline != n.deadline]
        gone = [n for k, n in before.items() if k not in seen] if result.complete else []
        slot.notices = seen if result.complete else {**before, **seen}
        signatures = {p.signature: p for p in result.problems}
        fresh = [p for sig, p in signatures.items() if sig not in slot.problems]
        recovered = slot.failed_polls if result.complete and slot.failed_polls else 0
        slot.problems = set(signatures)
        slot.failed_polls = 0 if result.complete else slot.failed_polls + 1
        for n in new:
            await _call(self.on_notice, n)
        for n in gone:
            await _call(self.on_withdrawn, n)
        for p in fresh:
            await _call(self.on_problem, p)
        if recovered:
            await _call(self.on_recovered, slot.label, recovered)


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a poll nobody waited for any more (no 'never retrieved' noise)."""
    if not future.cancelled():
        future.exception()


async def _call(callback: Callback | None, *args: Any) -> None:
    if callback is None:
        return
    out = callback(*args)
    if inspect.isawaitable(out):
        await out

