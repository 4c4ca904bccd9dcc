"""Failover: replacing a lost worker within ``failover_timeout_s``, losing no weights.

With ``fault_tolerance.enable: true`` a worker that reaches LOST (its process died, or it
hung past ``heartbeat_timeout_s``) is replaced instead of failing the run. The group goes
READY -> DEGRADED -> PROMOTING -> RESYNCED -> READY (or RENDEZVOUS -> DEGRADED -> … when a
member dies before the first group version formed: the same procedure, with nothing to
resync yet; a member that merely hangs there still fails the start at ``init_timeout_s``):

1. **DEGRADED**: the loss is recorded; surviving rollouts keep serving the version they
   hold, which is still the current one.
2. **PROMOTING** (spends one of ``max_failovers``; carries ``failover_timeout_s``): a
   replacement takes the lost member's rank: a prewarmed spare from the standby pool
   (``mode: standby``; its process, user class and transport are already loaded) or a fresh
   actor (``mode: cold``). Every live member then forms group version N+1 (the store is
   fenced, so anything still addressed to version N is rejected).
3. **RESYNCED**: the newcomer alone receives the current weights, point to point from a
   surviving rollout that holds them (checksum-proven); a new trainer gets them the same
   way in reverse (``reverse_weight_sync``) or loads ``checkpoint_dir``. Before any sync, or
   when no survivor holds the current version, it stays STALE and the next sync brings it
   up to date: it is never admitted without them.
4. **READY**: the newcomer is admitted; a new spare is started in the background so the
   next failure is covered too.

In standby mode a spare still warming up is waited for, and with none at all a fresh actor
is started (as in cold mode). With no replacement possible (the fresh actor cannot start)
the group shrinks (rollouts only) while at least ``min_rollout_workers`` serve, and
otherwise fails with a clear error. Each failover is
recorded (who, by whom, how long each phase took) for the sync report and the demo.

This module is the procedure and its budget's accounting (slots, node strikes, quarantine, the
nodes to avoid); the standby pool is :mod:`ftstate.controller.spares`, moving the weights to a
newcomer :mod:`ftstate.controller.resync`. Runs in the driver process, on the controller's event
loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ftstate.controller.collector import CollectorPause
from ftstate.controller.membership import Member
from ftstate.controller.parts import ControllerParts, Part
from ftstate.controller.resync import Resync
from ftstate.controller.spares import Spares, constructor_failed
from ftstate.controller.sync import device_field
from ftstate.core.budget import FAILOVER_KEY, Budget, Charge
from ftstate.core.errors import (
    FTError,
    MemberLost,
    ReplacementFailed,
    TransportError,
    WorkerInitError,
)
from ftstate.core.protocol import (
    Beat,
    Prewarm,
)
from ftstate.core.text import bounded, clean


@dataclasses.dataclass(frozen=True)
class FailoverRecord:
    """One failover. lost / replacement: member names; reason: why it was lost;
    detected_at: loop time it was declared LOST; rerendezvous_s / transfer_s / total_s: time
    to form the next group version, to move the weights to the newcomer, and from LOST to
    serving; group_version: the version formed."""

    lost: str
    role: str
    replacement: str | None
    reason: str
    detected_at: float
    rerendezvous_s: float
    transfer_s: float
    total_s: float
    group_version: int
    resynced: bool
    #: Where the transfer's time went, when it was a point-to-point resync: its source and
    #: route, the sender's stages (reading its committed state, sending) and the newcomer's
    #: (receiving into staging, waiting for its user lock, the user's load, the proof), seconds.
    stages: dict[str, Any] | None = None
    #: A rollout newcomer whose engine loads by parts (``weights_device()`` and
    #: ``load_weights_part``): the device memory its two buckets took during the resync's load,
    #: whatever it came by (point to point, the node copy adopted or fetched), as
    #: ``SyncReport.device_bytes``; None for a load whole (or no load: nothing to resync).
    device_bytes: int | None = None
    #: The failover budget right after this failover (:meth:`ftstate.core.budget.Budget.state`):
    #: spent in all and inside the window, the limits, slots replaced again, node strikes,
    #: quarantined nodes.
    budget: dict[str, Any] | None = None


class Failover(Part):
    """The failover procedure of one runtime: it owns the standby pool (:attr:`spares`,
    :mod:`ftstate.controller.spares`) and the failover budget's accounting (slots, node
    strikes, quarantine, the nodes to avoid), and feeds newcomers through ``resyncer``, the
    run's :class:`~ftstate.controller.resync.Resync` (built once by the runtime).

    It works on the shared membership; the launcher starts and kills actors, the formation
    forms group versions, the watchdog settles suspects.
    """

    def __init__(self, parts: ControllerParts, *, resyncer: Resync) -> None:
        super().__init__(parts)
        self.records: list[FailoverRecord] = []
        self._pending: list[tuple[Member, float]] = []
        #: Moves the current weights to newcomers (the runtime sets its ``weights_bytes`` at each commit).
        self.resyncer = resyncer
        #: The standby pool.
        self.spares = Spares(parts, avoided_nodes=self.avoided_nodes,
                             quarantined_nodes=lambda: self.quarantined_nodes, strike=self.strike)
        #: Ray ids of nodes whose members were lost together (a node loss): no spare goes there.
        self.lost_nodes: set[str | None] = set()
        #: Ray ids of nodes where a member went silent (not reported dead): no replacement goes there.
        self.unreachable_nodes: set[str] = set()
        #: Ray ids of nodes being drained (a maintenance notice): nothing new goes there.
        self.draining_nodes: set[str] = set()
        #: Ray ids of nodes quarantined since the runtime last drained them (it takes them).
        self.to_drain: list[str] = []
        self._slots: dict[str, str] = {}  # replacement -> the slot it took (slot_of)

    @property
    def budget(self) -> Budget:
        """The run's failover budget (the group's: :mod:`ftstate.core.budget`)."""
        return self.membership.group.budget(FAILOVER_KEY)

    def slot_of(self, m: Member) -> str:
        """The member slot ``m`` holds: the name of the first member that held it (``rollout-1``);
        a replacement inherits it (ranks are renumbered with each group version: no identity)."""
        return self._slots.get(m.name, m.name)

    def _slot_charge(self, lost: Member, reason: str) -> Charge:
        cls = getattr(self.launcher, "classes", {}).get(lost.role)
        return Charge(reason=f"{lost.name}: {reason}", slot=self.slot_of(lost), cls=getattr(cls, "__name__", None))

    def strike(self, m: Member, why: str) -> None:
        """A death that blames ``m``'s node (a spare or a replacement that died young, members
        that died together while the node stays up): the node's strike; at
        ``max_node_failures`` inside the window it is quarantined: recorded, avoided from now
        on, and its remaining members drained by the runtime (:attr:`to_drain`)."""
        node = self.launcher.node_of(m)
        alive = self.launcher.alive_nodes()
        if node is None or node not in alive:
            return  # unknown, or gone whole: nothing left to place there
        budget = self.budget
        elsewhere = bool(alive - self.avoided_nodes() - {node})
        if budget.strike(node, self.membership.group.clock.now(), f"{m.name}: {why}", elsewhere=elsewhere):
            self.to_drain.append(node)
            self.audit.record("node_quarantined", node=node, member=m.name, strikes=budget.per_node,
                              window_s=budget.window_s, reason=f"{budget.per_node} members lost there within "
                              f"failover_window_s; the last: {m.name}: {why}"[:500])
            self.spares.node_quarantined()

    @property
    def quarantined_nodes(self) -> set[str]:
        return set(self.budget.quarantined)

    # -- losses ----------------------------------------------------------------------------

    def note_loss(self, m: Member, detected_at: float, trigger: str = "died") -> None:
        """A member reached LOST (by ``trigger``). One that went silent rather than reported
        dead (``heartbeat_timeout``, ``node_lost``, ``unresponsive``) may have lost its node:
        replacements keep off that node until the run learns better."""
        if trigger != "died" and m.node_id is not None:
            self.unreachable_nodes.add(m.node_id)
        if m.rank >= 0 and all(p is not m for p, _ in self._pending):  # a spare's loss needs no failover
            self._pending.append((m, detected_at))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def forget_loss(self, m: Member) -> None:
        """``m``'s loss needs no failover: it was being removed on purpose
        (:mod:`ftstate.controller.scaling`), so nothing is replaced and no budget spent."""
        self._pending = [(p, t) for p, t in self._pending if p is not m]

    async def recover(self) -> int:
        """Replace every pending loss; the caller holds the runtime's membership lock.
        Returns how many members were replaced or dropped. Raises the group's error if the
        run cannot go on.

        All losses pending at once are one reconciliation: the members they share a node with
        are asked first (a node's processes die together, their deaths reach the controller a
        few milliseconds apart, and an idle one only when something calls it), then every
        lost member is replaced in one failover round under one new group version. The budget
        is still spent once per replaced member. The process's garbage collector is paused while
        the round runs, at most ``gc_pause_s`` (:mod:`~ftstate.controller.collector`)."""
        done = 0
        async with CollectorPause(self.config.gc_pause_s):
            while self._pending:
                await self._sweep_nodes()
                batch, self._pending = self._pending, []
                await self._replace(batch)
                done += len(batch)
        return done

    async def _sweep_nodes(self) -> None:
        """Ask every other member on the nodes of the pending losses for a heartbeat (bounded
        by ``heartbeat_interval_s``). One whose process is gone is declared LOST by its failing
        call; one that does not answer either is declared LOST with its node (``node_lost``):
        a node whose raylet is gone leaves its actors unreachable, not reported dead, until
        Ray's own node health check gives up on it, and that is not waited for. A member that
        answers stays: a hung process is not a dead node."""
        nodes: dict[str, str] = {}
        for m, _ in self._pending:
            if m.node_id is not None:
                nodes.setdefault(m.node_id, m.name)
        pending = {m.name for m, _ in self._pending}
        peers = [m for node in nodes for m in self.membership.on_node(node) if m.name not in pending]
        # Members of one node lost in the same breath (their heartbeat deadlines expired
        # together) are a node loss too, whether or not anyone else was there to ask.
        shared = {n for n in nodes if sum(1 for m, _ in self._pending if m.node_id == n) > 1}
        if not peers:
            if shared:
                self.lost_nodes |= shared
                self.audit.record("node_lost", nodes=sorted(shared),
                                  members=sorted(m.name for m, _ in self._pending if m.node_id in shared))
            return
        answers = await asyncio.gather(*(self.calls.call(m.name, m.handle, Beat(),
                                                         timeout=self.config.heartbeat_interval_s)
                                         for m in peers), return_exceptions=True)
        together = []
        for m, answer in zip(peers, answers, strict=True):
            if not isinstance(answer, BaseException):
                continue
            together.append(m.name)
            if m.machine.can("node_lost"):
                first = nodes[m.node_id or ""]
                reason = (f"node {m.node_id[:12] if m.node_id else '?'} lost: {first} was lost and {m.name} did not "
                          f"answer within heartbeat_interval_s ({type(answer).__name__})")
                await m.machine.fire("node_lost", reason=reason,
                                     error=MemberLost(m.name, reason, group_version=m.machine.group_version))
        lost = {m.node_id for m in peers if m.name in together} | shared
        if lost:
            self.lost_nodes |= lost
            self.audit.record("node_lost", nodes=sorted(n for n in lost if n),
                              members=sorted({*(m.name for m, _ in self._pending if m.node_id in lost), *together}))

    def _reason(self, lost: Member) -> str:
        # The bare cause ("process died during info()"): MemberLost's own text names the
        # member again, and the records and errors name it already.
        error = lost.machine.error
        return error.reason if isinstance(error, MemberLost) else str(error) if error else f"{lost.name} lost"

    async def _replace(self, batch: list[tuple[Member, float]]) -> None:
        """One failover round: retire every member of ``batch``, take a replacement for each
        (a rollout with none is dropped while ``min_rollout_workers`` still serve), form one
        new group version, and move the current weights to each newcomer: the trainer first
        (it may be rebuilt from a surviving rollout), then the rollouts."""
        group = self.membership.group
        losts = sorted((m for m, _ in batch), key=lambda m: (m.role != "trainer", m.rank))
        detected = {m.name: t for m, t in batch}
        reasons = {m.name: self._reason(m) for m in losts}
        names = ", ".join(m.name for m in losts)
        if group.terminal:
            # Another path failed the run first (a deadline, an earlier failover): its error
            # is the cause; there is nothing left to promote into.
            raise group.error or FTError(f"cannot replace {names}: the group is {group.state}")
        summary = "; ".join(f"{m.name}: {reasons[m.name]}" for m in losts)
        if group.can("member_lost"):
            await group.fire("member_lost", reason=summary, member_lost=names)
        # One unit per member slot, one per node lost whole (or FAILED when a limit would break).
        await group.fire("promote", reason=summary, spend_on=self._charges(losts, reasons))
        if group.terminal:
            raise group.error or FTError(f"failover of {names} failed")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        replacements: dict[str, Member] = {}
        dropped: dict[str, str] = {}  # rollouts with no replacement, and why
        resynced: dict[str, bool] = {}
        async with group.deadline_scope():
            for lost in losts:
                await self._retire(lost)
            transfer_tries = 0
            while True:  # until every replacement serves; bounded by this state's deadline
                for lost in losts:
                    if lost.name in replacements or lost.name in dropped:
                        continue
                    try:
                        replacement = await self.replacement_for(lost)
                    except FTError as exc:
                        if lost.role != "rollout":
                            raise
                        dropped[lost.name] = str(exc)
                        continue
                    replacement.set_rank(lost.rank)
                    replacements[lost.name] = replacement
                    self._slots[replacement.name] = self.slot_of(lost)
                if dropped:
                    await self._check_enough_rollouts(losts, replacements, dropped, reasons)
                if not replacements:
                    await group.fire("promotion_failed", reason=f"no replacement for {names}: "
                                     + "; ".join(dropped.values()))
                    self.membership.changed()
                    await self.formation.reform()
                    await group.fire("shrink", reason=f"{names} lost with no replacement; "
                                     f"{len(self.membership.live('rollout'))} rollouts serve")
                    return
                waiting = [r.name for r in replacements.values()]
                group.describe_wait(f"failover of {names} to {', '.join(waiting)}", missing=waiting)
                try:
                    await self.formation.reform()
                    t_reformed = loop.time()
                    ranks = {lost.name: replacements[lost.name] for lost in losts
                             if lost.role == "trainer" and self.config.trainer_workers > 1
                             and lost.name in replacements and lost.name not in resynced}
                    if ranks:  # several trainer ranks: every rank lost at once in one reconciliation
                        try:
                            await self.resyncer.recover_ranks(list(ranks.values()))
                        except FTError:
                            raise
                        except Exception as exc:  # the user's code: ends the run, named
                            first = next(iter(ranks))
                            raise replacement_failed(ranks[first], self.membership.find(first) or ranks[first],
                                                     exc) from exc
                        resynced.update(dict.fromkeys(ranks, True))
                    for lost in losts:  # the trainer first: it sorts first
                        replacement = replacements.get(lost.name)
                        if replacement is not None and lost.name not in resynced:
                            try:
                                resynced[lost.name] = await self.resyncer.resync(replacement)
                            except FTError:
                                raise
                            except Exception as exc:  # the user's code: ends the run, named
                                raise replacement_failed(replacement, lost, exc) from exc
                except MemberLost as exc:
                    # A member the re-rendezvous or the transfer found unreachable but that
                    # nobody declared lost (on a node whose raylet just went, or hung), a
                    # survivor or a replacement: not retried around blindly; the watchdog's
                    # verdict first (LOST: a replacement is retired for the next candidate, a
                    # survivor taken in below; or alive, and the version formed again),
                    # bounded by its deadlines.
                    hit = self.membership.find(exc.member)
                    unsettled = hit is not None and not hit.gone
                    if unsettled:
                        await self.watchdog.verdict([hit])
                    dead = [n for n, r in replacements.items() if r.machine.state in ("LOST", "RETIRED")]
                    if dead:
                        # A replacement itself died (a spare killed before anyone noticed, or
                        # during the re-rendezvous): retire it and take the next candidate.
                        charges = []
                        for n in dead:
                            r = replacements.pop(n)
                            resynced.pop(n, None)
                            self._pending = [(p, t) for p, t in self._pending if p is not r]
                            await self._retire(r)
                            # its slot's loss again: a class whose every replacement dies ends at
                            # max_slot_failovers (CrashLoop), not at failover_timeout_s
                            why = f"{r.name}, its replacement, died: {self._reason(r)}"
                            self.strike(r, why)
                            charges.append(self._slot_charge(next(m for m in losts if m.name == n), why))
                        if not await group.spend(charges):
                            raise group.error or FTError(f"no failover left for {', '.join(dead)}") from exc
                        continue
                    pending = {m.name for m, _ in self._pending}
                    stuck = hit is not None and hit.gone and hit.name not in pending  # no round will bring it
                    if self._pending and (await self._take_in_ranks(losts, detected, reasons) or not stuck):
                        # Another member died during the re-rendezvous or the transfer: form
                        # the group again without it (its own failover comes next), unless
                        # it is a trainer rank: the ranks are recovered together, so this
                        # round takes it in. (A version refused for a rank nobody lost in
                        # this round is not retried blindly: that would spin.)
                        continue
                    if unsettled and transfer_tries < self.ft.resync_retries:
                        transfer_tries += 1  # it answered again: form the version again, boundedly
                        continue
                    raise
                except TransportError:
                    # A newcomer's transfer failed without a death (a corrupted bucket): the
                    # stream stayed sound, so the transfer is simply made again.
                    transfer_tries += 1
                    if transfer_tries > self.ft.resync_retries:
                        raise
                    continue
                t_done = loop.time()
                break
        await group.fire("promoted", replacement=", ".join(r.name for r in replacements.values()), lost=names,
                         dropped=sorted(dropped))
        await group.fire("resume")
        budget = self.budget.state(group.clock.now())
        for lost in losts:
            replacement = replacements.get(lost.name)
            if replacement is None:
                continue
            detected_at = detected[lost.name]
            # who fed it: the record's stages say it (scaling asks for its own)
            _, stages, device_bytes = self.resyncer.resync_facts(replacement.name)
            self.records.append(FailoverRecord(
                lost=lost.name, role=lost.role, replacement=replacement.name, reason=reasons[lost.name],
                detected_at=detected_at, rerendezvous_s=t_reformed - t0, transfer_s=t_done - t_reformed,
                total_s=t_done - detected_at, group_version=group.group_version, resynced=resynced[lost.name],
                stages=stages, device_bytes=device_bytes,
                budget=budget,
            ))
            self.audit.record("failover", lost=lost.name, replacement=replacement.name, role=lost.role,
                              rerendezvous_s=round(t_reformed - t0, 6), transfer_s=round(t_done - t_reformed, 6),
                              total_s=round(t_done - detected_at, 6), group_version=group.group_version,
                              weights_version=group.weights_version, resynced=resynced[lost.name],
                              batch=len(losts), stages=self.records[-1].stages,
                              budget={k: budget[k] for k in ("spent", "in_window", "quarantined")},
                              **device_field(self.records[-1].device_bytes))
        if self.ft.mode == "standby":
            for role in sorted({lost.role for lost in losts}):
                self.spares.replenish(role)

    def _charges(self, losts: list[Member], reasons: dict[str, str]) -> list[Charge]:
        """What a round costs: one unit per member slot, but the members of a node lost whole one
        unit between them (a node lost is one failure, not eight), and those of a node
        quarantined already none (a round costs one at least). A serving member lost alone is
        attrition, not its node's fault; members that died together on a node that stays up are
        each a strike (:meth:`strike`), as are spares and replacements that die young."""
        charges, by_node = [], {}
        quarantined = self.quarantined_nodes
        for m in losts:
            node = m.node_id
            if node in quarantined:
                continue  # the quarantine's own consequence, paid for by the strikes that led to it
            if node is not None and node in self.lost_nodes:
                by_node.setdefault(node, []).append(m.name)
                if node not in self.unreachable_nodes:
                    # every member reported dead together, the node still up and answering:
                    # not a node gone but a node that kills what runs there
                    self.strike(m, reasons[m.name])
                continue
            charges.append(self._slot_charge(m, reasons[m.name]))
        charges += [Charge(reason=f"node {node[:12]} lost: {', '.join(names)}", node=node)
                    for node, names in by_node.items()]
        return charges

    async def _take_in_ranks(self, losts: list[Member], detected: dict[str, float], reasons: dict[str, str]) -> bool:
        """Several trainer ranks: a rank lost while this round ran joins it (one of
        ``max_failovers`` spent on it, as on entry), since every rank must be in place before
        any is recovered; a later round would find this one waiting for it forever."""
        if self.config.trainer_workers <= 1:
            return False
        ranks = [(m, t) for m, t in self._pending if m.role == "trainer"]
        if not ranks:
            return False
        self._pending = [(m, t) for m, t in self._pending if m.role != "trainer"]
        group = self.membership.group
        for m, t in ranks:
            detected[m.name], reasons[m.name] = t, self._reason(m)
        if not await group.spend(self._charges([m for m, _ in ranks], reasons)):
            raise group.error or FTError(f"no failover left for {', '.join(m.name for m, _ in ranks)}")
        self.audit.record("failover_joined", machine="group", member="group", members=[m.name for m, _ in ranks],
                          reason="trainer ranks lost while the ranks were being recovered")
        for m, _ in ranks:
            losts.append(m)
            await self._retire(m)
        return True

    async def _check_enough_rollouts(
        self, losts: list[Member], replacements: dict[str, Member], dropped: dict[str, str], reasons: dict[str, str]
    ) -> None:
        """Fail the group when the rollouts left (survivors and replacements) are fewer than
        ``min_rollout_workers``."""
        group = self.membership.group
        lost_names = {m.name for m in losts}
        serving = [m for m in self.membership.role("rollout")
                   if m.name not in lost_names and m.machine.state not in ("LOST", "RETIRED")]
        serving += [r for r in replacements.values() if r.role == "rollout" and r not in serving]
        if len(serving) < self.ft.min_rollout_workers:
            name = next(iter(dropped))
            err = MemberLost(name, f"{reasons[name]}; no replacement could start ({dropped[name]}) and only "
                                   f"{len(serving)} rollouts left, fewer than "
                                   f"min_rollout_workers={self.ft.min_rollout_workers}",
                             group_version=group.group_version)
            await group.fire("fail", reason=str(err), error=err)
            raise err

    def avoided_nodes(self) -> set[str]:
        """Nodes no replacement or spare goes to: lost, unreachable or being drained; but when
        that leaves no node at all (one node, a hung process on it), only the lost ones."""
        quarantined = self.quarantined_nodes
        avoid = {n for n in self.lost_nodes | self.unreachable_nodes | self.draining_nodes | quarantined if n}
        if avoid and not self.launcher.alive_nodes() - avoid:
            return {n for n in self.lost_nodes | quarantined if n}
        return avoid

    async def replacement_for(self, lost: Member) -> Member:
        """A warm spare of the member's role (standby mode; one still warming is waited for),
        else a fresh actor started now (cold mode, or no spare left), never on an avoided node
        (:meth:`avoided_nodes`). ``lost`` is the member replaced (lost, or being drained).
        Raises FTError when none can be had."""
        avoid = self.avoided_nodes()
        draining = lost.node_id in self.draining_nodes
        if draining:
            avoid.add(lost.node_id)  # a drain's replacement goes elsewhere or nowhere
        if self.ft.mode == "standby":
            spare = await self.spares.take(lost.role, avoid)
            if spare is not None:
                await self.spares.promote(spare, promoted=f"replaces {lost.name}",
                                          joins=f"takes rank {lost.rank} of {lost.name}")
                return spare
        pool = lost.pool
        if (lost.node_id in avoid or not self.launcher.has_free_slot(pool)) \
                and self.launcher.has_free_slot(self.ft.standby_resource_pool):
            # The member's own slot is a bundle on a node that may be gone (Ray moves that
            # bundle only once its own health check gives up on the node) or is still held (a
            # drain): a placement group of its own, off the avoided nodes, starts it now.
            pool = self.ft.standby_resource_pool
        # A drain's replacement must be elsewhere or nowhere: on the node being drained it
        # would only go down with it.
        fresh = self.launcher.start(lost.role, lost.rank, f"{lost.role}-{lost.rank}-r{self.spares.next_seq()}",
                                    pool=pool, avoid_nodes=avoid, strict=draining)
        try:
            info = await self.calls.call(fresh.name, fresh.handle, Prewarm())
        except FTError as exc:
            # It could not even start (its constructor failed, no resources): not a member to
            # fail over, just no replacement.
            if isinstance(exc, WorkerInitError):
                await constructor_failed(fresh, exc)
            self._pending = [(p, t) for p, t in self._pending if p is not fresh]
            if fresh.machine.can("retire"):
                await fresh.machine.fire("retire", reason="replacement could not start")
            self.launcher.give_back(fresh)
            raise
        self.membership.located(fresh, info)
        await fresh.machine.fire("join", reason=f"fresh replacement of {lost.name}")
        return fresh

    async def _retire(self, lost: Member) -> None:
        if lost.machine.can("retire"):
            await lost.machine.fire("retire", reason="replaced")
        self.launcher.give_back(lost)


def replacement_failed(replacement: Member, lost: Member, exc: Exception) -> ReplacementFailed:
    """The typed error for a replacement whose own code raised while it was brought up (the
    host marked which user method and where: :func:`ftstate.worker.host.mark_user_error`)."""
    text = clean(str(exc)).strip().splitlines()
    message = text[0] if text else ""
    prefix = f"{replacement.name}: "
    return ReplacementFailed(member=replacement.name, replaces=lost.name,
                             method=getattr(exc, "ftstate_method", None) or "its code", exc_type=type(exc).__name__,
                             message=bounded(message.removeprefix(prefix), 1000),
                             where=getattr(exc, "ftstate_where", "") or "")

