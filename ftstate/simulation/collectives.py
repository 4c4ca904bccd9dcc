"""Simulated collectives and the simulated rendezvous store: what several simulated members
wait in together, and how a call's answer is settled.

A :class:`Collective` is one broadcast, point-to-point transfer or rendezvous of the simulated
cluster: it starts when every participant arrived, ends after its modelled cost, and breaks
(``PeerLost`` for the others) when one leaves first. :class:`SimulatedStore` is the rendezvous
store: one collective per group version, fenced as the real store fences. The outcome helpers
(:func:`settle`, :func:`answered`, :func:`fail`) are what every simulated answer goes through.

Runs in the simulation's one process, on its virtual clock
(:mod:`ftstate.simulation.clock`); a participant is any
:class:`~ftstate.simulation.members.SimulatedMember` (untyped here: the members import this module).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from ftstate.controller.backend import CallTimedOut, RemoteError
from ftstate.core.errors import PeerLost, RendezvousTimeout, StaleGroupVersion

#: A call's outcome, made when it is answered: a function of no arguments, or ``(function,
#: *arguments)`` (one tuple where a bound method and a partial were two objects for each call
#: in flight: 10,000 of them through a sync, which the collector promotes and walks).
Outcome = Callable[[], Any] | tuple[Any, ...]


def settle(fut: asyncio.Future[Any], outcome: Outcome) -> None:
    if fut.done():
        return
    try:
        fut.set_result(outcome[0](*outcome[1:]) if type(outcome) is tuple else outcome())  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the outcome is the call's answer: an error is one too
        fut.set_exception(exc)


def answered(member: Any, fut: asyncio.Future[Any], outcome: Outcome) -> None:
    """``fut`` of ``member`` settled with its ``outcome`` (a module function, not a bound method
    made for each call in flight)."""
    member.pending.pop(fut, None)  # answered: no death can fail it any more
    settle(fut, outcome)


def fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def time_out(fut: asyncio.Future[Any], timeout: float) -> None:
    if not fut.done():
        fut.set_exception(CallTimedOut(f"no answer within {timeout:g}s"))


def forget(collectives: list[Collective], c: Collective) -> None:
    if c in collectives:
        collectives.remove(c)


class Collective:
    """One collective of ``expected`` participants (a broadcast, a point-to-point transfer, a
    rendezvous): it starts when all arrived and ends ``cost_s`` later; one that leaves first
    (died, abandoned, cancelled) breaks it and the others fail with ``PeerLost``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, what: str, expected: int, cost_s: float,
                 detect_s: float, on_finish: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self.on_finish = on_finish
        self.what = what
        self.expected = expected
        self.cost_s = cost_s
        self.detect_s = detect_s
        self.arrivals: dict[int, tuple[Any, asyncio.Future[Any], Outcome]] = {}
        self.started_at: float | None = None
        self.broken: str | None = None
        self._by_future: dict[asyncio.Future[Any], Any] = {}
        self._on_done: Callable[[asyncio.Future[Any]], None] | None = None

    def arrive(self, rank: int, member: Any, fut: asyncio.Future[Any], outcome: Outcome) -> None:
        if self.broken is not None:
            member.cluster.timers.call_at(self.loop.time() + self.detect_s, fail, fut, self._peer_lost(member, self.broken))
            return
        self.arrivals[rank] = (member, fut, outcome)
        self._by_future[fut] = member
        member.collectives.append(self)
        member.changes.count += 1  # busy now (and an answer that was busy is not kept as steady)
        # one bound method for every arrival, in the shared context, not a closure each in a
        # copied one: thousands of arrivals live as long as the transfer, promoted and walked by
        # the collector
        if self._on_done is None:
            self._on_done = self._ended
        fut.add_done_callback(self._on_done, context=member.cluster.context)
        if len(self.arrivals) == self.expected:
            self.started_at = self.loop.time()
            member.cluster.timers.call_at(self.started_at + self.cost_s, self._finish)

    def _finish(self) -> None:
        if self.broken is not None:
            return
        if self.on_finish is not None:
            self.on_finish()
        for member, fut, outcome in list(self.arrivals.values()):
            forget(member.collectives, self)
            member.answer_later(fut, outcome)
        # Answered: what the arrivals held is the answers' now (a finished rendezvous stays in
        # its store until the next version fences it; 10,000 arrivals kept alive that long were
        # walked by every collection of the collector meanwhile). Their ranks stay.
        self.arrivals = dict.fromkeys(self.arrivals)  # type: ignore[arg-type]
        self._by_future.clear()

    def _ended(self, fut: asyncio.Future[Any]) -> None:
        member = self._by_future.get(fut)
        if member is not None:  # None: finished, each member's part done by _finish
            self.leave(member, fut)

    def leave(self, member: Any, fut: asyncio.Future[Any] | None) -> None:
        # A participant's call ended: normal at the finish; before it, the collective breaks.
        forget(member.collectives, self)
        if self.broken is not None or (self.started_at is not None and self.loop.time() >= self.started_at + self.cost_s):
            return
        self.broken = f"{member.name} left {self.what}"
        when = self.loop.time() + self.detect_s
        for other, other_fut, _ in self.arrivals.values():
            if other is not member and not other_fut.done():
                other.cluster.timers.call_at(when, fail, other_fut, self._peer_lost(other, self.broken))

    def _peer_lost(self, member: Any, why: str) -> RemoteError:
        exc = PeerLost(f"rank {member.rank}: a peer was lost during {self.what} ({why})", group="weights",
                       group_version=member.group_version, rank=member.rank, op=self.what)
        return RemoteError(exc, str(exc))

    def progressing(self, now: float) -> bool:
        return self.started_at is not None and now >= self.started_at


