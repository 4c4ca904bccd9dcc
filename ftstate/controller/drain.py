"""The proactive drain, in the controller: a node that announced maintenance or preemption is emptied before
it goes. Members keep serving as DRAINING while replacements elsewhere are resynced and admitted; a drain
spends no failover budget, and one that cannot finish is undone (docs/operations.md, "Maintenance and
preemption notices")."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from ftstate.controller.failover import Failover
from ftstate.controller.membership import Member
from ftstate.controller.parts import ControllerParts, Part
from ftstate.core.errors import FTError


@dataclasses.dataclass(frozen=True)
class DrainRecord:
    """One drain: ``node`` (Ray's id), the notice's ``source``/``kind``/``reason``, ``outcome`` (``drained``,
    ``failed``, ``cancelled``), ``moved`` (member → replacement) and ``seconds``."""

    node: str
    source: str
    kind: str
    reason: str
    outcome: str
    moved: dict[str, str]
    seconds: float
    group_version: int


class _Withdrawn(Exception):  # control flow inside this module, never raised out of it
    """The notice was withdrawn while its drain ran."""


class Drainer(Part):
    """Drains nodes for one runtime. ``pause_trainer``: holds new trainer calls and waits for those in flight
    (a trainer moved ahead of time must replay every call the old one took)."""

    def __init__(self, parts: ControllerParts, *, failover: Failover, pause_trainer: Callable[[], Any]) -> None:
        super().__init__(parts)
        self.failover = failover
        self.pause_trainer = pause_trainer
        self.records: list[DrainRecord] = []
        #: Nodes whose notice was withdrawn while their drain ran.
        self._withdrawn: set[str] = set()

    def withdraw(self, node: str) -> None:
        """The notice for ``node`` went away: a drain of it still running is undone."""
        self._withdrawn.add(node)

    async def drain(self, node: str, *, source: str, kind: str, reason: str,
                    deadline: float | None = None) -> DrainRecord:
        """Drain ``node``; the caller holds the membership lock. ``deadline``: epoch seconds by which the node
        goes (None: DRAINING's ``failover_timeout_s`` bounds it)."""
        t0 = asyncio.get_running_loop().time()  # the loop's clock: virtual in a simulation
        self._withdrawn.discard(node)
        group = self.membership.group
        members = [m for m in self.membership.group_members() if m.node_id == node and m.machine.state == "READY"]
        spares = [m for m in self.membership.on_node(node) if m.rank < 0]
        self.audit.record("drain_started", node=node, source=source, kind=kind, reason=reason, deadline=deadline,
                          members=[m.name for m in members], spares=[m.name for m in spares],
                          group_version=group.group_version, weights_version=group.weights_version)
        self.failover.draining_nodes.add(node)
        left = None if deadline is None else deadline - time.time()
        if left is not None and left <= 0:
            return self._done(node, source, kind, f"{reason}; deadline already passed", "failed", {}, t0)
        for spare in spares:  # a spare on a node about to go is no spare: start it elsewhere
            if spare.machine.can("retire"):
                await spare.machine.fire("retire", reason=f"its node is being drained ({kind})")
            self.launcher.kill(spare)
            self.launcher.give_back(spare)
        if spares and self.config.fault_tolerance.mode == "standby":
            for role in sorted({s.role for s in spares}):
                self.failover.spares.replenish(role)
        if not members:
            return self._done(node, source, kind, reason, "drained", {}, t0)
        for m in members:
            await m.machine.fire("drain", reason=f"{source} {kind} notice: {reason}")
        moved: dict[str, Member] = {}
        try:
            async with asyncio.timeout(left):
                if any(m.role == "trainer" for m in members):
                    async with self.pause_trainer():
                        await self._move(members, moved, node)
                else:
                    await self._move(members, moved, node)
        except (FTError, TimeoutError, _Withdrawn) as exc:
            outcome = "cancelled" if isinstance(exc, _Withdrawn) else "failed"
            why = "notice withdrawn" if outcome == "cancelled" else (
                f"deadline {deadline} reached" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}")
            await self._undo(members, moved, why)
            return self._done(node, source, kind, f"{reason}; {why}", outcome, {}, t0)
        return self._done(node, source, kind, reason, "drained", {m.name: r.name for m, r in
                                                                   zip(members, moved.values(), strict=True)}, t0)

    async def _move(self, members: Sequence[Member], moved: dict[str, Member], node: str) -> None:
        """Bring up a replacement per draining member, resync it, admit it, retire the member."""
        ranks = [m for m in members if m.role == "trainer" and self.config.trainer_workers > 1]
        if ranks:
            await self._move_ranks(ranks, moved, node)
            members = [m for m in members if m not in ranks]
            if not members:
                return
        for m in members:
            self._check(node)
            replacement = await self.failover.replacement_for(m)
            # A rank past every member's while both serve; it takes m's rank once m is retired.
            replacement.set_rank(1 + max(x.rank for x in self.membership.group_members()))
            moved[m.name] = replacement
        await self.formation.reform()
        for m in sorted(members, key=lambda m: m.role != "trainer"):  # the trainer first
            self._check(node)
            await self.failover.resyncer.resync(moved[m.name])
        self._check(node)
        for m in members:
            replacement = moved[m.name]
            rank = m.rank
            await m.machine.fire("retire", reason=f"drained: {replacement.name} serves in its place")
            self.launcher.kill(m)
            self.launcher.give_back(m)
            replacement.set_rank(rank)
        await self.formation.reform()
        if self.config.fault_tolerance.enable and self.config.fault_tolerance.mode == "standby":
            for role in sorted({m.role for m in members}):
                self.failover.spares.replenish(role)

    async def _move_ranks(self, ranks: Sequence[Member], moved: dict[str, Member], node: str) -> None:
        """Several trainer ranks: a rank cannot serve beside its replacement, so it retires first (calls
        paused) and its replacement recovers its part as after a loss, spending nothing; if that fails, the
        rank goes to the failover as a loss."""
        for m in ranks:
            self._check(node)
            moved[m.name] = await self.failover.replacement_for(m)
        self._check(node)
        for m in ranks:
            replacement = moved.pop(m.name)  # from here on it is no drain to undo, but the rank itself
            await m.machine.fire("retire", reason=f"drained: {replacement.name} takes trainer rank {m.rank}")
            self.launcher.kill(m)
            self.launcher.give_back(m)
            replacement.set_rank(m.rank)
            moved[m.name] = replacement
        newcomers = [moved[m.name] for m in ranks]
        try:
            await self.formation.reform()
            await self.failover.resyncer.recover_ranks(newcomers)
        except FTError:
            loop = asyncio.get_running_loop()
            for r in newcomers:
                if r.machine.can("died"):
                    await r.machine.fire("died", reason="its trainer rank could not be recovered during a drain")
                else:
                    self.failover.note_loss(r, loop.time())
            raise
        if self.config.fault_tolerance.enable and self.config.fault_tolerance.mode == "standby":
            self.failover.spares.replenish("trainer")

    def _check(self, node: str) -> None:
        if node in self._withdrawn:
            raise _Withdrawn(f"the notice for node {node[:12]} was withdrawn")

    async def _undo(self, members: Sequence[Member], moved: dict[str, Member], why: str) -> None:
        """The drain did not finish: its newcomers go, the members serve on where they are."""
        for replacement in moved.values():
            if replacement.machine.can("retire"):
                await replacement.machine.fire("retire", reason=f"drain undone: {why}")
            self.launcher.kill(replacement)
            self.launcher.give_back(replacement)
        for m in members:
            if m.machine.state == "DRAINING":
                await m.machine.fire("drain_cancelled", reason=why)
        if moved:
            try:
                await self.formation.reform()
            except FTError as exc:  # a death meanwhile: the failover's to handle
                self.audit.record("drain_reform_failed", reason=f"{type(exc).__name__}: {exc}")

    def _done(self, node: str, source: str, kind: str, reason: str, outcome: str, moved: dict[str, str],
              t0: float) -> DrainRecord:
        self.failover.draining_nodes.discard(node)
        if outcome == "drained":
            # Nothing of the run is left there; keep replacements off it until it is gone.
            self.failover.lost_nodes.add(node)
        group = self.membership.group
        record = DrainRecord(node=node, source=source, kind=kind, reason=reason, outcome=outcome, moved=moved,
                             seconds=asyncio.get_running_loop().time() - t0, group_version=group.group_version)
        self.records.append(record)
        self.audit.record(f"drain_{outcome}", node=node, source=source, kind=kind, reason=reason, moved=moved,
                          seconds=round(record.seconds, 6), drains=len(self.records),
                          group_version=group.group_version, weights_version=group.weights_version)
        return record
