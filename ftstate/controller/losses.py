"""Losses: what happens when a member is lost, and the recovery that follows.

A worker's machine reaching LOST is noted here: with fault tolerance off the run fails at once
with a :class:`~ftstate.core.errors.MemberLost` naming it; with it on, the loss is handed to the
failover (:mod:`ftstate.controller.failover`) and recovered in the background, or by the next
call that needs the group whole (a sync, a routed call, a change of the fleet). A spare lost is
retired and another started; a member being added or removed on purpose is the scaler's. The
error that ends the run (:attr:`Losses.failure`, the first cause) is kept here and raised to
every later call; nodes the failover budget quarantined are drained after each recovery.

Runs in the driver process, on the controller's event loop; the
:class:`~ftstate.controller.runtime.Runtime` builds it with its other parts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection
from typing import Any

from ftstate.controller.drain import Drainer
from ftstate.controller.failover import Failover
from ftstate.controller.membership import Member
from ftstate.controller.notices import NoticeMonitor
from ftstate.controller.parts import ControllerParts, Part
from ftstate.controller.progress import Progress
from ftstate.core.errors import FTError, InvalidTransition, MemberLost
from ftstate.core.machine import StateMachine


class Losses(Part):
    """The loss handling of one runtime. lock: the runtime's membership lock (a recovery holds
    it); spawn: runs a coroutine as one of the runtime's tasks; closed: whether the runtime is
    closing; changing: the members the scaler is adding or removing; notices: the maintenance
    notice monitor, once started (None: none)."""

    def __init__(
        self,
        parts: ControllerParts,
        *,
        progress: Progress,
        failover: Failover,
        drainer: Drainer,
        lock: asyncio.Lock,
        spawn: Callable[[Any], None],
        closed: Callable[[], bool],
        changing: Callable[[], Collection[str]],
        notices: Callable[[], NoticeMonitor | None],
    ) -> None:
        super().__init__(parts)
        self.progress = progress
        self.failover = failover
        self.drainer = drainer
        self.lock = lock
        self.spawn = spawn
        self.closed = closed
        self.changing = changing
        self.notices = notices
        #: The error that ended the run (None while it goes on).
        self.failure: FTError | None = None

    async def recover(self) -> None:
        async with self.lock:
            await self.recover_locked()

    async def recover_locked(self) -> None:
        """Run pending failovers (the caller holds the membership lock)."""
        self.raise_if_failed()  # a failed run has nothing left to recover into
        failover = self.failover
        if failover.pending:
            before = len(failover.records)
            try:
                await failover.recover()
            except FTError as exc:
                cause = self.failure or exc
                self.failure = cause
                # Fail the group now, with the error that ended the failover: waiting for
                # PROMOTING's deadline would only hide the cause behind a FailoverTimeout.
                group = self.membership.group
                if not group.terminal:
                    with contextlib.suppress(InvalidTransition):  # failed meanwhile by its own path
                        await group.fire("fail", reason=f"failover failed: {exc}", error=exc)
                if isinstance(exc, InvalidTransition) and cause is not exc:
                    raise cause from exc  # two paths raced to move one machine: the cause, not the race
                raise
            for f in failover.records[before:]:
                self.progress.report("failover", f"{f.lost} lost ({f.reason}); {f.replacement} serves weights "
                                     f"version {self.membership.weights_version} after {f.total_s:.3f}s",
                                     lost=f.lost, replacement=f.replacement, seconds=round(f.total_s, 6))
            notices = self.notices()
            if notices is not None:  # replacements may have landed on nodes not watched yet
                self.spawn(notices.watch_nodes())
            await self._drain_quarantined()
        self.raise_if_failed()

    async def _drain_quarantined(self) -> None:
        """Move the members still on nodes the failover budget quarantined off them (a drain:
        replacements elsewhere first; none to be had and the drain is undone, the members stay)."""
        while self.failover.to_drain:
            node = self.failover.to_drain.pop(0)
            if any(not m.gone for m in self.membership.on_node(node)):
                with contextlib.suppress(FTError):  # recorded by the drain; the run goes on
                    await self.drainer.drain(node, source="failover budget", kind="quarantine",
                                              reason="node quarantined (max_node_failures)", deadline=None)

    async def recover_in_background(self) -> None:
        with contextlib.suppress(FTError):  # recorded in self.failure; callers see it
            await self.recover()

    def worker_transition(self, machine: StateMachine, src: str, dest: str, trigger: str) -> None:
        if dest == "LOST":
            ms, launcher, failover = self.membership, self.launcher, self.failover
            m = ms.get(machine.member)
            ms.changed()
            if m.name in self.changing():
                # Being added or removed on purpose: the scaler retires it (or starts another);
                # neither a failover nor, with fault tolerance off, a failed run.
                launcher.kill(m)
                return
            if self.config.fault_tolerance.enable:
                # Noted now, not in the task: a sync that fails because of this loss must find it.
                failover.note_loss(m, asyncio.get_running_loop().time(), trigger)
            self.spawn(self._member_lost(m, machine.error))
        elif dest == "FAILED" and trigger == "start_timeout" and not self.closed():
            ms, launcher, failover = self.membership, self.launcher, self.failover
            m = ms.get(machine.member)
            if m.rank < 0:
                # A spare that never started within init_timeout_s (its node went, or it hangs
                # in its constructor): its actor and slot go, and another is started in its
                # place, as for a spare that died (bounded by spare_start_attempts).
                launcher.kill(m)
                launcher.give_back(m)
                failover.spares.spare_lost(m)

    def group_transition(self, machine: StateMachine, src: str, dest: str, trigger: str) -> None:
        if dest == "FAILED" and self.failure is None and machine.error is not None:
            self.failure = machine.error

    async def _member_lost(self, m: Member, error: FTError | None) -> None:
        launcher, failover = self.launcher, self.failover
        launcher.kill(m)
        lost = error if isinstance(error, MemberLost) else MemberLost(
            m.name, str(error) if error else "declared lost", group_version=m.machine.group_version)
        if not self.config.fault_tolerance.enable:
            self.failure = self.failure or lost
            group = self.membership.group
            if not group.terminal:
                await group.fire("fail", reason=str(lost), error=lost)
            return
        if m.rank < 0:  # a spare died: retire it and start another
            if m.machine.can("retire"):
                await m.machine.fire("retire", reason="spare lost")
            launcher.give_back(m)
            if not self.closed():
                failover.spares.spare_lost(m)
            return
        await self.recover_in_background()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure
        group = self.membership.group
        if group.terminal:
            raise group.error or FTError(f"the run's group is {group.state}")
