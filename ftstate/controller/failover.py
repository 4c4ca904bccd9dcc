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
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.collector import CollectorPause
from ftstate.controller.formation import GroupFormation
from ftstate.controller.launcher import ActorLauncher
from ftstate.controller.membership import Member, Membership, walk_proven
from ftstate.controller.nodecopies import NodeCopies
from ftstate.controller.ranks import recover_ranks
from ftstate.controller.sync import device_field, plan_for
from ftstate.controller.watchdog import Watchdog
from ftstate.core.audit import AuditTrail
from ftstate.core.budget import FAILOVER_KEY, Budget, Charge
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import (
    ChecksumMismatch,
    DeadlineExceeded,
    FTError,
    HeldWeightsMismatch,
    LossyRecoveryRefused,
    ManifestError,
    MemberLost,
    ReplacementFailed,
    StaleCheckpointRefused,
    TransportError,
    WorkerInitError,
)
from ftstate.core.protocol import (
    AdoptNodeCopy,
    Beat,
    FetchNodeCopy,
    Loaded,
    Prewarm,
    ReceiveFrom,
    ReserveStaging,
    SendTo,
    TrainerChecksum,
    UserCall,
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


class Failover:
    """The failover procedure of one runtime (it owns the spares).

    It works on the shared membership; the launcher starts and kills actors, the formation
    forms group versions, the watchdog settles suspects. trainer_lossy: the user trainer
    class's ``lossy_state_dict`` (reverse recovery from a lossy copy is refused unless
    ``allow_lossy_recovery``); rank_local_calls: its ``rank_local_calls`` (several ranks:
    who replays, :mod:`ftstate.controller.ranks`).
    """

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        audit: AuditTrail,
        membership: Membership,
        calls: ActorCalls,
        launcher: ActorLauncher,
        formation: GroupFormation,
        watchdog: Watchdog,
        trainer_lossy: bool,
        trainer_class_name: str,
        rank_local_calls: bool = False,
        node_copies: NodeCopies | None = None,
    ) -> None:
        self.config = config
        self.audit = audit
        self.membership = membership
        self.calls = calls
        self.launcher = launcher
        self.formation = formation
        self.watchdog = watchdog
        self.trainer_lossy = trainer_lossy
        self.trainer_class_name = trainer_class_name
        self.rank_local_calls = rank_local_calls
        #: ``staging: node``: each node's committed copy, which a rollout newcomer there adopts
        self.node_copies = node_copies
        self.records: list[FailoverRecord] = []
        self._stages: dict[str, dict[str, Any]] = {}  # newcomer -> its resync's stage timings
        self._device: dict[str, int] = {}  # newcomer -> the device bytes of its resync's load by parts
        self._fed_by: dict[str, str] = {}  # newcomer -> who its last resync read from (a member, a node copy)
        #: Bytes of the last committed weights version (the runtime sets it at each commit): what
        #: a resync moves, for its route (``resync_shared_memory_min_mb``).
        self.weights_bytes = 0
        self._pending: list[tuple[Member, float]] = []
        self._spare_seq = 0
        self._warming: set[asyncio.Task[Any]] = set()
        # spares of each role that died before ever getting warm, in a row
        self._cold_starts: dict[str, int] = {"trainer": 0, "rollout": 0}
        # when each spare was started; how long each one that got warm took, by name
        self._started_at: dict[str, float] = {}
        self._warm_seconds: dict[str, float] = {}
        #: The committed weights' size: what a spare's staging buffer is reserved for (0: none yet).
        self.staging_bytes = 0
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
    def ft(self) -> Any:
        return self.config.fault_tolerance

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
            # its spares died of the node, not of their class: the role may start spares again
            self._cold_starts = dict.fromkeys(self._cold_starts, 0)

    @property
    def quarantined_nodes(self) -> set[str]:
        return set(self.budget.quarantined)

    # -- spares --------------------------------------------------------------------------

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
        if m.name not in self._warm_seconds and m.node_id not in self.quarantined_nodes:
            self._cold_starts[role] += 1
            if self._cold_starts[role] >= self.ft.spare_start_attempts:
                self.audit.record("spare_unavailable", role=role, attempts=self._cold_starts[role],
                                     reason=str(m.machine.error) if m.machine.error else "died while warming")
                return
        self.replenish(role)

    def start_spare(self, role: str) -> None:
        name = f"spare-{role}-{self._spare_seq}"
        self._spare_seq += 1
        pool = self.ft.standby_resource_pool
        if not self.launcher.has_free_slot(pool):
            pool = role
        # Off the nodes of the members it covers (and of nodes lost), where the pool has room.
        covered = ({self.launcher.node_of(m) for m in self.membership.live(role)} | self.avoided_nodes()) - {None}
        colocated = False
        never = self.quarantined_nodes
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
            await _constructor_failed(m, exc)  # as if it died warming: LOST, then spare_lost
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

    async def close(self) -> None:
        for task in list(self._warming):
            task.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)

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

    def resync_facts(self, newcomer: str) -> tuple[str | None, dict[str, Any] | None, int | None]:
        """Who fed ``newcomer`` in its last :meth:`resync` (None: nobody yet), and the stage
        timings and load-by-parts device bytes kept for it (for a record other than a
        :class:`FailoverRecord`), taken out."""
        return self._fed_by.pop(newcomer, None), self._stages.pop(newcomer, None), self._device.pop(newcomer, None)

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
                            await self.recover_ranks(list(ranks.values()))
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
                                resynced[lost.name] = await self.resync(replacement)
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
            self._fed_by.pop(replacement.name, None)  # the record's stages say it (scaling asks for its own)
            self.records.append(FailoverRecord(
                lost=lost.name, role=lost.role, replacement=replacement.name, reason=reasons[lost.name],
                detected_at=detected_at, rerendezvous_s=t_reformed - t0, transfer_s=t_done - t_reformed,
                total_s=t_done - detected_at, group_version=group.group_version, resynced=resynced[lost.name],
                stages=self._stages.pop(replacement.name, None), device_bytes=self._device.pop(replacement.name, None),
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
                self.replenish(role)

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
            spare = self.spare_for(lost.role, avoid)
            if spare is None:
                warming = [m for m in self.membership.spares(lost.role, "INIT") if m.node_id not in avoid]
                if warming:
                    spare = await self._await_warming(warming[0])
            if spare is not None:
                spare.reserved_bytes = 0  # its staging becomes the transfer's: a member reserves none
                await spare.machine.fire("promote", reason=f"replaces {lost.name}")
                await spare.machine.fire("join", reason=f"takes rank {lost.rank} of {lost.name}")
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
        fresh = self.launcher.start(lost.role, lost.rank, f"{lost.role}-{lost.rank}-r{self._spare_seq}",
                                    pool=pool, avoid_nodes=avoid, strict=draining)
        self._spare_seq += 1
        try:
            info = await self.calls.call(fresh.name, fresh.handle, Prewarm())
        except FTError as exc:
            # It could not even start (its constructor failed, no resources): not a member to
            # fail over, just no replacement.
            if isinstance(exc, WorkerInitError):
                await _constructor_failed(fresh, exc)
            self._pending = [(p, t) for p, t in self._pending if p is not fresh]
            if fresh.machine.can("retire"):
                await fresh.machine.fire("retire", reason="replacement could not start")
            self.launcher.give_back(fresh)
            raise
        self.membership.located(fresh, info)
        await fresh.machine.fire("join", reason=f"fresh replacement of {lost.name}")
        return fresh

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

    async def _retire(self, lost: Member) -> None:
        if lost.machine.can("retire"):
            await lost.machine.fire("retire", reason="replaced")
        self.launcher.give_back(lost)

    async def resync(self, newcomer: Member, source: Member | None = None) -> bool:
        """Move the current version to the newcomer only; False when it must wait for the next
        sync. ``source``: the holder to send it, when it still holds it (else one is chosen)."""
        group = self.membership.group
        _still_up(newcomer)
        # Idempotent on a retry: the newcomer may be anywhere between RENDEZVOUS and STALE.
        if newcomer.machine.state == "RENDEZVOUS":
            await newcomer.machine.fire("joined")
        elif newcomer.machine.state == "RESYNCING":
            await newcomer.machine.fire("resync_failed", reason="transfer to be made again")
        version, checksum = group.weights_version, self.membership.checksum
        if version == 0 or checksum is None:
            if newcomer.role == "trainer":
                await self._trainer_without_weights(newcomer)
            return False
        def holders() -> list[Member]:
            return self.membership.holders(exclude=newcomer)

        sources = holders()
        if not sources and newcomer.role == "trainer":
            # Rollouts blocked behind the hung trainer were suspected too; let them prove
            # their weights before concluding that nobody holds them.
            await self.watchdog.settle_suspects(done=lambda: bool(holders()))
            sources = holders()
        if newcomer.role == "trainer":
            if not self.ft.reverse_weight_sync:
                await self._trainer_from_checkpoint(newcomer)
                return True
            await self._refuse_lossy(newcomer)
            if not sources:
                err = MemberLost(newcomer.name, "no rollout holds the current weights version to rebuild the trainer")
                await group.fire("fail", reason=str(err), error=err)
                raise err
        elif await self._adopt_node_copy(newcomer, version, checksum) or await self._fetch_node_copy(
                newcomer, version, checksum, sources):
            return True
        elif not sources:
            return False  # no survivor holds it: the next sync resyncs the newcomer
        # a holder on the newcomer's node first: the plan then reads shared memory, no socket
        src = source if source in sources else min(
            sources, key=lambda m: m.node_id is None or m.node_id != newcomer.node_id)
        # under the new group version shared memory means new slots, dearer than the collective
        # for one newcomer below resync_shared_memory_min_mb (measured, docs/benchmarks.md)
        small = self.config.shared_memory == "auto" \
            and self.weights_bytes < self.config.resync_shared_memory_min_mb * 2**20
        plan = plan_for(self.config, src, [newcomer], "off" if small else None)
        record = plan.record()
        if small and src.node_id is not None and src.node_id == newcomer.node_id:
            record["collective"] = (f"{self.weights_bytes} bytes, below resync_shared_memory_min_mb "
                                    f"({self.config.resync_shared_memory_min_mb:g} MiB)")
        _still_up(newcomer)
        self._fed_by[newcomer.name] = src.name
        await newcomer.machine.fire("resync", source=src.name, plan=record)
        timeout = self.config.sync_timeout_s
        shm = plan.uses_shm
        sent, got = await asyncio.gather(
            self.calls.call(src.name, src.handle, SendTo(newcomer.rank, timeout, shm, plan.require_shm)),
            self.calls.call(newcomer.name, newcomer.handle, ReceiveFrom(src.rank, version, checksum, timeout, shm)),
        )
        if got.checksum != checksum:
            # It received the version intact but does not hold it after loading (a rollout's
            # engine copy, or a trainer whose state_dict() differs from what it loaded).
            raise HeldWeightsMismatch(newcomer.name, weights_version=version, held=got.checksum,
                                      expected=checksum, what=f"after loading it from {src.name}")
        newcomer.machine.weights_version = version
        self._stages[newcomer.name] = {"source": src.name, "route": "shm" if shm else "gloo",
                                       "sender": dict(sent.stages), "newcomer": dict(got.stages)}
        await walk_proven(newcomer.machine, "RESYNCED", checksum=got.checksum, source=src.name,
                          **self._loaded_by_parts(newcomer, got))
        if newcomer.role == "trainer":
            await self._optimizer_policy(newcomer)
            await self._replay(newcomer)
        await walk_proven(newcomer.machine, "READY")
        return True

    async def _adopt_node_copy(self, newcomer: Member, version: int, checksum: str) -> bool:
        """A rollout newcomer on a node holding the committed version's node copy
        (``staging: node``) takes it from there: mapped and hashed in place, no transfer (route
        ``node_copy`` in its ``resync`` record). False when there is none; when the copy turns
        out gone or not that version, the newcomer is STALE again, ``node_copy_fallback``
        records why, and the caller resyncs it point to point."""
        copy = self.node_copies.source_for(newcomer.node_id, version, checksum) if self.node_copies else None
        if copy is None:
            return False
        return await self._from_node_copy(
            newcomer, copy, version, checksum, source="node copy", route="node_copy", errors=(ManifestError,
            ChecksumMismatch), refused="the node copy could not be adopted", instead="point to point",
            load=lambda: self.calls.call(newcomer.name, newcomer.handle,
                                         AdoptNodeCopy(copy.name, copy.owner, copy.group, version, checksum)))

    async def _fetch_node_copy(self, newcomer: Member, version: int, checksum: str,
                               holders: list[Member]) -> bool:
        """A rollout newcomer on a node with neither the committed node copy nor a holder (``holders``) is
        served point to point by another node's agent from that node's copy (checkpoint-engine's
        P2P mode: no rollout engine and no trainer sends; ``resync`` record source ``node copy
        on <node>``, route ``node_copy_p2p``), proving it by checksum. False when no node holds
        one; when serving or receiving fails, the newcomer is STALE again, ``node_copy_fallback``
        records why, and the caller resyncs it from a holder."""
        if any(m.node_id is not None and m.node_id == newcomer.node_id for m in holders):
            return False  # a holder beside it: shared memory, no network
        copy = self.node_copies.remote_source(newcomer.node_id, version, checksum) if self.node_copies else None
        if copy is None:
            return False
        async def load() -> Loaded:
            served = await self.node_copies.serve(copy)
            # bounded inside the newcomer by sync_timeout_s, and by the failover's deadline here
            return await self.calls.call(newcomer.name, newcomer.handle, FetchNodeCopy(
                served, copy.name, copy.owner, copy.group, version, checksum, self.config.sync_timeout_s))

        # MemberLost: the serving agent gone (the newcomer's own death is re-raised)
        return await self._from_node_copy(
            newcomer, copy, version, checksum, source=f"node copy on {copy.node_id[:8]}", route="node_copy_p2p",
            errors=(ManifestError, ChecksumMismatch, TransportError, DeadlineExceeded, MemberLost),
            refused="the node copy could not be served point to point", instead="from a holder", load=load)

    async def _from_node_copy(self, newcomer: Member, copy: Any, version: int, checksum: str, *, source: str,
                              route: str, errors: tuple[type[Exception], ...], refused: str, instead: str,
                              load: Any) -> bool:
        """Resync ``newcomer`` from node copy ``copy`` through ``load()`` (its ``resync`` record:
        ``source``, route ``route``); one of ``errors`` makes it STALE again with a
        ``node_copy_fallback`` record (False: the caller tries the next source)."""
        plan = {"sender": source, "node": copy.node_id[:8], "mode": self.config.shared_memory,
                "routes": {newcomer.name: route}, "segment": copy.name}
        _still_up(newcomer)
        self._fed_by[newcomer.name] = source
        await newcomer.machine.fire("resync", source=source, plan=plan)
        try:
            got = await load()
        except errors as exc:
            if isinstance(exc, MemberLost) and exc.member == newcomer.name:
                raise  # the newcomer itself died: the failover handles that
            self.audit.record("node_copy_fallback", member=newcomer.name, node=copy.node_id[:8],
                              reason=f"{refused}: {exc}"[:500])
            await newcomer.machine.fire("resync_failed", reason=f"node copy refused; {instead} instead")
            return False
        if got.checksum != checksum:
            raise HeldWeightsMismatch(newcomer.name, weights_version=version, held=got.checksum,
                                      expected=checksum, what=f"after loading it from the {source}")
        newcomer.machine.weights_version = version
        await walk_proven(newcomer.machine, "RESYNCED", checksum=got.checksum, source=source,
                          **self._loaded_by_parts(newcomer, got))
        await walk_proven(newcomer.machine, "READY")
        return True

    def _loaded_by_parts(self, newcomer: Member, got: Loaded) -> dict[str, int]:
        """The ``device_bytes`` of a newcomer's resync that loaded by parts (``got``: its host's
        answer), kept for its :class:`FailoverRecord`, as fields for the record of the edge that
        says it holds the weights; empty for a load whole."""
        device = got.device_bytes
        if device is None:
            return {}
        self._device[newcomer.name] = int(device)
        return device_field(int(device))

    async def _refuse_lossy(self, newcomer: Member) -> None:
        """Fail the run rather than rebuild a trainer from a lossy copy (unless allowed)."""
        if self.trainer_lossy and not self.ft.allow_lossy_recovery:
            err = LossyRecoveryRefused(
                f"{newcomer.name}: refusing to rebuild the trainer from rollout weights: "
                f"{self.trainer_class_name}.lossy_state_dict is true (rollouts hold a lossy copy "
                "of the master weights); set fault_tolerance.allow_lossy_recovery or use checkpoint_dir"
            )
            await self.membership.group.fire("fail", reason=str(err), error=err)
            raise err

    async def recover_ranks(self, newcomers: list[Member]) -> None:
        """Replaced trainer ranks (several ranks): :func:`ftstate.controller.ranks.recover_ranks`
        (after a loss, or a drain that moved them)."""
        ms = self.membership
        if ms.weights_version:
            await self._refuse_lossy(newcomers[0])
            if not ms.holders():
                # Rollouts blocked behind a hung rank were suspected too: let them prove their weights.
                await self.watchdog.settle_suspects(done=lambda: bool(ms.holders()))
        await recover_ranks(newcomers, config=self.config, audit=self.audit, membership=ms, calls=self.calls,
                            formation=self.formation, rank_local_calls=self.rank_local_calls,
                            new_optimizer=self._optimizer_policy)

    async def _replay(self, trainer: Member) -> None:
        """Re-run, on the new trainer, the calls made since the last committed sync."""
        calls = list(self.membership.trainer_calls)
        for c in calls:
            await self.calls.call(trainer.name, trainer.handle, UserCall(c.method, tuple(c.args), dict(c.kwargs), True))
        if calls:
            self.audit.record("trainer_replay", member=trainer.name, calls=[c.method for c in calls])

    async def _trainer_without_weights(self, newcomer: Member) -> None:
        # No version was ever committed: the new trainer starts from its own construction,
        # like the first one did, unless a checkpoint is named.
        if self.ft.checkpoint_dir is not None:
            await self._trainer_from_checkpoint(newcomer)
            return
        await newcomer.machine.fire("resync")
        await newcomer.machine.fire("verified", reason="no committed version yet: constructed weights")
        await newcomer.machine.fire("admit")

    async def _trainer_from_checkpoint(self, newcomer: Member) -> None:
        path = self.ft.checkpoint_dir
        if path is None:
            err = MemberLost(newcomer.name, "trainer lost with reverse_weight_sync off and no checkpoint_dir to "
                                            "recover from")
            await self.membership.group.fire("fail", reason=str(err), error=err)
            raise err
        await newcomer.machine.fire("resync", source=path)
        await self.calls.call(newcomer.name, newcomer.handle, UserCall("load_checkpoint", (path,)))
        # Proof, not trust: what the trainer holds now is hashed and matched against the
        # versions this run committed. Only the current one is admitted as is (and the calls
        # since it replayed); an older one would silently roll the run back.
        held = (await self.calls.call(newcomer.name, newcomer.handle, TrainerChecksum())).checksum
        ms = self.membership
        version, expected = ms.weights_version, ms.checksum
        if expected is None or held == expected:
            await newcomer.machine.fire("verified", source=path, checksum=held)
            if expected is not None:
                await self._replay(newcomer)
            await newcomer.machine.fire("admit")
            return
        matches = ms.versions_by_checksum.get(held)
        if not self.ft.allow_checkpoint_rollback:
            err = StaleCheckpointRefused(member=newcomer.name, checkpoint=path, held=held, expected=expected,
                                         current_version=version, matches_version=matches)
            await ms.group.fire("fail", reason=str(err), error=err)
            raise err
        self.audit.record("checkpoint_rollback", member=newcomer.name, checkpoint=path, checksum=held,
                          matches_version=matches, weights_version=version,
                          calls_dropped=[c.method for c in ms.trainer_calls])
        ms.trainer_calls.clear()
        await newcomer.machine.fire("verified", source=path, checksum=held,
                                    reason=f"checkpoint rollback accepted (holds version {matches})")
        await newcomer.machine.fire("admit")

    async def _optimizer_policy(self, newcomer: Member) -> None:
        if self.ft.optimizer_state == "checkpoint":
            await self.calls.call(newcomer.name, newcomer.handle,
                                  UserCall("load_optimizer_checkpoint", (self.ft.checkpoint_dir,)))
        else:
            await self.calls.call(newcomer.name, newcomer.handle, UserCall("reset_optimizer"))


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


def _still_up(newcomer: Member) -> None:
    """A newcomer that died while it was being brought up (its death reached its machine
    between two steps of the round) is the round's MemberLost: the next candidate takes over."""
    if newcomer.gone:
        error = newcomer.machine.error
        raise MemberLost(newcomer.name, error.reason if isinstance(error, MemberLost) else
                         str(error or "died while being brought up"))


async def _constructor_failed(m: Member, exc: WorkerInitError) -> None:
    """A started actor whose user class raised in its constructor: its process lives on (the
    host keeps the error to report it) but it will never serve, so it is LOST with that
    error as its reason, exactly as if the constructor had killed it (the runtime then
    kills the process and the rest follows from LOST)."""
    if m.machine.can("died"):
        await m.machine.fire("died", reason=str(exc), error=exc)
