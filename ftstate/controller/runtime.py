"""The runtime: what a trainer loop embeds as ``await rt.sync()``.

:class:`Runtime` is the controller. It starts (or joins) a Ray cluster, hosts the rendezvous
store, starts one :class:`~ftstate.controller.host.WorkerHost` actor per trainer and rollout, forms the
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
:class:`~ftstate.core.errors.MemberLost` naming it; failover is the job of :mod:`ftstate.controller.failover`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ftstate.controller import cluster
from ftstate.controller.calls import ActorCalls
from ftstate.controller.failover import Failover
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import (
    ChecksumMismatch,
    FTError,
    InvalidTransition,
    MemberLost,
    NoServingWorkers,
    SyncTimeout,
    TransportError,
)
from ftstate.core.liveness import Heartbeat, Liveness
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec
from ftstate.core.worker import RolloutWorker, TrainerWorker

#: The weight-sync group's name (its store keys live under ``weights/v{N}``).
GROUP = "weights"
_GONE = frozenset({"LOST", "RETIRED", "FAILED", "STOPPED"})


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What one ``sync()`` did.

    weights_version: the version every serving rollout now holds; checksum: its whole-state
    checksum; nbytes: bytes sent per receiver; seconds: wall time; failovers: failovers this
    sync needed; group_version: the membership version it ran under; rollouts: who got it.
    """

    weights_version: int
    checksum: str
    nbytes: int
    seconds: float
    failovers: int
    group_version: int
    rollouts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MemberInfo:
    """One worker as ``rt.members()`` reports it."""

    member: str
    role: str
    rank: int
    state: str
    weights_version: int
    group_version: int
    pid: int | None
    node: str | None


@dataclasses.dataclass(eq=False)
class _Member:
    name: str
    role: str
    rank: int
    machine: StateMachine
    handle: Any
    liveness: Liveness
    pool: str = ""
    slot: int = 0
    pid: int | None = None
    node: str | None = None


