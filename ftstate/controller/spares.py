"""The standby pool: prewarmed spares of each role, kept warm for the failover to promote.

In standby mode (``fault_tolerance.mode: standby``) each role keeps its count of spares
(:meth:`~ftstate.core.config.RuntimeConfig.spares`) started and warm: process up, user class and
transport loaded, and, once a version was committed, a staging buffer of its size reserved. A
spare that dies is started again, unless its role's spares keep dying before getting warm
(``spare_start_attempts``); spares keep off the nodes of the members they cover and never go to
a quarantined node. The failover (:mod:`ftstate.controller.failover`) and an addition of
rollouts (:mod:`ftstate.controller.scaling`) take them from here (:meth:`Spares.promote`).

Runs in the driver process, on the controller's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ftstate.controller.membership import Member
from ftstate.controller.parts import ControllerParts, Part
from ftstate.core.errors import FTError, WorkerInitError
from ftstate.core.protocol import Prewarm, ReserveStaging


class Spares(Part):
    """The spares of one runtime. The failover's node accounting is passed in: avoided_nodes
    (nodes nothing new goes to), quarantined_nodes (nodes no spare ever goes to) and strike (a
    spare that died blames its node: :meth:`ftstate.controller.failover.Failover.strike`)."""

    def __init__(self, parts: ControllerParts, *, avoided_nodes: Callable[[], set[str]],
                 quarantined_nodes: Callable[[], set[str]], strike: Callable[[Member, str], None]) -> None:
        super().__init__(parts)
        self.avoided_nodes = avoided_nodes
        self.quarantined_nodes = quarantined_nodes
        self.strike = strike
        self._seq = 0
        self._warming: set[asyncio.Task[Any]] = set()
        # spares of each role that died before ever getting warm, in a row
        self._cold_starts: dict[str, int] = {"trainer": 0, "rollout": 0}
        # when each spare was started; how long each one that got warm took, by name
        self._started_at: dict[str, float] = {}
        self._warm_seconds: dict[str, float] = {}
        #: The committed weights' size: what a spare's staging buffer is reserved for (0: none yet).
        self.staging_bytes = 0

    def next_seq(self) -> int:
        """A number for the name of the next actor started as a spare or a fresh replacement."""
        self._seq += 1
        return self._seq - 1

    def node_quarantined(self) -> None:
        """A node was quarantined: the spares that died there died of the node, not of their
        class, so every role may start spares again."""
        self._cold_starts = dict.fromkeys(self._cold_starts, 0)

    def start_spares(self) -> None:
        """Start the prewarmed spares of each role (standby mode only; ``RuntimeConfig.spares``)."""
        if not (self.ft.enable and self.ft.mode == "standby"):
            return
        for role in ("trainer", "rollout"):
            self.replenish(role)

    def replenish(self, role: str) -> None:
        """Start spares of ``role`` until its count (``RuntimeConfig.spares``) are warm or
        warming (after one was used or lost; never more, so the standby pool's slots suffice)."""
        have = len(self.membership.spares(role, "INIT", "STANDBY"))
        for _ in range(self.spare_target(role) - have):
            self.start_spare(role)

    def spare_target(self, role: str) -> int:
        """How many spares of ``role`` the pool keeps now: rollout spares follow the fleet's
        size (``rt.add_rollouts``; :meth:`RuntimeConfig.spares`)."""
        live = len(self.membership.live("rollout")) if role == "rollout" else None
        return self.config.spares(role, live)

    def spare_lost(self, m: Member) -> None:
        """A spare died: start another, unless the last ``spare_start_attempts`` spares
        of its role all died before getting warm. Then its constructor (or its node) is
        failing, and starting more would only churn actors forever: the role goes without
        a spare (``spare_unavailable`` in the trail) and a later failover starts a fresh
        actor, or shrinks the group, as with none left."""
        role = m.role
        self.strike(m, str(m.machine.error) if m.machine.error else "spare died")
        if m.name not in self._warm_seconds and m.node_id not in self.quarantined_nodes():
            self._cold_starts[role] += 1
            if self._cold_starts[role] >= self.ft.spare_start_attempts:
                self.audit.record("spare_unavailable", role=role, attempts=self._cold_starts[role],
                                     reason=str(m.machine.error) if m.machine.error else "died while warming")
                return
        self.replenish(role)

    def start_spare(self, role: str) -> None:
        name = f"spare-{role}-{self.next_seq()}"
        pool = self.ft.standby_resource_pool
        if not self.launcher.has_free_slot(pool):
            pool = role
        # Off the nodes of the members it covers (and of nodes lost), where the pool has room.
        covered = ({self.launcher.node_of(m) for m in self.membership.live(role)} | self.avoided_nodes()) - {None}
        colocated = False
        never = self.quarantined_nodes()
        if never and not self.launcher.placeable(pool, covered):
            # Sharing a node with the members it covers, where no other node can hold it: never a
            # quarantined one, where it would die at once and be started again forever.
            if not self.launcher.placeable(pool, never):
                self.audit.record("spare_unavailable", role=role, attempts=0,
                                  reason="every node that could hold a spare is quarantined")
                return
            covered, colocated = never, True
        m = self.launcher.start(role, -1, name, pool=pool, avoid_nodes=covered)
        if colocated or m.slot in getattr(self.launcher.pools[pool], "colocated", ()):
            self.audit.record("spare_colocated", member=name, role=role,
                              reason="no other node can hold it: it shares a node with the members it covers")
        self._started_at[name] = asyncio.get_running_loop().time()
        task = asyncio.get_running_loop().create_task(self._warm(m))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm(self, m: Member) -> None:
        try:
            info = await self.calls.call(m.name, m.handle, Prewarm())
            if self.staging_bytes and not self._adopts(m.role, info.node_id):
                # part of warming: a STANDBY spare is ready to receive at full speed
                await self._reserve(m, self.staging_bytes)
        except WorkerInitError as exc:
            await constructor_failed(m, exc)  # as if it died warming: LOST, then spare_lost
            return
        except FTError:
            return  # died while warming: its machine is LOST already
        self.membership.located(m, info)
        if m.machine.can("warm"):
            await m.machine.fire("warm")
            self._cold_starts[m.role] = 0
            self._warm_seconds[m.name] = asyncio.get_running_loop().time() - self._started_at[m.name]

    async def weights_sized(self, nbytes: int) -> None:
        """A sync committed ``nbytes`` of weights: every warm spare reserves a staging buffer
        that size (:meth:`WorkerHost.reserve_staging`), so the transfer to it when promoted
        writes into memory already resident; one that dies meanwhile is the watchdog's."""
        if nbytes <= self.staging_bytes:
            return
        self.staging_bytes = nbytes
        spares = [m for role in ("trainer", "rollout") for m in self.membership.spares(role, "STANDBY")
                  if not self._adopts(role, m.node_id)]
        await asyncio.gather(*(self._reserve(m, nbytes) for m in spares), return_exceptions=True)

    async def _reserve(self, m: Member, nbytes: int) -> None:
        """Have spare ``m`` reserve a staging buffer of ``nbytes`` and record that it has one."""
        await self.calls.call(m.name, m.handle, ReserveStaging(nbytes))
        m.reserved_bytes = max(m.reserved_bytes, nbytes)

    def _adopts(self, role: str, node_id: str | None) -> bool:
        """Whether a rollout spare on ``node_id`` would be resynced from its node's copy
        (``staging: node``), so it needs no staging buffer of its own."""
        return role == "rollout" and self.node_copies is not None and node_id in self.node_copies.committed

    def spare_for(self, role: str, avoid: set[str] | frozenset[str] = frozenset()) -> Member | None:
        spares = [m for m in self.membership.spares(role, "STANDBY") if m.node_id not in avoid]
        # one whose staging is ready for the current size first: a spare still reserving it
        # would stage into fresh memory (or wait for its reserve): a slow failover's tail
        ready = [m for m in spares if m.reserved_bytes >= self.staging_bytes or self._adopts(role, m.node_id)]
        return (ready or spares or [None])[0]

    async def take(self, role: str, avoid: set[str]) -> Member | None:
        """A warm spare of ``role`` off the ``avoid`` nodes, else one still warming there waited
        for (:meth:`_await_warming`); None when there is none to be had."""
        spare = self.spare_for(role, avoid)
        if spare is None:
            warming = [m for m in self.membership.spares(role, "INIT") if m.node_id not in avoid]
            if warming:
                spare = await self._await_warming(warming[0])
        return spare

    async def promote(self, spare: Member, *, promoted: str, joins: str, rank: int | None = None) -> None:
        """Make warm ``spare`` a member: its staging becomes the transfer's (a member reserves
        none), PROMOTING (``promoted``: why), its ``rank`` when given, then RENDEZVOUS (``joins``)."""
        spare.reserved_bytes = 0
        await spare.machine.fire("promote", reason=promoted)
        if rank is not None:
            spare.set_rank(rank)
        await spare.machine.fire("join", reason=joins)

    async def _await_warming(self, spare: Member) -> Member | None:
        """Wait for a spare still warming up; None when it will not do (then a fresh actor is
        started). It died: None. It takes more than twice as long as the slowest spare that
        got warm so far (at least ``heartbeat_timeout_s``): presumed hung in its constructor
        (a bad node), killed and recorded (``spare_abandoned``), None; without that, a hung
        spare would burn the whole ``failover_timeout_s`` and fail the run. With no spare
        warm yet there is no measure of "too long": the failover's deadline bounds the wait."""
        loop = asyncio.get_running_loop()
        waited = spare.machine.wait_for("STANDBY")
        try:
            if not self._warm_seconds:
                await waited
                return spare
            bound = max(self.config.heartbeat_timeout_s, 2 * max(self._warm_seconds.values()))
            left = self._started_at.get(spare.name, loop.time()) + bound - loop.time()
            await asyncio.wait_for(waited, max(left, 0.0))
            return spare
        except TimeoutError:
            self.audit.record("spare_abandoned", member=spare.name, role=spare.role, pid=spare.pid,
                                 warming_s=round(loop.time() - self._started_at.get(spare.name, loop.time()), 3),
                                 bound_s=round(bound, 3))
            self.launcher.kill(spare)  # its pending prewarm call then reports the death (LOST, retired)
            return None
        except FTError:
            return None  # it died warming up

    async def close(self) -> None:
        for task in list(self._warming):
            task.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)


async def constructor_failed(m: Member, exc: WorkerInitError) -> None:
    """A started actor whose user class raised in its constructor: its process lives on (the
    host keeps the error to report it) but it will never serve, so it is LOST with that
    error as its reason, exactly as if the constructor had killed it (the runtime then
    kills the process and the rest follows from LOST)."""
    if m.machine.can("died"):
        await m.machine.fire("died", reason=str(exc), error=exc)