class SimulatedStore:
    """The rendezvous store of a simulated cluster: who registered for which group version,
    and which versions are fenced (superseded: their waiters get ``StaleGroupVersion``)."""

    def __init__(self, cluster: Any, host: str, port: int) -> None:
        from ftstate.transport.store import StoreAddress

        self.cluster = cluster
        self.address = StoreAddress(host, port)
        self._current: dict[str, int] = {}
        self._versions: dict[tuple[str, int], Collective] = {}
        #: The members waiting in each rendezvous, each with its own bound (its arrival plus its
        #: ``timeout_s``): (when, timeout_s, name, future).
        self._waiting: dict[tuple[str, int], list[tuple[float, float, str, asyncio.Future[Any]]]] = {}

    def register(self, group: str, version: int, rank: int, world_size: int, member: Any,
                 fut: asyncio.Future[Any], timeout_s: float) -> None:
        loop = self.cluster.loop
        current = self._current.get(group, 0)
        if current > version:
            exc = StaleGroupVersion(group, got=version, current=current, peer=member.name)
            loop.call_at(loop.time() + self.cluster.costs.call_s, fail, fut, RemoteError(exc, str(exc)))
            return
        key = (group, version)
        rendezvous = self._versions.get(key)
        if rendezvous is None:
            rendezvous = self._versions[key] = Collective(
                loop, f"the rendezvous of {group} v{version}", world_size, self.cluster.costs.group_form_s, 0.0,
                on_finish=functools.partial(self._waiting.pop, key, None))
        rendezvous.arrive(rank, member, fut, (type(member).joined, member, version, rank, world_size))
        forget(member.collectives, rendezvous)  # waiting in a rendezvous is not being busy in a transfer
        # Each member's bound, kept with the rendezvous until it forms (then dropped whole) and
        # watched by one timer at the earliest: every member of a reform joins (10,000 at once),
        # and a timer each held its call for the whole bound, formed or not.
        when = loop.time() + timeout_s
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = []
            self.cluster.timers.call_at(when, self._expire, key)
        waiting.append((when, timeout_s, member.name, fut))

    def _expire(self, key: tuple[str, int]) -> None:
        """The earliest bound of ``key``'s waiting members came: those whose bound passed fail
        with :class:`RendezvousTimeout`; the timer is set again for the next."""
        waiting = self._waiting.get(key)
        if not waiting:
            return
        now, group, version = self.cluster.loop.time(), key[0], key[1]
        left = []
        for entry in waiting:
            when, timeout_s, name, fut = entry
            if fut.done():
                continue
            if when > now:
                left.append(entry)
                continue
            exc = RendezvousTimeout(f"rendezvous of group {group!r} version {version}", key="init_timeout_s",
                                    seconds=timeout_s, member=name, group_version=version)
            fut.set_exception(RemoteError(exc, str(exc)))
        if left:
            self._waiting[key] = left
            self.cluster.timers.call_at(min(entry[0] for entry in left), self._expire, key)
        else:
            self._waiting.pop(key, None)

    def arrived(self, group: str, version: int) -> list[int]:
        rendezvous = self._versions.get((group, version))
        return sorted(rendezvous.arrivals) if rendezvous is not None else []

    def fence(self, group: str, version: int) -> int:
        current = max(self._current.get(group, 0), version)
        self._current[group] = current
        loop = self.cluster.loop
        for (g, v), rendezvous in list(self._versions.items()):
            if g != group or v >= current:
                continue
            del self._versions[(g, v)]
            self._waiting.pop((g, v), None)  # their calls fail now, or were answered
            if rendezvous.started_at is not None:
                continue
            rendezvous.broken = f"version {v} fenced"
            for member, fut, _ in rendezvous.arrivals.values():
                exc = StaleGroupVersion(group, got=v, current=current, peer=member.name)
                loop.call_at(loop.time(), fail, fut, RemoteError(exc, str(exc)))
        return current

    def close(self) -> None:
        self._versions.clear()
        self._waiting.clear()


__all__ = ["Collective", "Outcome", "SimulatedStore", "answered", "fail", "forget", "settle", "time_out"]