class Runtime:
    """The controller of one run.

    config: the run's :class:`~ftstate.core.config.RuntimeConfig`. trainer / rollout: the user's
    worker classes; *_args / *_kwargs: their constructor arguments. run_id: names the
    run's actors (``ftstate-{run_id}-{member}``); a random one by default. audit: a trail to
    write to (default: one at ``config.audit_log``, or in memory).
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
    ) -> None:
        if not (isinstance(trainer, type) and issubclass(trainer, TrainerWorker)):
            raise TypeError(f"trainer must be a TrainerWorker subclass, got {trainer!r}")
        if not (isinstance(rollout, type) and issubclass(rollout, RolloutWorker)):
            raise TypeError(f"rollout must be a RolloutWorker subclass, got {rollout!r}")
        if config.trainer_workers != 1:
            from ftstate.core.errors import ConfigError

            raise ConfigError(
                "trainer_workers",
                f"this release drives exactly one trainer in the weight-sync group, got {config.trainer_workers}",
            )
        if config.fault_tolerance.detect_node_maintenance:
            from ftstate.core.errors import ConfigError

            # Refused rather than ignored: a run configured to drain nodes before maintenance
            # must not silently run without it.
            raise ConfigError(
                "fault_tolerance.detect_node_maintenance",
                "the maintenance watcher is not part of this release; set it to false",
            )
        self.config = config
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.audit = audit if audit is not None else AuditTrail(config.audit_log)
        self._classes = {"trainer": trainer, "rollout": rollout}
        self._args = {"trainer": (tuple(trainer_args), dict(trainer_kwargs or {})),
                      "rollout": (tuple(rollout_args), dict(rollout_kwargs or {}))}
        self._members: dict[str, _Member] = {}
        #: Trainer calls since the last committed sync: replayed on a replacement trainer that
        #: recovered the last committed weights, so no step is lost (user methods must be
        #: deterministic given their arguments for the replay to reproduce them).
        self._trainer_calls: list[tuple[str, Any, Any]] = []
        self._pools: dict[str, Any] = {}
        self._calls = ActorCalls(self._on_died)
        self._store: Any = None
        self._node: str | None = None
        self._started_ray = False
        self._watchdog: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sync_lock = asyncio.Lock()
        self._routing_open = asyncio.Event()
        self._routing_open.set()
        self._failure: FTError | None = None
        self._checksum: str | None = None
        self._closed = False
        self.group: StateMachine | None = None
        self._failover = Failover(self)
        #: Fault injection for tests, benchmarks and the demo (``rt.chaos.kill("rollout", 1)``).
        self.chaos = Chaos(self)

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the cluster (if needed), the store and every actor, and form group version 1.
        On any failure everything started is torn down before the error propagates."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        self._started_ray = cluster.connect(self.config.address)
        from ftstate.transport import StoreServer

        self._node = cluster.node_address()
        self._store = StoreServer(host=self._node)
        self.group = StateMachine(get_spec("group"), member="group", config=self.config, audit=self.audit)
        self.group.listen(self._on_group_transition)
        self._make_pools()
        self._add_member("trainer", 0, "trainer-0")
        for i in range(self.config.rollout_workers):
            self._add_member("rollout", i + 1, f"rollout-{i}")
        self._failover.start_spares()  # they warm up while the group forms
        await self._rendezvous()
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def _liveness(self) -> Liveness:
        cfg = self.config
        return Liveness(max(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s / 2), cfg.heartbeat_timeout_s)

    def _make_pools(self) -> None:
        from ftstate.controller.placement import ResourcePool

        cfg, ft = self.config, self.config.fault_tolerance
        sizes = {"trainer": cfg.trainer_workers, "rollout": cfg.rollout_workers}
        if ft.enable and ft.mode == "standby":
            sizes[ft.standby_resource_pool] = 2 * ft.standby_workers
        for name, slots in sizes.items():
            self._pools[name] = ResourcePool(self.run_id, name, slots, cpus=cfg.worker_cpus, gpus=cfg.worker_gpus)

    def _add_member(self, role: str, rank: int, name: str, pool: str | None = None) -> _Member:
        import ray

        from ftstate.controller.host import WorkerHost

        machine = StateMachine(get_spec("worker"), member=name, role=role, rank=rank, config=self.config, audit=self.audit)
        machine.listen(self._on_worker_transition)
        args, kwargs = self._args[role]
        resource_pool = self._pools[pool or role]
        slot = resource_pool.take()
        actor_cls = ray.remote(WorkerHost)
        handle = actor_cls.options(
            name=f"ftstate-{self.run_id}-{name}",
            namespace="ftstate",
            max_restarts=0,
            max_concurrency=64,
            **resource_pool.options(slot),
        ).remote(name, role, self._classes[role], args, kwargs, self.config.backend,
                 int(self.config.bucket_size_mb * 2**20))
        member = _Member(name, role, rank, machine, handle, self._liveness(),
                         pool=resource_pool.name, slot=slot)
        self._members[name] = member
        return member

    async def close(self) -> None:
        """Stop the watchdog, kill every actor of the run, close the store; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await self._failover.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        machines = [m.machine for m in self._members.values()] + ([self.group] if self.group else [])
        for machine in machines:
            if not machine.terminal and machine.can("stop"):
                await machine.fire("stop", reason="runtime closed")
            machine.close()
        self._kill_all()
        self.chaos.release()
        for pool in self._pools.values():
            with contextlib.suppress(Exception):  # the cluster may be gone already
                pool.remove()
        self._pools.clear()
        if self._store is not None:
            self._store.close()
            self._store = None
        self.audit.close()
        if self._started_ray:
            cluster.shutdown()

    def _kill_all(self) -> None:
        for m in self._members.values():
            self._kill(m)

    def _kill(self, m: _Member) -> None:
        """Kill a member's process. A hung one must not linger holding its group sockets (its
        peers would block on it): on this node it gets SIGKILL at once, because ray.kill of a
        stopped process waits for a graceful exit that never comes; elsewhere ray.kill."""
        import os
        import signal

        import ray

        if m.pid and m.node == self._node and m.pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(m.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(m.handle, no_restart=True)

    # -- the group ---------------------------------------------------------------------

    async def _rendezvous(self) -> None:
        group = self._require_group()
        group.group_version += 1
        version = group.group_version
        members = self._group_members()
        await group.fire("start")
        for m in members:
            m.machine.group_version = version
            await m.machine.fire("join")
        host, port = self._store.address.host, self._store.address.port
        by_rank = {m.rank: m.name for m in members}

        def arrived() -> list[str]:
            # Who registered in the store for this version: the transport's own record.
            try:
                ranks = self._store.arrived(GROUP, version)
            except Exception:  # noqa: BLE001 - the store is the controller's; report what we can
                ranks = []
            return [by_rank[r] for r in ranks if r in by_rank]

        def missing() -> list[str]:
            here = set(arrived())
            return [m.name for m in members if m.name not in here]

        async def join(m: _Member) -> None:
            info = await self._calls.call(m.name, m.handle, "info")
            m.pid, m.node = info["pid"], info["node"]
            m.machine.bind(pid=m.pid, node=m.node)
            await self._calls.call(
                m.name, m.handle, "join", host, port, GROUP, version, m.rank, len(members), self.config.init_timeout_s
            )

        group.describe_wait(f"rendezvous of group {GROUP!r}", missing=missing, arrived=arrived)
        async with group.deadline_scope():
            await asyncio.gather(*(pool.ready() for pool in self._pools.values()))
            joins = [asyncio.ensure_future(join(m)) for m in members]
            try:
                await asyncio.gather(*joins)
                lost_before_forming = False
            except MemberLost:
                # Replaced only if it really died (LOST, and perhaps already being replaced by
                # the failover its death started), not if it merely failed to answer.
                died = any(m.machine.state in ("LOST", "RETIRED") for m in members)
                if not (self.config.fault_tolerance.enable and died):
                    raise
                lost_before_forming = True
        if lost_before_forming:
            # Fault tolerance on and a member died before version 1 formed: the failover
            # replaces it and forms the next version with everyone (its fence releases the
            # survivors still waiting in this one), spending one of max_failovers.
            async with self._sync_lock:
                await self._recover_locked()
        else:
            await group.fire("rendezvous_done")
        # What the survivors' abandoned joins of this version said no longer matters.
        await asyncio.gather(*joins, return_exceptions=True)
        for m in members:
            if m.machine.state != "RENDEZVOUS":
                continue  # lost and replaced (its replacement was taken through the failover)
            if m.role == "trainer":
                await m.machine.fire("joined_as_source")
                await m.machine.fire("admit")
            else:
                await m.machine.fire("joined")

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
        """
        self._raise_if_failed()
        async with self._sync_lock:
            before = len(self._failover.records)
            t0 = asyncio.get_running_loop().time()
            while True:
                await self._settle_suspects()
                await self._recover_locked()
                await self._settle_suspects()
                try:
                    report = await self._sync()
                except (MemberLost, TransportError) as exc:
                    if not self.config.fault_tolerance.enable or self._failure is not None:
                        raise
                    self._raise_if_failed()
                    spent = asyncio.get_running_loop().time() - t0
                    if spent > self.config.sync_timeout_s:
                        raise SyncTimeout(
                            f"weight sync to version {self.weights_version + 1} (with failovers)",
                            key="sync_timeout_s", seconds=self.config.sync_timeout_s,
                            group_version=self.group_version,
                        ) from exc
                    self.audit.record("sync_retry", reason=f"{type(exc).__name__}: {exc}",
                                      weights_version=self.weights_version, group_version=self.group_version)
                    continue
                return dataclasses.replace(report, failovers=len(self._failover.records) - before)

    async def _settle_suspects(self, done: Any = None) -> None:
        """Resolve suspects now rather than at the watchdog's pace: members that were only
        blocked behind a hung peer answer again and prove their weights (verified), while a
        hung one runs into its SUSPECT deadline (LOST, then a failover). Polls until no member
        is suspect or ``done()`` holds (default: the trainer is not suspect; suspect rollouts
        are simply left out of a sync), for at most ``heartbeat_timeout_s`` plus an interval."""
        loop = asyncio.get_running_loop()
        interval = self.config.heartbeat_interval_s
        until = loop.time() + self.config.heartbeat_timeout_s + interval
        if done is None:
            def done() -> bool:
                return all(m.machine.state != "SUSPECT" for m in self._role("trainer"))
        while True:
            suspects = [m for m in self._group_members() if m.machine.state == "SUSPECT"]
            if not suspects:
                return
            await asyncio.gather(*(self._poll(m, loop.time()) for m in suspects), return_exceptions=True)
            if done() or loop.time() > until:
                return
            await asyncio.sleep(interval)

    async def _recover_locked(self) -> None:
        """Run pending failovers (the caller holds the membership lock)."""
        if self._failover.pending:
            try:
                await self._failover.recover()
            except FTError as exc:
                self._failure = self._failure or exc
                # Fail the group now, with the error that ended the failover: waiting for
                # PROMOTING's deadline would only hide the cause behind a FailoverTimeout.
                group = self._require_group()
                with contextlib.suppress(InvalidTransition):  # failed meanwhile by its own path
                    await group.fire("fail", reason=f"failover failed: {exc}", error=exc)
                raise
        self._raise_if_failed()

    async def _recover_in_background(self) -> None:
        async with self._sync_lock:
            with contextlib.suppress(FTError):  # recorded in self._failure; callers see it
                await self._recover_locked()

    def _group_members(self) -> list[_Member]:
        """The members of the weight-sync group (not spares, not the lost), by rank."""
        return sorted((m for m in self._members.values() if m.rank >= 0 and m.machine.state not in _GONE
                       and m.machine.state != "STANDBY"), key=lambda m: m.rank)

    async def _reform(self) -> None:
        """Form the next group version with every live member (after a loss or a promotion);
        survivors keep serving what they hold meanwhile."""
        group = self._require_group()
        group.group_version += 1
        version = group.group_version
        self._store.fence(GROUP, version)
        members = self._group_members()
        host, port = self._store.address.host, self._store.address.port
        for rank, m in enumerate(members):
            # Ranks are per group version and contiguous; the trainer (rank 0) stays first.
            m.rank = rank
            m.machine.bind(rank=rank)
            m.machine.group_version = version
        await asyncio.gather(*(
            self._calls.call(m.name, m.handle, "join", host, port, GROUP, version, m.rank, len(members),
                             self.config.init_timeout_s)
            for m in members
        ))
        self.audit.record("group_formed", machine="group", member="group", group_version=version,
                          weights_version=group.weights_version, members=[m.name for m in members])

    async def _sync(self) -> SyncReport:
        group = self._require_group()
        t0 = time.perf_counter()
        previous = group.weights_version
        target = previous + 1
        trainer = self._trainer()
        if trainer.machine.state != "READY":
            raise MemberLost(trainer.name, f"cannot send weights from state {trainer.machine.state}",
                             group_version=group.group_version)
        rollouts = [m for m in self._role("rollout") if m.machine.state in ("READY", "STALE")]
        if not rollouts:
            raise NoServingWorkers(f"no rollout can receive weights version {target}: {self._states_text()}")
        # The sync_start record names the version being pushed; until it is committed the
        # group's (and routing's) current version stays the previous one.
        group.weights_version = target
        await group.fire("sync_start", rollouts=[m.name for m in rollouts])
        group.weights_version = previous
        await trainer.machine.fire("sync")
        for m in rollouts:
            await m.machine.fire("sync" if m.machine.state == "READY" else "resync")
        group.describe_wait(
            f"weight sync to version {target}", missing=[m.name for m in [trainer, *rollouts]]
        )
        staged: dict[str, dict[str, Any]] = {}
        sent: dict[str, Any] = {}
        timeout = self.config.sync_timeout_s
        try:
            async with group.deadline_scope():
                results = await self._transfer([
                    (trainer, self._calls.call(trainer.name, trainer.handle, "send_weights", target, timeout)),
                    *((m, self._calls.call(m.name, m.handle, "receive_weights", target, 0, timeout))
                      for m in rollouts),
                ])
                failures = self._failures([trainer, *rollouts], results)
                if not failures:
                    sent = results[0]
                    staged = {m.name: r for m, r in zip(rollouts, results[1:], strict=True)}
                    torn = [n for n, r in staged.items() if r["checksum"] != sent["checksum"]]
                    if torn:
                        failures = {n: ChecksumMismatch(
                            f"{n} staged weights version {target} with checksum {staged[n]['checksum']}, "
                            f"the trainer sent {sent['checksum']}") for n in torn}
                if failures:
                    await self._abort_sync(trainer, rollouts, previous, failures)
                    raise next(iter(failures.values()))
                group.weights_version = target
                not_loaded = await self._commit(trainer, rollouts, target, sent["checksum"])
                self._raise_if_failed()  # a death during the commit with fault tolerance off
        except SyncTimeout:
            group.weights_version = previous
            raise
        self._checksum = sent["checksum"]
        self._trainer_calls.clear()  # the trainer's work up to here is committed in the weights
        await group.fire("sync_done", checksum=self._checksum, nbytes=sent["nbytes"])
        user_errors = [e for e in not_loaded.values() if not isinstance(e, MemberLost)]
        if user_errors:
            # The version is committed on the others and the group is consistent; the caller
            # still hears of the rollout whose own load_weights raised (its bug, not a fault).
            raise user_errors[0]
        return SyncReport(
            weights_version=target,
            checksum=self._checksum,
            nbytes=sent["nbytes"],
            seconds=time.perf_counter() - t0,
            failovers=0,
            group_version=group.group_version,
            rollouts=tuple(m.name for m in rollouts if m.name not in not_loaded),
        )

    async def _transfer(self, calls: Sequence[tuple[_Member, Any]]) -> list[Any]:
        """Run the participants' calls of one transfer; results (or exceptions) in order.

        As soon as one fails (other than by a checksum mismatch, which the protocol itself
        reports after the vote), the others are told to abandon the transfer: a collective
        whose member died or left does not reliably fail on the others, and each would
        otherwise wait, busy and making no progress, until the watchdog took it for hung
        and had it killed. The abandoned group version is replaced by the caller (failover
        or :meth:`_abort_sync`)."""
        tasks = [asyncio.ensure_future(call) for _, call in calls]
        members = [m for m, _ in calls]
        waiting = set(tasks)
        abandoned = False
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in done if t.exception() is not None
                          and not isinstance(t.exception(), ChecksumMismatch)]
                if failed and waiting and not abandoned:
                    abandoned = True
                    culprit = members[tasks.index(failed[0])].name
                    reason = f"{culprit} failed: {type(failed[0].exception()).__name__}"
                    others = [m for m, t in zip(members, tasks, strict=True) if t in waiting]
                    self.audit.record("transfer_abandoned", reason=reason, members=[m.name for m in others])
                    await asyncio.gather(*(self._calls.call(m.name, m.handle, "abandon_transfer", reason)
                                           for m in others), return_exceptions=True)
        except asyncio.CancelledError:  # the state's deadline: the calls go with it
            for t in tasks:
                t.cancel()
            raise
        return [t.exception() or t.result() for t in tasks]

    def _failures(self, members: Sequence[_Member], results: Sequence[Any]) -> dict[str, BaseException]:
        out: dict[str, BaseException] = {}
        for m, r in zip(members, results, strict=True):
            if isinstance(r, BaseException):
                if isinstance(r, asyncio.CancelledError):
                    raise r
                out[m.name] = r
        # A death explains its peers' transport errors: report the dead member first.
        return dict(sorted(out.items(), key=lambda kv: not isinstance(kv[1], MemberLost)))

    async def _abort_sync(
        self, trainer: _Member, rollouts: Sequence[_Member], previous: int, failures: Mapping[str, BaseException]
    ) -> None:
        """Nobody committed: every survivor keeps ``previous``, which stays the current version."""
        group = self._require_group()
        for m in [trainer, *rollouts]:
            if m.machine.state in _GONE:
                continue
            if m.role == "rollout":
                with contextlib.suppress(MemberLost):  # died meanwhile: nothing to discard
                    await self._calls.call(m.name, m.handle, "discard_weights")
            err = failures.get(m.name)
            if m.machine.state == "SYNCING":
                await m.machine.fire("sync_aborted", reason=str(err) if err else "sync aborted")
            elif m.machine.state == "RESYNCING":
                await m.machine.fire("resync_failed", reason=str(err) if err else "sync aborted")
        group.weights_version = previous
        first = next(iter(failures.items()))
        if group.state == "SYNCING":
            await group.fire("sync_failed", reason=f"{first[0]}: {first[1]}")
        alive = all(m.machine.state not in _GONE for m in [trainer, *rollouts])
        if alive and not group.terminal and any(not isinstance(e, ChecksumMismatch) for e in failures.values()):
            # The transfer was abandoned mid-stream (a member's communicator was aborted, e.g.
            # the trainer's state_dict() raised): nobody died, so no failover will form the
            # next group version; form it here so the next sync finds a sound group. (A
            # checksum mismatch leaves the stream aligned and the group usable.)
            with contextlib.suppress(MemberLost):  # a death meanwhile is the failover's to handle
                await self._reform()

    async def _commit(
        self, trainer: _Member, rollouts: Sequence[_Member], version: int, checksum: str
    ) -> dict[str, BaseException]:
        """Hand the staged version to every rollout's ``load_weights``; returns the rollouts
        whose commit failed. The vote already made ``version`` current: one that failed here
        (its ``load_weights`` raised, or it died) is taken out of serving, STALE until a later
        sync resyncs it (or LOST), while the others serve ``version``."""
        self._routing_open.clear()
        try:
            results = await asyncio.gather(
                *(self._calls.call(m.name, m.handle, "commit_weights", version) for m in rollouts),
                return_exceptions=True,
            )
        finally:
            self._routing_open.set()
        failed = self._failures(rollouts, results)
        for m in rollouts:
            if m.name in failed:
                if m.machine.state in _GONE:
                    continue
                trigger = "sync_failed" if m.machine.state == "SYNCING" else "resync_failed"
                await m.machine.fire(trigger, reason=f"commit of weights version {version} failed: {failed[m.name]}")
                continue
            m.machine.weights_version = version
            if m.machine.state == "SYNCING":
                await m.machine.fire("committed", checksum=checksum)
            else:
                await m.machine.fire("verified", checksum=checksum)
                await m.machine.fire("admit")
        trainer.machine.weights_version = version
        await trainer.machine.fire("committed", checksum=checksum)
        return failed

    # -- calls -------------------------------------------------------------------------------

    async def rollout(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rollout that serves the current weights version; returns
        their results in rank order. Raises :class:`~ftstate.core.errors.NoServingWorkers` when none does.
        With fault tolerance on, a call cut short by a lost rollout is made again once the
        failover completed."""
        return await self._with_failover(self._rollout_once, method, args, kwargs)

    async def trainer(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the current trainer. With fault tolerance on, a call cut short by
        the trainer's loss is made again on its replacement (so the loop never sees it)."""
        return await self._with_failover(self._trainer_once, method, args, kwargs)

    async def rollout_map(self, method: str, items: Sequence[Any], *args: Any) -> list[Any]:
        """Deal ``items`` over the rollouts serving the current weights (item ``i`` to the
        ``i mod n``-th), call ``method(*args, shard)`` on each, and return one result per item,
        in item order (``method`` must answer each shard with one result per item, in order).
        With fault tolerance on, the shard of a rollout lost mid-call is dealt again over the
        rollouts serving once the failover completed; with it off, the loss is raised."""
        results: list[Any] = [None] * len(items)
        todo = list(range(len(items)))
        attempts = 0
        while todo:
            self._raise_if_failed()
            await self._routing_open.wait()
            targets = self.serving_rollouts()
            if not targets:
                if self.config.fault_tolerance.enable and self._failover.pending:
                    async with self._sync_lock:
                        await self._recover_locked()
                    continue
                raise NoServingWorkers(
                    f"no rollout serves the current weights version {self.weights_version}: {self._states_text()}"
                )
            shards = {name: todo[i::len(targets)] for i, name in enumerate(targets)}
            outs = await asyncio.gather(*(
                self._calls.call(name, self._members[name].handle, "call", method,
                                 (*args, [items[j] for j in idx]), {})
                for name, idx in shards.items()
            ), return_exceptions=True)
            failed: list[int] = []
            for (name, idx), out in zip(shards.items(), outs, strict=True):
                if isinstance(out, MemberLost) and self.config.fault_tolerance.enable:
                    failed += idx
                    continue
                if isinstance(out, BaseException):
                    raise out
                if len(out) != len(idx):
                    raise FTError(f"{name}: {method}() answered {len(out)} results for a shard of {len(idx)}")
                for j, r in zip(idx, out, strict=True):
                    results[j] = r
            if failed:
                attempts += 1
                if attempts > self.config.fault_tolerance.max_failovers + 1:
                    raise MemberLost(", ".join(shards), f"{method}() kept losing rollouts ({attempts} tries)")
                self.audit.record("call_retry", method=method, items=len(failed), attempt=attempts)
                async with self._sync_lock:
                    await self._recover_locked()
            todo = sorted(failed)
        return results

    async def _with_failover(self, fn: Any, method: str, args: Any, kwargs: Any) -> Any:
        attempts = 0
        while True:
            self._raise_if_failed()
            try:
                return await fn(method, args, kwargs)
            except MemberLost:
                attempts += 1
                if not self.config.fault_tolerance.enable or attempts > self.config.fault_tolerance.max_failovers:
                    raise
                async with self._sync_lock:
                    await self._recover_locked()
                self.audit.record("call_retry", method=method, attempt=attempts)

    async def _rollout_once(self, method: str, args: Any, kwargs: Any) -> list[Any]:
        self._raise_if_failed()
        await self._routing_open.wait()
        targets = self.serving_rollouts()
        if not targets:
            version = self._require_group().weights_version
            raise NoServingWorkers(f"no rollout serves the current weights version {version}: {self._states_text()}")
        return list(await asyncio.gather(*(self._user_call(self._members[m], method, args, kwargs) for m in targets)))

    async def _trainer_once(self, method: str, args: Any, kwargs: Any) -> Any:
        self._raise_if_failed()
        m = self._trainer()
        if not m.machine.serving:
            # A replacement mid-failover has not got the weights yet: wait for the failover.
            raise MemberLost(m.name, f"not serving yet ({m.machine.state})", group_version=self.group_version)
        result = await self._user_call(m, method, args, kwargs)
        self._trainer_calls.append((method, args, kwargs))
        return result

    async def _user_call(self, m: _Member, method: str, args: Any, kwargs: Any) -> Any:
        """One call of the user's code on a worker. A call that raises changes no state, but
        the trail still says so (an ``error`` record on the worker's machine): a run that
        ends on a user error is then explained by its trail alone. A death is the machine's
        own transition (``died``), not recorded twice."""
        try:
            return await self._calls.call(m.name, m.handle, "call", method, args, kwargs)
        except MemberLost:
            raise
        except Exception as exc:
            m.machine.record_error(exc, call=method)
            raise

    def serving_rollouts(self) -> list[str]:
        """Rollouts in a serving state holding the current weights version, in rank order."""
        version = self._require_group().weights_version
        return [m.name for m in self._role("rollout") if m.machine.serving and m.machine.weights_version == version]

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
        return self._checksum

    def members(self) -> list[MemberInfo]:
        """Every worker the run started (spares have rank -1), group members first by rank."""
        return [
            MemberInfo(m.name, m.role, m.rank, m.machine.state, m.machine.weights_version,
                       m.machine.group_version, m.pid, m.node)
            for m in sorted(self._members.values(), key=lambda m: (m.rank < 0, m.rank, m.name))
        ]

    def handle(self, member: str) -> Any:
        """The Ray actor handle of a member (tests and chaos use it)."""
        return self._members[member].handle

    def _trainer(self) -> _Member:
        live = [m for m in self._role("trainer") if m.machine.state not in _GONE]
        if not live:
            raise MemberLost("trainer-0", "no live trainer", group_version=self.group_version)
        return live[0]

    def _role(self, role: str) -> list[_Member]:
        """Group members of a role (spares excluded), by rank."""
        return sorted((m for m in self._members.values() if m.role == role and m.rank >= 0), key=lambda m: m.rank)

    @property
    def failovers(self) -> list[Any]:
        """Every failover so far (:class:`~ftstate.controller.failover.FailoverRecord`)."""
        return list(self._failover.records)

    def _require_group(self) -> StateMachine:
        if self.group is None:
            raise FTError("the runtime is not started: use `async with Runtime(...)` or `await rt.start()`")
        return self.group

    def _states_text(self) -> str:
        return ", ".join(f"{m.name}={m.machine.state}@v{m.machine.weights_version}" for m in self._role("rollout"))

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        group = self._require_group()
        if group.terminal:
            raise group.error or FTError(f"the run's group is {group.state}")

    # -- failures ------------------------------------------------------------------------

    async def _on_died(self, member: str, reason: str) -> None:
        m = self._members.get(member)
        if m is not None and m.machine.can("died"):
            lost = MemberLost(member, reason, group_version=m.machine.group_version)
            await m.machine.fire("died", reason=reason, error=lost)

    def _on_worker_transition(self, machine: StateMachine, src: str, dest: str, trigger: str) -> None:
        if dest == "LOST":
            m = self._members[machine.member]
            if self.config.fault_tolerance.enable:
                # Noted now, not in the task: a sync that fails because of this loss must find it.
                self._failover.note_loss(m, asyncio.get_running_loop().time())
            self._spawn(self._member_lost(m, machine.error))

    def _on_group_transition(self, machine: StateMachine, src: str, dest: str, trigger: str) -> None:
        if dest == "FAILED" and self._failure is None and machine.error is not None:
            self._failure = machine.error

    async def _member_lost(self, m: _Member, error: FTError | None) -> None:

        self._kill(m)
        lost = error if isinstance(error, MemberLost) else MemberLost(
            m.name, str(error) if error else "declared lost", group_version=m.machine.group_version)
        if not self.config.fault_tolerance.enable:
            self._failure = self._failure or lost
            group = self._require_group()
            if not group.terminal:
                await group.fire("fail", reason=str(lost), error=lost)
            return
        if m.rank < 0:  # a spare died: retire it and start another
            if m.machine.can("retire"):
                await m.machine.fire("retire", reason="spare lost")
            self._pools[m.pool].give_back(m.slot)
            if not self._closed:
                self._failover.spare_lost(m)
            return
        await self._recover_in_background()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- heartbeats -----------------------------------------------------------------------

    async def _watch(self) -> None:
        interval = self.config.heartbeat_interval_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            members = [m for m in self._members.values() if m.machine.state not in _GONE and m.machine.state != "INIT"]
            await asyncio.gather(*(self._poll(m, loop.time()) for m in members), return_exceptions=True)

    async def _poll(self, m: _Member, now: float) -> None:
        try:
            raw = await self._calls.call(m.name, m.handle, "heartbeat", timeout=self.config.heartbeat_interval_s)
            beat: Heartbeat | None = Heartbeat(**raw)
        except MemberLost:
            beat = None
        if m.machine.state in _GONE:
            return
        group = self._require_group()
        trigger = m.liveness.observe(
            now, beat, state=m.machine.state, current_version=group.weights_version, current_checksum=self._checksum
        )
        if trigger is None or not m.machine.can(trigger):
            return
        reason = "no heartbeat within the interval" if beat is None else f"progress {beat.progress}, busy={beat.busy}"
        await m.machine.fire(trigger, reason=reason)
        if trigger == "verified":
            await m.machine.fire("admit")


class Chaos:
    """Fault injection on a running runtime: real signals to real processes.

    ``role``/``rank``: the worker by role and its index within the role (``("rollout", 1)`` is
    ``rollout-1``; the trainer is ``("trainer", 0)``), or a member name. Each is usable before
    or during a sync; ``after_progress`` delays a kill until the worker made that many more
    units of progress (buckets, calls), which lands it in the middle of a transfer.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        #: (loop time, member, fault) of every injected fault.
        self.injected: list[tuple[float, str, str]] = []
        #: pids stopped by :meth:`hang`, released by :meth:`release` (and at close).
        self.hung: list[int | None] = []

    def _member(self, role: str, rank: int | None) -> _Member:
        rt = self.rt
        if rank is None:
            return rt._members[role]
        if role == "trainer":
            return rt._trainer()
        live = [m for m in rt._role(role) if m.machine.state not in _GONE]
        by_name = {m.name: m for m in live}
        name = f"{role}-{rank}"
        if name in by_name:
            return by_name[name]
        if rank < len(live):
            return live[rank]
        raise FTError(f"chaos: no live {role} with index {rank}; live: {', '.join(by_name) or 'none'}")

    def _note(self, m: _Member, fault: str) -> None:
        self.injected.append((asyncio.get_running_loop().time(), m.name, fault))
        self.rt.audit.record("chaos", member=m.name, fault=fault, pid=m.pid)

    async def kill(self, role: str, rank: int | None = None, *, after_progress: int | None = None) -> str:
        """SIGKILL the worker's process (now, or after ``after_progress`` more units of progress)."""
        import os
        import signal

        m = self._member(role, rank)
        if after_progress is not None:
            await m.handle.chaos_kill_after_progress.remote(after_progress)
            self._note(m, f"kill after {after_progress} progress")
        else:
            self._note(m, "kill")
            if m.pid and m.node in ("127.0.0.1", "localhost"):
                os.kill(m.pid, signal.SIGKILL)
            else:
                m.handle.chaos_kill.remote()
        return m.name

    async def hang(self, role: str, rank: int | None = None, *, after_progress: int | None = None) -> str:
        """Stop the worker's process (SIGSTOP): alive, no progress, no answers (now, or after
        ``after_progress`` more units of progress)."""
        m = self._member(role, rank)
        if after_progress is not None:
            await m.handle.chaos_hang_after_progress.remote(after_progress)
            self._note(m, f"hang after {after_progress} progress")
        else:
            self._note(m, "hang")
            m.handle.chaos_hang.remote()
        self.hung.append(m.pid)
        return m.name

    def release(self) -> None:
        """SIGKILL every process this chaos hung (their actors are dead to the run already)."""
        import os
        import signal

        for pid in self.hung:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(pid, sig)
        self.hung.clear()

    async def corrupt(self, role: str, rank: int | None = None) -> str:
        """Flip one byte of the next bucket the worker receives."""
        m = self._member(role, rank)
        self._note(m, "corrupt")
        await m.handle.chaos_corrupt_next_bucket.remote()
        return m.name
