"""The runtime: what a trainer loop embeds as ``await rt.sync()``.

:class:`Runtime` is the controller. It starts (or joins) a Ray cluster, hosts the rendezvous
store, starts one :class:`~ftstate.worker.host.WorkerHost` actor per trainer and rollout, forms the
weight-sync group, and drives one :class:`~ftstate.core.machine.StateMachine` for the group and
one per worker. Everything that happens to a worker arrives as an event on its machine:
results and failures of actor calls (:mod:`ftstate.controller.calls`), heartbeats and their absence
(:mod:`ftstate.core.liveness`), deadline expiries (the machines' own).

Bounds, all on the controller and all owned by a state's deadline:

- the first rendezvous of a group version waits at most ``init_timeout_s`` for every
  member's group-init (the design verl's maintainers settled on for their issue 6967: a
  bounded wait on the init futures, no watchdog thread inside the workers); on expiry the
  group is FAILED, every actor of the run is killed, the store is closed and
  :class:`~ftstate.core.errors.RendezvousTimeout` names who joined and who did not;
- one ``sync()`` takes at most ``sync_timeout_s``;
- a worker whose heartbeats stop is SUSPECT after one ``heartbeat_interval_s`` (one whose
  transfer stops making progress, after half of ``heartbeat_timeout_s``) and LOST after
  ``heartbeat_timeout_s`` more.

A sync commits in two phases: every rollout stages and verifies the whole version first,
and only when all of them hold it does any of them hand it to ``load_weights``. A failure
before that leaves every rollout on the previous version, which is then still the current
one; routing (``rt.rollout``) only reaches serving rollouts that hold the current version,
and is paused while rollouts commit.

With ``fault_tolerance.enable: false`` a lost member fails the run at once with a
:class:`~ftstate.core.errors.MemberLost` naming it; failover is the job of
:mod:`ftstate.controller.failover`. With it on, a failed sync is tried again only when the
membership changed meanwhile (a loss was replaced or shrunk away; each spends
``max_failovers``) or, at most ``sync_retries`` times, after a transient failure with nobody
lost; anything else (user code raising, bad input) is raised at once with its cause.

The runtime composes the controller's parts around one shared
:class:`~ftstate.controller.membership.Membership`; it owns the lifecycle, the retry policy
and what happens when a member is lost. Checking its arguments, the run's first record and
the first rendezvous are :mod:`ftstate.controller.startup`. It runs in the driver process (the
trainer loop's), on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ftstate.controller.backend import ClusterBackend
from ftstate.controller.calls import ActorCalls
from ftstate.controller.chaos import Chaos
from ftstate.controller.collector import CollectorPause
from ftstate.controller.drain import Drainer, DrainRecord
from ftstate.controller.failover import Failover
from ftstate.controller.formation import GroupFormation
from ftstate.controller.launcher import ActorLauncher
from ftstate.controller.losses import Losses
from ftstate.controller.membership import GONE, GROUP, Member, Membership
from ftstate.controller.nodecopies import NodeCopies
from ftstate.controller.notices import NoticeMonitor
from ftstate.controller.parts import ControllerParts
from ftstate.controller.progress import Progress
from ftstate.controller.ranks import ShardedSync, form_trainer_group
from ftstate.controller.resync import Resync
from ftstate.controller.routing import Router
from ftstate.controller.scaling import Scaler, ScaleRecord
from ftstate.controller.startup import check_arguments, first_rendezvous, run_facts
from ftstate.controller.sync import SyncReport, WeightSync
from ftstate.controller.watchdog import Watchdog
from ftstate.core.audit import AuditTrail
from ftstate.core.budget import FAILOVER_KEY
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import (
    FTError,
    MemberLost,
    SyncTimeout,
    TransportError,
    UsageError,
)
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec
from ftstate.core.worker import RolloutWorker, TrainerWorker

__all__ = ["GROUP", "MemberInfo", "Runtime", "SyncReport", "run_facts"]


@dataclasses.dataclass(frozen=True)
class MemberInfo:
    """One worker as ``rt.members()`` reports it. node: its node's address; node_id: Ray's id
    of the node (what tells nodes apart when they share an address). reserved_bytes: a
    spare's staging buffer, allocated and touched for the next transfer to it (0: none yet;
    a spare promoted before it has one stages into fresh memory, the slow path)."""

    member: str
    role: str
    rank: int
    state: str
    weights_version: int
    group_version: int
    pid: int | None
    node: str | None
    node_id: str | None = None
    reserved_bytes: int = 0


class Runtime:
    """The controller of one run.

    config: the run's :class:`~ftstate.core.config.RuntimeConfig`. trainer / rollout: the user's
    worker classes; *_args / *_kwargs: their constructor arguments. run_id: names the
    run's actors (``ftstate-{run_id}-{member}``); a random one by default. audit: a trail to
    write to (default: one at ``config.audit_log``, or in memory). backend: the cluster the
    workers run on (:mod:`~ftstate.controller.backend`; default: Ray's,
    :class:`~ftstate.controller.ray.backend.RayBackend`; a
    :class:`~ftstate.simulation.cluster.SimulatedCluster` runs the same controller against
    simulated members).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        trainer: type[TrainerWorker],
        rollout: type[RolloutWorker],
        trainer_args: Sequence[Any] = (),
        trainer_kwargs: Mapping[str, Any] | None = None,
        rollout_args: Sequence[Any] = (),
        rollout_kwargs: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        audit: AuditTrail | None = None,
        backend: ClusterBackend | None = None,
    ) -> None:
        check_arguments(config, trainer, rollout, trainer_args, trainer_kwargs, rollout_args, rollout_kwargs,
                        run_id, audit, backend)

        self.config = config
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.audit = audit if audit is not None else AuditTrail(config.audit_log, keep=config.audit_records_kept)
        self._classes: dict[str, type] = {"trainer": trainer, "rollout": rollout}
        self._args = {"trainer": (tuple(trainer_args), dict(trainer_kwargs or {})),
                      "rollout": (tuple(rollout_args), dict(rollout_kwargs or {}))}
        if backend is None:
            from ftstate.controller.ray.backend import RayBackend

            backend = RayBackend()
        self.backend = backend
        self._calls = ActorCalls(self._on_died, backend, agent_min_members=config.heartbeat_agent_min_members)
        self._started_ray = False
        self._watch_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sync_lock = asyncio.Lock()
        self._routing_open = asyncio.Event()
        self._routing_open.set()
        self._closed = False
        #: The group machine (None until started).
        self.group: StateMachine | None = None
        # The parts, built at start around one membership (see the package docstring).
        self._membership: Membership | None = None
        self._launcher: ActorLauncher | None = None
        self._node_copies: NodeCopies | None = None
        self._formation: GroupFormation | None = None
        self._watchdog: Watchdog | None = None
        self._failover: Failover | None = None
        self._sync: WeightSync | None = None
        self._router: Router | None = None
        self._chaos: Chaos | None = None
        self._drainer: Drainer | None = None
        self._notices: NoticeMonitor | None = None
        self._scaler: Scaler | None = None
        self._losses: Losses | None = None
        #: Start-up phases as they happen (:mod:`ftstate.controller.progress`): listen to show them.
        self.progress = Progress()

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the cluster (if needed), the store and every actor, and form group version 1.
        On any failure everything started is torn down before the error propagates."""
        if self.group is not None:
            raise UsageError("the runtime is already started; a Runtime runs once (make a new one)")
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        cfg = self.config
        self.progress.report("cluster", f"connecting to Ray ({cfg.address or 'a local cluster of its own'})")
        self._started_ray = self.backend.connect(cfg.address)
        node = self.backend.node_address()
        facts = run_facts(cfg, node, self.backend)
        self.audit.begin_run(self.run_id, **facts)
        cpus = sum(float(n.rsplit("CPU=", 1)[1]) for n in facts["nodes"] if "CPU=" in n)
        self.progress.report("cluster", f"Ray cluster: {len(facts['nodes'])} node(s), {cpus:g} CPUs",
                             nodes=len(facts["nodes"]), cpus=cpus)
        workers = cfg.trainer_workers + cfg.rollout_workers
        processes = workers + (cfg.spares("trainer") + cfg.spares("rollout")
                               if cfg.fault_tolerance.enable and cfg.fault_tolerance.mode == "standby" else 0)
        if self.progress.check_capacity(processes, cpus):
            self.audit.record("oversubscribed", processes=processes, cpus=cpus,
                              reason=self.progress.last.message if self.progress.last else "")
        self.group = StateMachine(get_spec("group"), member="group", config=cfg, audit=self.audit)
        self.group.bind(node=node, node_id=self.backend.node_id())  # the group's records: the controller's node
        ms = self._membership = Membership(self.group)
        self._launcher = ActorLauncher(run_id=self.run_id, config=cfg, audit=self.audit, membership=ms,
                                       classes=self._classes, args=self._args,
                                       on_transition=self._on_worker_transition, backend=self.backend)
        self._formation = GroupFormation(config=cfg, audit=self.audit, membership=ms, calls=self._calls, host=node,
                                         store=self.backend.rendezvous_store(node))
        self._watchdog = Watchdog(config=cfg, membership=ms, calls=self._calls)
        trainer_cls = self._classes["trainer"]
        self._node_copies = NodeCopies(run_id=self.run_id, config=cfg, audit=self.audit, calls=self._calls,
                                        backend=self.backend) \
            if cfg.staging == "node" and cfg.trainer_workers == 1 else None
        parts = ControllerParts(config=cfg, audit=self.audit, membership=ms, calls=self._calls,
                                launcher=self._launcher, formation=self._formation, watchdog=self._watchdog,
                                node_copies=self._node_copies)
        resyncer = Resync(parts, trainer_lossy=bool(getattr(trainer_cls, "lossy_state_dict", False)),
                          trainer_class_name=trainer_cls.__name__,
                          rank_local_calls=bool(getattr(trainer_cls, "rank_local_calls", False)))
        self._failover = Failover(parts, resyncer=resyncer)
        self._sync = (ShardedSync if cfg.trainer_workers > 1 else WeightSync)(
            parts, routing_open=self._routing_open, raise_if_failed=self._raise_if_failed)
        self._router = Router(parts, routing_open=self._routing_open, recover=self._recover, settle=self._settle,
                              failover_pending=lambda: self.failover_pending,
                              raise_if_failed=self._raise_if_failed)
        self._chaos = Chaos(ms, self.audit)
        self._drainer = Drainer(parts, failover=self._failover, pause_trainer=self._router.pause_trainer)
        self._losses = Losses(parts, progress=self.progress, failover=self._failover, drainer=self._drainer,
                              lock=self._sync_lock, spawn=self._spawn, closed=lambda: self._closed, notices=lambda: self._notices,
                              changing=lambda: self._scaler.changing if self._scaler is not None else ())
        self.group.listen(self._losses.group_transition)
        self._scaler = Scaler(parts, failover=self._failover, router=self._router,
                              recover_locked=self._losses.recover_locked)
        self._launcher.make_pools()
        for i in range(cfg.trainer_workers):
            self._launcher.start("trainer", i, f"trainer-{i}")
        for i in range(cfg.rollout_workers):
            self._launcher.start("rollout", cfg.trainer_workers + i, f"rollout-{i}")
        await first_rendezvous(config=cfg, membership=ms, formation=self._formation, launcher=self._launcher,
                               calls=self._calls, progress=self.progress,
                               start_spares=self._failover.spares.start_spares, recover=self._recover)
        if cfg.trainer_workers > 1:
            await form_trainer_group(membership=ms, formation=self._formation, calls=self._calls, audit=self.audit,
                                     timeout_s=cfg.init_timeout_s)
        self._watch_task = asyncio.get_running_loop().create_task(self._watchdog.run())
        if cfg.fault_tolerance.detect_node_maintenance:
            self._notices = NoticeMonitor(parts, drain=self._drain_for_notice, withdraw=self._drainer.withdraw,
                                          backend=self.backend)
            await self._notices.start()

    async def close(self) -> None:
        """Stop the watchdog, kill every actor of the run, close the store; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        if self._notices is not None:
            await self._notices.close()
        if self._failover is not None:
            await self._failover.spares.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        members = list(self._membership) if self._membership is not None else []
        machines = [m.machine for m in members] + ([self.group] if self.group else [])
        for machine in machines:
            if not machine.terminal and machine.can("stop"):
                await machine.fire("stop", reason="runtime closed")
            machine.close()
        if self._node_copies is not None:  # before the members go: nothing is left to adopt them
            await self._node_copies.close()
        if self._launcher is not None:
            self._launcher.close()
        from ftstate.transport.shm import sweep_orphans

        sweep_orphans()  # a sender killed between making its segments and its readers mapping them
        if self._chaos is not None:
            self._chaos.release()
        if self._formation is not None:
            self._formation.close()
        self.audit.close()
        self.backend.close()  # the node agents it started for the heartbeats
        if self._started_ray:
            self.backend.shutdown()

    # -- sync ------------------------------------------------------------------------------

    async def sync(self) -> SyncReport:
        """Push the trainer's ``state_dict()`` to every rollout as the next weights version.

        Bounded by ``sync_timeout_s``. Returns a :class:`SyncReport`; raises
        :class:`~ftstate.core.errors.MemberLost` if a member died (fault tolerance off), a
        :class:`~ftstate.core.errors.TransportError` if the transfer failed, or
        :class:`~ftstate.core.errors.SyncTimeout`. On failure every rollout keeps the version it had.
        Once every rollout staged and verified the new version it is committed: a rollout
        whose own ``load_weights`` then raises is left STALE (serving nothing until a later
        sync brings it up to date), the others serve the new version, and its exception is
        raised to the caller.

        With fault tolerance on, a failed attempt is made again after a loss that was
        replaced (or shrunk away), and at most ``sync_retries`` times after a transient
        failure with nobody lost; any other error is raised at once, from the member that
        caused it (a receiver's own exception, not the sender's broken connection).

        The process's garbage collector is paused while it runs, at most ``gc_pause_s``
        (:mod:`~ftstate.controller.collector`).
        """
        self._raise_if_failed()
        ms, _, _, watchdog, failover, weight_sync = self._parts()
        loop = asyncio.get_running_loop()
        async with self._sync_lock, CollectorPause(self.config.gc_pause_s):
            before = len(failover.records)
            t0 = loop.time()
            transient = 0
            def can_sync() -> bool:
                # The trainer is not suspect and some rollout can receive: a sync called while
                # every rollout is suspect (hung, or blocked behind a hung peer) waits for them
                # to prove their weights or be declared LOST and replaced, instead of failing
                # with NoServingWorkers a moment before the watchdog would have decided.
                return (all(m.machine.state != "SUSPECT" for m in ms.role("trainer"))
                        and any(m.machine.state in ("READY", "STALE") for m in ms.role("rollout")))

            while True:
                await watchdog.settle_suspects(done=can_sync)
                await self._require_losses().recover_locked()
                await watchdog.settle_suspects(done=can_sync)
                epoch = ms.epoch
                try:
                    report = await weight_sync.attempt()
                except (MemberLost, TransportError) as exc:
                    if not self.config.fault_tolerance.enable or self._require_losses().failure is not None:
                        raise
                    self._raise_if_failed()
                    # A member the failure names that is neither dead nor answering (its node's
                    # raylet is gone, it is hung) is not retried around: its verdict is the
                    # watchdog's (LOST, then replaced; or alive again), bounded by its deadlines.
                    unsettled = self._unsettled([exc, *weight_sync.failures.values()])
                    if unsettled:
                        await watchdog.verdict(unsettled)
                        self._raise_if_failed()
                    membership_changed = ms.epoch != epoch or failover.pending
                    if not membership_changed:
                        transient += 1
                        if transient > self.config.sync_retries:
                            self.audit.record("sync_gave_up", reason=f"{type(exc).__name__}: {exc}",
                                              retries=self.config.sync_retries,
                                              weights_version=ms.weights_version, group_version=ms.group_version)
                            raise
                    if loop.time() - t0 > self.config.sync_timeout_s:
                        raise SyncTimeout(
                            f"weight sync to version {ms.weights_version + 1} (with failovers)",
                            key="sync_timeout_s", seconds=self.config.sync_timeout_s,
                            group_version=ms.group_version,
                        ) from exc
                    self.audit.record("sync_retry", reason=f"{type(exc).__name__}: {exc}",
                                      membership_changed=bool(membership_changed), transient_retries=transient,
                                      weights_version=ms.weights_version, group_version=ms.group_version)
                    continue
                failover.resyncer.weights_bytes = report.nbytes
                if self.config.fault_tolerance.enable and self.config.fault_tolerance.mode == "standby":
                    self._spawn(failover.spares.weights_sized(report.nbytes))
                stale = f", {len(report.stale)} stale" if report.stale else ""
                self.progress.report("sync", f"weights version {report.weights_version} synced to "
                                     f"{len(report.rollouts)} rollouts in {report.seconds:.3f}s{stale}",
                                     weights_version=report.weights_version, rollouts=len(report.rollouts),
                                     seconds=round(report.seconds, 6), retries=transient)
                return dataclasses.replace(report, failovers=len(failover.records) - before)

    def _unsettled(self, errors: Sequence[BaseException]) -> list[Member]:
        """Members that ``errors`` say were lost (``MemberLost``) but that are not gone: the
        call found them unreachable, or they stopped answering, and nobody declared them LOST."""
        ms = self._require_membership()
        names = dict.fromkeys(e.member for e in errors if isinstance(e, MemberLost))
        return [m for n in names if (m := ms.find(n)) is not None and not m.gone]

    # -- recovery ----------------------------------------------------------------------------

    async def _recover(self) -> None:
        await self._require_losses().recover()


    @property
    def failover_budget(self) -> dict[str, Any]:
        """The failover budget now (:meth:`ftstate.core.budget.Budget.state`): spent in all and
        inside ``failover_window_s``, the limits, slots replaced more than once, node strikes,
        quarantined nodes. Each :class:`~ftstate.controller.failover.FailoverRecord` keeps it
        as it was after that failover."""
        group = self._require_group()
        return group.budget(FAILOVER_KEY).state(group.clock.now())

    async def _settle(self) -> None:
        """Until the trainer is not suspect and some rollout serves, or suspects are declared
        LOST (bounded by heartbeat_timeout_s plus an interval; see Watchdog.settle_suspects)."""
        ms, _, _, watchdog, _, _ = self._parts()
        await watchdog.settle_suspects(done=lambda: all(m.machine.state != "SUSPECT" for m in ms.role("trainer"))
                                       and bool(ms.serving_rollouts()))


    # -- calls -------------------------------------------------------------------------------

    async def rollout(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rollout that serves the current weights version; returns
        their results in rank order. Raises :class:`~ftstate.core.errors.NoServingWorkers` when none does.
        With fault tolerance on, a call cut short by a lost rollout is made again once the
        failover completed."""
        return await self._require_router().rollout(method, args, kwargs)

    async def trainer(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the current trainer. With fault tolerance on, a call cut short by
        the trainer's loss is made again on its replacement (so the loop never sees it)."""
        return await self._require_router().trainer(method, args, kwargs)

    async def rollout_map(self, method: str, items: Sequence[Any], *args: Any, versions: bool = False) -> list[Any]:
        """Deal ``items`` over the rollouts serving the current weights (item ``i`` to the
        ``i mod n``-th), call ``method(*args, shard)`` on each, and return one result per item,
        in item order (``method`` must answer each shard with one result per item, in order).
        A rollout dealt no item (fewer items than rollouts) is not called: ``method`` never
        gets an empty shard, and no items at all calls nobody. If several rollouts raise, the
        error names every one of them.
        With fault tolerance on, the shard of a rollout lost mid-call is dealt again over the
        rollouts serving once the failover completed; with it off, the loss is raised.
        ``versions``: each result is a :class:`~ftstate.core.protocol.Versioned`, with the weights
        versions its call ran under (more than one when it swapped at a safe point). With
        ``rollout_updates: in_flight`` the rollouts dealt to include those at most
        ``max_staleness`` versions behind."""
        return await self._require_router().rollout_map(method, items, args, versions)

    def serving_rollouts(self) -> list[str]:
        """Rollouts in a serving state holding the current weights version, in rank order."""
        return self._require_membership().serving_rollouts()

    # -- scaling -------------------------------------------------------------------------

    async def add_rollouts(self, n: int, *, nodes: Sequence[str] | None = None) -> list[str]:
        """Start ``n`` more rollouts while the run goes and return their names, once each serves.

        They are placed by the rollout role's placement (its labels and resources), on the Ray
        nodes ``nodes`` only when it is given (a node that joined the cluster: :meth:`nodes`
        says which there are; a node id that is not alive, that the failover avoids or that
        cannot hold a rollout is refused with :class:`~ftstate.core.errors.ScaleRefused` before
        anything changes; a named node that stays full fails the addition at ``init_timeout_s``,
        undone). Each is
        fed the current committed weights version from rollouts that hold it (through the node
        copy on its node, or point to point), never from the trainer while a rollout holds it;
        each is admitted to serving only once its own checksum of what it holds matches. Before
        any sync (or with no rollout holding the version) a newcomer waits STALE and the next
        sync brings it up to date. Spends nothing of the failover budget; a newcomer lost while
        brought up is started again (at most ``fault_tolerance.spare_start_attempts`` times).
        A sync called meanwhile waits for the addition, then reaches the newcomers too. Each
        newcomer's start is bounded by ``init_timeout_s``, its transfer by ``sync_timeout_s``;
        an addition that fails is undone (none of its newcomers stays) and raises.
        :mod:`ftstate.controller.scaling` has the whole procedure."""
        return await self._scale(lambda scaler: scaler.add(n, nodes), recover_first=True)

    async def remove_rollouts(self, names: Sequence[str]) -> None:
        """Take the rollouts ``names`` out of the fleet: out of serving first (routing deals them
        nothing new), then, once the calls they run ended (at most ``remove_calls_timeout_s``;
        a call still running then ends with MemberLost and, with fault tolerance on, is dealt
        again over the serving rollouts), out of the group, and then their processes stop.
        Spends nothing of the failover budget. Refuses with
        :class:`~ftstate.core.errors.ScaleRefused`, before changing anything, to leave fewer
        than ``fault_tolerance.min_rollout_workers`` rollouts or to remove a name that is not a
        rollout of the fleet."""
        await self._scale(lambda scaler: scaler.remove(list(names) if not isinstance(names, str) else names))

    async def scale_rollouts(self, n: int) -> ScaleRecord | None:
        """Grow or shrink the fleet to ``n`` live rollouts (:meth:`add_rollouts` /
        :meth:`remove_rollouts`; the newest go first, those not serving before them). Returns
        the change's :class:`~ftstate.controller.scaling.ScaleRecord` (None: it had ``n``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            from ftstate.core.errors import ScaleRefused

            raise ScaleRefused(field="n", expected="a rollout count (an int >= 0)", got=repr(n))
        live = self._require_membership().live("rollout")
        if n > len(live):
            await self.add_rollouts(n - len(live))
        elif n < len(live):
            order = sorted(live, key=lambda m: (m.machine.serving, -m.rank))
            await self.remove_rollouts([m.name for m in order[:len(live) - n]])
        else:
            return None
        return self.scalings[-1]

    @property
    def scalings(self) -> list[ScaleRecord]:
        """Every change of the fleet so far (:class:`~ftstate.controller.scaling.ScaleRecord`);
        none is a failover and none spent budget."""
        return list(self._scaler.records) if self._scaler is not None else []

    async def _scale(self, change: Any, *, recover_first: bool = False) -> Any:
        self._raise_if_failed()
        assert self._scaler is not None
        async with self._sync_lock:
            if recover_first:  # a loss before an addition is replaced first (a removal may take it away instead)
                await self._require_losses().recover_locked()
            result = await change(self._scaler)
        if self._failover is not None and self._failover.pending:  # a loss the change left to the failover
            self._spawn(self._require_losses().recover_in_background())
        if self._notices is not None:  # newcomers may have landed on nodes not watched yet
            self._spawn(self._notices.watch_nodes())
        return result

    # -- maintenance ---------------------------------------------------------------------

    async def drain(self, node_id: str, *, reason: str = "requested", deadline: float | None = None,
                    source: str = "api", kind: str = "drain") -> DrainRecord:
        """Move every member off node ``node_id`` (Ray's node id) before it goes: each keeps
        serving (DRAINING) until a replacement on another node holds the current weights,
        then it is retired. ``deadline``: wall-clock epoch seconds by which the node goes.
        Not a failover: spends nothing of ``max_failovers``. What a maintenance notice does
        (``detect_node_maintenance``); callable directly by an operator or a scheduler.
        Returns the :class:`~ftstate.controller.drain.DrainRecord` (``outcome`` drained,
        failed or cancelled); a drain that cannot finish is undone, never half done."""
        if not isinstance(node_id, str) or not node_id:
            raise TypeError(f"node_id must be a Ray node id (a non-empty str), got {node_id!r}")
        self._raise_if_failed()
        assert self._drainer is not None
        async with self._sync_lock:
            self._raise_if_failed()
            record = await self._drainer.drain(node_id, source=source, kind=kind, reason=reason, deadline=deadline)
        if self._notices is not None:
            self._spawn(self._notices.watch_nodes())
        return record

    @property
    def drains(self) -> list[DrainRecord]:
        """Every drain so far (they are not failovers and spend no budget)."""
        return list(self._drainer.records) if self._drainer is not None else []

    async def _drain_for_notice(self, node_id: str, notice: Any) -> bool:
        with contextlib.suppress(FTError):  # a failed run: recorded already; the notice changes nothing
            record = await self.drain(node_id, reason=notice.raw or f"{notice.source} {notice.kind}",
                                      deadline=notice.deadline, source=notice.source, kind=notice.kind)
            return record.outcome == "drained"
        return False

    # -- reading ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._require_group().state

    @property
    def weights_version(self) -> int:
        return self._require_group().weights_version

    @property
    def group_version(self) -> int:
        return self._require_group().group_version

    @property
    def checksum(self) -> str | None:
        """Checksum of the current weights version (None before the first sync)."""
        return self._membership.checksum if self._membership is not None else None

    @property
    def chaos(self) -> Chaos:
        """Fault injection for tests, benchmarks and the demo (``rt.chaos.kill("rollout", 1)``)."""
        if self._chaos is None:
            raise UsageError("the runtime is not started: use `async with Runtime(...)` or `await rt.start()`")
        return self._chaos

    def members(self) -> list[MemberInfo]:
        """Every worker the run started (spares have rank -1), group members first by rank."""
        members = list(self._membership) if self._membership is not None else []
        return [
            MemberInfo(m.name, m.role, m.rank, m.machine.state, m.machine.weights_version,
                       m.machine.group_version, m.pid, m.node, m.node_id, m.reserved_bytes)
            for m in sorted(members, key=lambda m: (m.rank < 0, m.rank, m.name))
        ]

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's alive nodes, ``{node_id, address, resources, labels, members}``
        (``members``: the live workers of this run there, by name): how a loop sees a node that
        joined (the autoscaler, ``ray start``) and gives it rollouts with
        ``add_rollouts(n, nodes=[node_id])``."""
        on: dict[str, list[str]] = {}
        for m in (self._membership or ()):
            if m.node_id and m.machine.state not in GONE:
                on.setdefault(m.node_id, []).append(m.name)
        return [{**node, "members": sorted(on.get(node["node_id"], []))} for node in self.backend.nodes()]

    def handle(self, member: str) -> Any:
        """The Ray actor handle of a member (tests and chaos use it)."""
        return self._require_membership().get(member).handle

    @property
    def failovers(self) -> list[Any]:
        """Every failover so far (:class:`~ftstate.controller.failover.FailoverRecord`)."""
        return list(self._failover.records) if self._failover is not None else []

    @property
    def failover_pending(self) -> bool:
        """Whether a loss waits for its failover (the next sync or call that needs the member runs it)."""
        return self._failover is not None and self._failover.pending

    def _parts(self) -> tuple[Membership, GroupFormation, ActorLauncher, Watchdog, Failover, WeightSync]:
        ms = self._require_membership()
        assert self._formation and self._launcher and self._watchdog and self._failover and self._sync
        return ms, self._formation, self._launcher, self._watchdog, self._failover, self._sync

    def _require_membership(self) -> Membership:
        if self._membership is None:
            raise UsageError("the runtime is not started: use `async with Runtime(...)` or `await rt.start()`")
        return self._membership

    def _require_group(self) -> StateMachine:
        return self._require_membership().group

    def _require_router(self) -> Router:
        self._require_membership()
        assert self._router is not None
        return self._router

    def _require_losses(self) -> Losses:
        self._require_membership()
        assert self._losses is not None
        return self._losses

    def _raise_if_failed(self) -> None:
        self._require_losses().raise_if_failed()


    # -- failures ------------------------------------------------------------------------

    async def _on_died(self, member: str, reason: str) -> None:
        m = self._membership.find(member) if self._membership is not None else None
        if m is not None and m.machine.can("died"):
            lost = MemberLost(member, reason, group_version=m.machine.group_version)
            await m.machine.fire("died", reason=reason, error=lost)

    def _on_worker_transition(self, machine: StateMachine, src: str, dest: str, trigger: str) -> None:
        if self._losses is not None:  # built with the other parts, before any worker moves
            self._losses.worker_transition(machine, src, dest, trigger)


    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
