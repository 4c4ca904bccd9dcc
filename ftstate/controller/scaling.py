"""Scaling: rollouts added to a running fleet and taken out of it, without a stop.

Rollout fleets are elastic (generation demand changes within a run, capacity appears and
leaves), so the fleet fixed at ``start()`` can grow and shrink while the run goes, at no cost
to the failover budget: neither an addition nor a removal is a failure.

**Adding** (:meth:`Scaler.add`, ``rt.add_rollouts(n)``) starts n rollouts in a pool of their
own, placed slot by slot by the rollout role's placement (its labels and resources, off the
nodes the failover avoids; :meth:`~ftstate.controller.launcher.ActorLauncher.add_pool`), waits
for each to construct (its INIT deadline, ``init_timeout_s``), forms the next group version
with them, and feeds each the current committed version by the newcomer path a failover's
replacement takes (:meth:`~ftstate.controller.resync.Resync.resync`): the node copy on
its node, or point to point from a rollout that holds it, never from the trainer while a
rollout holds it, and proven by the newcomer's own checksum before it is admitted to serving.
Newcomers are fed in waves (:meth:`Scaler._feed`): every holder feeds one at a time, and a
newcomer fed holds the version for the next wave, so a large addition takes about log2 waves.
With no version committed yet, or none held by any rollout, a newcomer waits STALE and the
next sync brings it up to date: it never serves without the current weights.

**Removing** (:meth:`Scaler.remove`, ``rt.remove_rollouts(names)``) takes the rollouts out of
serving first (STALE: routing deals them nothing new), lets the calls they run end (at most
``remove_calls_timeout_s``; a call still running then ends with ``MemberLost``, and with
fault tolerance on its items are dealt again over the serving rollouts), retires them out of
the group (the next group version is formed without them), and only then stops their
processes. It refuses, before changing anything, to leave fewer than
``fault_tolerance.min_rollout_workers`` rollouts (:class:`~ftstate.core.errors.ScaleRefused`).

Both run under the runtime's sync lock: a sync called meanwhile waits for the change and then
reaches every rollout the fleet has (a sync never meets a half-added member). A member lost
while the change runs is handled where it belongs: a newcomer lost while brought up is
retired and another started in its place (at most ``fault_tolerance.spare_start_attempts``
starts a slot), a rollout being removed that dies is simply removed; neither spends budget.
Any other member lost meanwhile (a newcomer's source, say) is an ordinary failover, run at
once, after which the newcomers are fed from whoever holds the version then.

The standby pool follows the fleet (:meth:`~ftstate.core.config.RuntimeConfig.spares`): after
each change spares are started, or warm ones retired, to keep ``standby_workers`` per
``rollout_workers`` rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ftstate.controller.failover import Failover
from ftstate.controller.membership import Member
from ftstate.controller.parts import ControllerParts, Part
from ftstate.controller.routing import Router
from ftstate.core.errors import (
    FTError,
    InvalidTransition,
    MemberLost,
    ScaleRefused,
    TransportError,
    WorkerInitError,
)
from ftstate.core.protocol import Prewarm


@dataclasses.dataclass(frozen=True)
class ScaleRecord:
    """One change of the fleet. kind: ``add`` or ``remove``; members: who was added (in the
    order started) or removed; seconds: from the call to the last newcomer serving (or the last
    process stopped); sources: each newcomer's source (a rollout's name, ``node copy…``, or
    None: it waits STALE for the next sync); trainer_sources: newcomers fed by the trainer (0
    while a rollout holds the version); restarted: newcomers lost while brought up and started
    again; promoted: newcomers that were warm spares (no process started for them); calls_cut:
    removed rollouts whose calls were still running at the bound; group_version /
    weights_version: after the change."""

    kind: str
    members: tuple[str, ...]
    seconds: float
    group_version: int
    weights_version: int
    sources: dict[str, str | None] = dataclasses.field(default_factory=dict)
    trainer_sources: int = 0
    restarted: tuple[str, ...] = ()
    calls_cut: tuple[str, ...] = ()
    promoted: tuple[str, ...] = ()
    stages: dict[str, Any] = dataclasses.field(default_factory=dict)


class _NewcomerLost(Exception):  # control flow inside this module, never raised out of it
    """A newcomer was lost while it was brought up: another is started in its place."""

    def __init__(self, member: Member, why: str) -> None:
        super().__init__(why)
        self.member = member


class Scaler(Part):
    """Grows and shrinks the rollout fleet of one runtime; the caller holds the sync lock.
    recover_locked: runs pending failovers (a member other than a newcomer lost meanwhile)."""

    def __init__(self, parts: ControllerParts, *, failover: Failover, router: Router,
                 recover_locked: Callable[[], Awaitable[None]]) -> None:
        super().__init__(parts)
        self.failover = failover
        self.router = router
        self.recover_locked = recover_locked
        self.records: list[ScaleRecord] = []
        #: Members being added or removed now: their loss is this module's, never a failover's.
        self.changing: set[str] = set()
        self._pools = 0
        self._seq = 0
        self._stages: dict[str, dict[str, Any]] = {}  # newcomer -> its transfer's stage timings
        self._placing: tuple[set[str], int] | None = None  # this addition's nodes to avoid, last rank given
        self._only: set[str] | None = None  # this addition's nodes asked for (None: any)

    # -- adding ----------------------------------------------------------------------------

    async def add(self, n: int, nodes: Sequence[str] | None = None) -> list[str]:
        """Start ``n`` rollouts, feed each the current version from a holder and admit it; their
        names. ``nodes``: Ray node ids the newcomers must go to (a node that just joined, say),
        else where the placement finds room. See the module docstring."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScaleRefused(field="n", expected="a positive int (rollouts to add)", got=repr(n))
        self._only = None if nodes is None else self._named_nodes(nodes)
        ms = self.membership
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pool = f"rollout+{self._pools}"
        self._pools += 1
        self.launcher.add_pool(pool, "rollout", n)  # refuses at once what no node could hold
        live = len(ms.live("rollout"))
        # the standby pool's room for the newcomers' replacements and the spares that follow them
        self.launcher.grow_pool(self.config.fault_tolerance.standby_resource_pool,
                                n + self.config.spares("rollout", live + n) - self.config.spares("rollout", live))
        self.audit.record("scale_add_started", n=n, pool=pool, group_version=ms.group_version,
                          weights_version=ms.weights_version)
        started: list[Member] = []
        newcomers: list[Member] = []
        self._placing = None
        restarted: list[str] = []
        promoted: list[Member] = []
        try:
            if nodes is None:
                promoted = await self._promote_spares(n, started)
            outcomes = await asyncio.gather(*(self._start(pool, started, restarted) for _ in range(n - len(promoted))),
                                            return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
            newcomers = [*promoted, *(o for o in outcomes if isinstance(o, Member))]
            sources = await self._bring_up(newcomers, pool, started, restarted)
        except BaseException as exc:
            await self._undo(started, f"{type(exc).__name__}: {exc}")
            self.audit.record("scale_add_failed", n=n, reason=f"{type(exc).__name__}: {exc}"[:500],
                              group_version=ms.group_version, weights_version=ms.weights_version)
            raise
        finally:
            self.changing.difference_update(m.name for m in started)
            for m in started:
                if m not in newcomers:
                    self._stages.pop(m.name, None)
        names = [m.name for m in newcomers]
        stages = {name: self._stages.pop(name) for name in names if name in self._stages}
        trainer = {m.name for m in ms.role("trainer")}
        record = ScaleRecord(kind="add", members=tuple(names), seconds=loop.time() - t0,
                             group_version=ms.group_version, weights_version=ms.weights_version,
                             sources=sources, trainer_sources=sum(1 for s in sources.values() if s in trainer),
                             restarted=tuple(restarted), stages=stages,
                             promoted=tuple(m.name for m in promoted if m in newcomers))
        self.records.append(record)
        self.audit.record("rollouts_added", members=names, sources=sources, trainer_sources=record.trainer_sources,
                          restarted=list(restarted), promoted=list(record.promoted), seconds=round(record.seconds, 6),
                          group_version=ms.group_version, weights_version=ms.weights_version)
        await self._fit_spares()
        return names

    async def _start(self, pool: str, started: list[Member], restarted: list[str]) -> Member:
        """Start one newcomer and wait for it to construct (its INIT deadline); one that dies
        meanwhile is started again, at most ``spare_start_attempts`` times."""
        attempts = self.config.fault_tolerance.spare_start_attempts
        for attempt in range(1, attempts + 1):
            m = self._launch(pool)
            started.append(m)
            try:
                return await self._constructed(m)
            except _NewcomerLost as lost:
                await self._drop(lost.member, str(lost))
                restarted.append(lost.member.name)
                if attempt == attempts:
                    raise MemberLost(lost.member.name, f"{lost}; {attempts} newcomers in a row were lost while "
                                     "starting (fault_tolerance.spare_start_attempts)",
                                     group_version=self.membership.group_version) from None
        raise AssertionError("unreachable")

    async def _promote_spares(self, n: int, started: list[Member]) -> list[Member]:
        """Up to ``n`` warm spares (standby mode) made newcomers: no process to start, so they
        pay only their transfer, as a failover's replacement does; the standby pool is refilled
        after the addition (:meth:`_fit_spares`)."""
        ft = self.config.fault_tolerance
        if not (ft.enable and ft.mode == "standby"):
            return []
        promoted: list[Member] = []
        avoid = self.failover.avoided_nodes()
        while len(promoted) < n and (spare := self.failover.spares.spare_for("rollout", avoid)) is not None:
            self.changing.add(spare.name)  # its loss from now on is this addition's, not a spare's
            started.append(spare)
            await self.failover.spares.promote(spare, promoted="added to the fleet (rt.add_rollouts)",
                                               joins="added to the fleet (rt.add_rollouts), a warm spare",
                                               rank=self._next_rank())
            promoted.append(spare)
        return promoted

    def _next_rank(self) -> int:
        """A rank past every member's for this addition's next newcomer (the next reform renumbers them)."""
        if self._placing is None:
            self._plan_placing()
        avoid, rank = self._placing  # type: ignore[misc]
        self._placing = (avoid, rank + 1)
        return rank + 1

    def _launch(self, pool: str) -> Member:
        while (name := f"rollout-{self.config.rollout_workers + self._seq}") in self.membership:
            self._seq += 1
        self._seq += 1
        self.changing.add(name)
        rank = self._next_rank()
        avoid, _ = self._placing  # type: ignore[misc]
        return self.launcher.start("rollout", rank, name, pool=pool, avoid_nodes=avoid,
                                   strict=self._only is not None)

    def _plan_placing(self) -> None:
        """This addition's nodes to avoid and the last rank given, once an addition, not once a
        newcomer: O(members) each."""
        if self._only is not None:  # the nodes asked for and no other
            avoid = self.launcher.alive_nodes() - self._only
        else:  # spread like the rollout pool: off the nodes of the rollouts there are, where another fits
            spread = self.config.placement.rollout.strategy in ("SPREAD", "STRICT_SPREAD")
            avoid = self.failover.avoided_nodes() | (
                {m.node_id for m in self.membership.live("rollout") if m.node_id} if spread else set())
        self._placing = (avoid, max((m.rank for m in self.membership.group_members()), default=0))

    def _named_nodes(self, nodes: Sequence[str]) -> set[str]:
        """The node ids of ``add(n, nodes=...)``, each checked before anything changes: alive,
        not avoided by the failover (lost, unreachable, draining, quarantined), and able to hold
        a rollout (its labels and resources)."""
        if isinstance(nodes, str) or not isinstance(nodes, Sequence | set | frozenset) or not nodes \
                or not all(isinstance(x, str) for x in nodes):
            raise ScaleRefused(field="nodes", expected="a non-empty list of Ray node ids", got=repr(nodes))
        alive = self.launcher.alive_nodes()
        avoided = self.failover.avoided_nodes()
        fit = self.launcher.placeable("rollout")
        for node_id in nodes:
            problem = ("not an alive node of the cluster" if node_id not in alive
                       else "a node the failover avoids (lost, unreachable, draining or quarantined)"
                       if node_id in avoided
                       else "a node that cannot hold a rollout (its placement's labels and resources)"
                       if node_id not in fit else None)
            if problem is not None:
                raise ScaleRefused(field="nodes", expected=f"alive node ids that can hold a rollout "
                                   f"({len(alive)} alive)", got=f"{node_id!r}: {problem}")
        return set(nodes)

    async def _constructed(self, m: Member) -> Member:
        try:
            async with m.machine.deadline_scope():  # INIT: init_timeout_s
                info = await self.calls.call(m.name, m.handle, Prewarm())
        except WorkerInitError as exc:
            if m.machine.can("died"):  # its constructor raised: it never serves (the user's to fix)
                await m.machine.fire("died", reason=str(exc), error=exc)
            raise
        except MemberLost as exc:
            raise _NewcomerLost(m, exc.reason) from exc
        self.membership.located(m, info)
        await m.machine.fire("join", reason="added to the fleet (rt.add_rollouts)")
        return m

    async def _bring_up(self, newcomers: list[Member], pool: str, started: list[Member],
                        restarted: list[str]) -> dict[str, str | None]:
        """Form the next group version with the newcomers and feed each the current version
        (a newcomer lost meanwhile is replaced by another; another member lost, the failover
        runs first). Returns each newcomer's source (None: it waits for the next sync)."""
        sources: dict[str, str | None] = {}
        tries = 0
        attempts = {i: 1 for i in range(len(newcomers))}
        while True:
            try:
                await self._reform(newcomers)
                for m in newcomers:
                    # in the group now: STALE (no deadline) while the others are fed wave by wave,
                    # not RENDEZVOUS, whose init_timeout_s would run out behind a long queue
                    if m.machine.state == "RENDEZVOUS":
                        await m.machine.fire("joined")
                await self._feed([m for m in newcomers if m.name not in sources], sources)
                return sources
            except _NewcomerLost as lost:
                i = newcomers.index(lost.member)
                await self._drop(lost.member, str(lost))
                restarted.append(lost.member.name)
                sources.pop(lost.member.name, None)
                attempts[i] += 1
                if attempts[i] > self.config.fault_tolerance.spare_start_attempts:
                    raise MemberLost(lost.member.name, f"{lost}; newcomers lost while brought up "
                                     "(fault_tolerance.spare_start_attempts)",
                                     group_version=self.membership.group_version) from None
                newcomers[i] = await self._start(pool, started, restarted)
                self.audit.record("scale_restart", member=lost.member.name, replacement=newcomers[i].name,
                                  reason=str(lost)[:500])
            except (MemberLost, TransportError) as exc:
                # Not a newcomer's loss: a source died, or a transfer failed with nobody lost.
                tries += 1
                if not self.config.fault_tolerance.enable or tries > self.config.fault_tolerance.resync_retries + 1:
                    raise  # fault tolerance off: that loss fails the run (the runtime's), no retry here
                await self._settle(exc)
                self.audit.record("scale_retry", reason=f"{type(exc).__name__}: {exc}"[:500],
                                  members=[m.name for m in newcomers if m.name not in sources])

    async def _feed(self, waiting: list[Member], sources: dict[str, str | None]) -> None:
        """Feed the ``waiting`` newcomers the current version in waves, recording each one's
        source in ``sources``. In a wave every holder feeds one newcomer and no two transfers
        share a node (shared-memory slots, node copies and a node's links stay one transfer's);
        a newcomer fed holds the version for the next wave, so n newcomers take about log2(n)
        waves, not n transfers in a row. The first error of a wave is raised once all of it ended."""
        while waiting:
            wave: list[tuple[Member, Member | None]] = []
            busy: set[str | None] = set()
            free = self.membership.holders()
            for m in waiting:
                if m.node_id is not None and m.node_id in busy:
                    continue
                # a holder beside it first (shared memory), else any whose node is free
                ok = [h for h in free if h.node_id is None or h.node_id not in busy]
                src = min(ok, key=lambda h: h.node_id is None or h.node_id != m.node_id, default=None)
                if src is None and wave:
                    break  # every holder feeds one already: the next wave
                wave.append((m, src))
                busy.update({m.node_id, *((src.node_id,) if src is not None else ())} - {None})
                if src is None:
                    break  # nothing to pair it with: it alone, and the failover's resync decides
                free.remove(src)
            outcomes = await asyncio.gather(*(self._feed_one(m, src) for m, src in wave), return_exceptions=True)
            for (m, _), outcome in zip(wave, outcomes, strict=True):
                if not isinstance(outcome, BaseException):
                    sources[m.name] = outcome
            waiting = [m for m in waiting if m.name not in sources]
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]

    async def _feed_one(self, m: Member, src: Member | None) -> str | None:
        """Resync one newcomer (from ``src`` when it still holds the version); its source, or
        None when it waits STALE for the next sync."""
        if m.machine.state == "SUSPECT":  # a heartbeat missed while it waited its turn
            await self.watchdog.verdict([m])  # back to STALE, or LOST (heartbeat_timeout_s)
        try:
            fed = await self.failover.resyncer.resync(m, src)
        except MemberLost as exc:
            if exc.member == m.name or m.gone:
                raise _NewcomerLost(m, exc.reason) from exc
            raise
        source, stages, _ = self.failover.resyncer.resync_facts(m.name)
        if stages is not None:
            self._stages[m.name] = stages
        return source if fed else None

    async def _settle(self, exc: FTError) -> None:
        """A member other than a newcomer was found lost: the watchdog's verdict on one nobody
        declared LOST yet (bounded by heartbeat_timeout_s), then the failover it started."""
        hit = self.membership.find(exc.member) if isinstance(exc, MemberLost) else None
        if hit is not None and not hit.gone:
            await self.watchdog.verdict([hit])
        if self.failover.pending:
            await self.recover_locked()

    async def _reform(self, newcomers: Sequence[Member]) -> None:
        """Form the next group version, bounded by the newcomers' own RENDEZVOUS deadlines
        (``init_timeout_s``); a newcomer whose join failed is lost (and replaced)."""
        self.membership.changed()
        async with contextlib.AsyncExitStack() as scopes:
            for m in newcomers:
                if m.machine.state == "RENDEZVOUS":
                    await scopes.enter_async_context(m.machine.deadline_scope())
            try:
                await self.formation.reform()
            except MemberLost as exc:
                for m in newcomers:
                    if exc.member == m.name or m.gone:
                        raise _NewcomerLost(m, exc.reason) from exc
                raise

    async def _drop(self, m: Member, why: str) -> None:
        """A newcomer that will not serve: its process stopped, its machine retired, its slot back."""
        self.failover.resyncer.resync_facts(m.name)  # what a transfer to it left behind goes with it
        self.launcher.kill(m)
        if not m.gone and m.machine.can("died"):
            await m.machine.fire("died", reason=why)
        with contextlib.suppress(InvalidTransition):
            if m.machine.can("retire"):
                await m.machine.fire("retire", reason=f"newcomer not brought up: {why}"[:500])
        self.launcher.give_back(m)

    async def _undo(self, started: Sequence[Member], why: str) -> None:
        """An addition that failed: every newcomer goes (none serves half added), and the group
        is formed again without them where any had joined."""
        joined = False
        for m in started:
            if m.machine.state == "RETIRED":
                continue  # dropped already (lost and started again)
            joined = joined or m.machine.group_version == self.membership.group_version
            await self._drop(m, f"addition undone: {why}")
        if joined:
            with contextlib.suppress(FTError):  # a death meanwhile: the failover's to handle
                await self.formation.reform()

    # -- removing --------------------------------------------------------------------------

    async def remove(self, names: Sequence[str]) -> None:
        """Take ``names`` out of serving, then out of the group, then stop their processes. See
        the module docstring."""
        ms = self.membership
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise ScaleRefused(field="names", expected="a non-empty list of rollout names", got=repr(names))
        rollouts = {m.name: m for m in ms.role("rollout")}
        # LOST is taken (a dead member is removed, not replaced); retired, failed or stopped is no member
        unknown = [n for n in names if n not in rollouts or rollouts[n].machine.state in ("RETIRED", "FAILED", "STOPPED")]
        if unknown or len(set(names)) != len(names):
            raise ScaleRefused(field="names", expected=f"distinct rollouts of the fleet "
                               f"({', '.join(m.name for m in ms.live('rollout')) or 'none'})",
                               got=", ".join(map(str, unknown or names)))
        removing = [rollouts[n] for n in names]
        left = [m for m in ms.live("rollout") if m.name not in names]
        minimum = self.config.fault_tolerance.min_rollout_workers
        if len(left) < minimum:
            raise ScaleRefused(field="fault_tolerance.min_rollout_workers",
                               expected=f"at least {minimum} rollouts left", got=f"{len(left)} left after removing "
                               f"{', '.join(names)} ({len(ms.live('rollout'))} live)")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.changing.update(names)
        try:
            self.audit.record("scale_remove_started", members=list(names), group_version=ms.group_version,
                              weights_version=ms.weights_version)
            for m in removing:  # out of serving: routing deals them nothing new
                if m.machine.can("invalidate"):
                    await m.machine.fire("invalidate", reason="being removed (rt.remove_rollouts)")
            cut: list[str] = []
            try:
                async with asyncio.timeout(self.config.remove_calls_timeout_s):
                    await self.router.calls_ended(names)
            except TimeoutError:
                cut = self.router.busy(names)
                self.audit.record("scale_calls_cut", members=cut, timeout_s=self.config.remove_calls_timeout_s)
            for m in removing:  # out of the group; a loss of one of them is no failover's
                self.failover.forget_loss(m)
                await self._retire(m)
            await self._reform_without()
            for m in removing:  # and only then their processes stop
                self.launcher.kill(m)
                self.launcher.give_back(m)
        finally:
            self.changing.difference_update(names)
        record = ScaleRecord(kind="remove", members=tuple(names), seconds=loop.time() - t0,
                             group_version=ms.group_version, weights_version=ms.weights_version,
                             calls_cut=tuple(cut))
        self.records.append(record)
        self.audit.record("rollouts_removed", members=list(names), calls_cut=cut, seconds=round(record.seconds, 6),
                          group_version=ms.group_version, weights_version=ms.weights_version)
        await self._fit_spares()

    async def _retire(self, m: Member) -> None:
        """Retire ``m`` from wherever it is; one that cannot be retired from its state (suspect,
        mid-resync) has its process stopped first, which makes it LOST, then RETIRED."""
        if m.machine.state == "RETIRED":
            return
        if not m.machine.can("retire"):
            self.launcher.kill(m)
            if m.machine.can("died"):
                await m.machine.fire("died", reason="stopped: being removed (rt.remove_rollouts)")
        await m.machine.fire("retire", reason="removed (rt.remove_rollouts)")

    async def _reform_without(self) -> None:
        """The next group version without the removed rollouts; a member lost meanwhile is the
        failover's (which forms its own version), after the watchdog's verdict."""
        self.membership.changed()
        for attempt in range(self.config.fault_tolerance.resync_retries + 2):
            try:
                await self.formation.reform()
                return
            except MemberLost as exc:
                if attempt > self.config.fault_tolerance.resync_retries:
                    raise
                await self._settle(exc)
                if self.formation.usable:
                    return  # the failover formed a version without them

    # -- the fleet ---------------------------------------------------------------------------

    async def _fit_spares(self) -> None:
        """Keep the standby pool's ratio to the fleet: start spares, or retire the surplus
        (those still warming first: the least spent on them)."""
        ft = self.config.fault_tolerance
        if not (ft.enable and ft.mode == "standby"):
            return
        target = self.failover.spares.spare_target("rollout")
        spares = self.membership.spares("rollout", "INIT", "STANDBY")
        if len(spares) < target:
            self.failover.spares.replenish("rollout")
            return
        surplus = sorted(spares, key=lambda m: m.machine.state == "STANDBY")[:len(spares) - target]
        for m in surplus:
            await self._retire_spare(m)
        if surplus:
            self.audit.record("spares_retired", members=[m.name for m in surplus], target=target,
                              reason="the fleet shrank: the standby pool keeps standby_workers per rollout_workers")

    async def _retire_spare(self, m: Member) -> None:
        why = "the fleet shrank (standby_workers per rollout_workers)"
        self.changing.add(m.name)  # its loss (one still warming is stopped first) is no spare's loss
        try:
            if not m.machine.can("retire"):
                self.launcher.kill(m)
                if m.machine.can("died"):
                    await m.machine.fire("died", reason=f"stopped while warming: {why}")
            if m.machine.can("retire"):
                await m.machine.fire("retire", reason=why)
            self.launcher.kill(m)
            self.launcher.give_back(m)
        finally:
            self.changing.discard(m.name)
