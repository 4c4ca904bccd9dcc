"""``FTStateCheckpointEngineManager``: verl's checkpoint-engine manager with ftstate's machines around it, run
in verl's driver. It keeps verl's call order and adds controller-side deadlines, shrinking past a dead rollout
replica, a typed error for a dead trainer rank and typed worker errors (docs/integration.md, "verl"). The
machines run in an event loop of their own, in a daemon thread, since verl calls ``update_weights`` from any
loop or none."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from verl.checkpoint_engine.base import CheckpointEngineManager, _worker_cls
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.utils.ray_utils import auto_await

from ftstate.controller.ray import cluster
from ftstate.controller.runtime import run_facts
from ftstate.core.audit import AuditTrail
from ftstate.core.budget import budget_for
from ftstate.core.errors import (
    ConfigError,
    FailoverBudgetExhausted,
    FTError,
    MemberLost,
    NoServingWorkers,
    RendezvousTimeout,
    TransportError,
)
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec
from ftstate.integrations.verl import nodestage
from ftstate.integrations.verl.engine import BACKEND, driver_store
from ftstate.integrations.verl.settings import EngineSettings

BUDGET_KEY = "fault_tolerance.max_failovers"


@dataclass
class _Member:
    """One verl worker as the manager sees it."""

    name: str
    handle: Any
    machine: StateMachine
    role: str  # "trainer" or "rollout"
    replica: Any = None


class _ReplicasLost(Exception):
    """Internal: rollout workers died during an attempt; the update is run again without them."""

    def __init__(self, dead: list[_Member], why: dict[str, str]) -> None:
        self.dead = dead
        self.why = why
        super().__init__(", ".join(m.name for m in dead))


def _unwrap(exc: BaseException) -> BaseException:
    """The worker's own error out of Ray's ``RayTaskError`` wrapper."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return cause
    return exc


def _died(exc: BaseException) -> bool:
    return isinstance(exc, ray.exceptions.RayActorError)


class FTStateCheckpointEngineManager(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` with ftstate's deadlines, machines and audit trail, built by verl as
    ``cls(config=..., actor_wg=..., replicas=...)``; settings from ``config.engine_kwargs["ftstate"]``.
    ``audit``: a trail to write to instead of ``audit_log``'s."""

    def __init__(self, config: Any, actor_wg: RayWorkerGroup, replicas: list[Any], *,
                 audit: AuditTrail | None = None) -> None:
        super().__init__(config, actor_wg, replicas)
        if self.backend != BACKEND:
            raise ConfigError(
                "checkpoint_engine.backend",
                f"FTStateCheckpointEngineManager needs backend {BACKEND!r} (custom_backend_module "
                f"ftstate.integrations.verl), got {self.backend!r}",
            )
        self.settings = EngineSettings.from_kwargs(config.engine_kwargs.get(BACKEND, {}))
        self.cfg = self.settings.runtime
        self.audit = audit if audit is not None else AuditTrail(self.cfg.audit_log, keep=self.cfg.audit_records_kept)
        #: Names this manager's run in every record it writes (as a Runtime's run id does).
        self.run_id = uuid.uuid4().hex[:8]
        self.audit.begin_run(self.run_id, integration="verl", replicas=len(replicas),
                             **run_facts(self.cfg, cluster.node_address()))
        self._backstop = self.cfg.replace(init_timeout_s=2 * self.cfg.init_timeout_s,
                                          sync_timeout_s=2 * self.cfg.sync_timeout_s)
        self.budget = budget_for(BUDGET_KEY, self.cfg)
        #: Replicas removed after a loss: ``{"replica": rank, "workers": [...], "reason": ...}``.
        self.removed: list[dict[str, Any]] = []
        #: The group machine of the last update attempt.
        self.group: StateMachine | None = None
        self.updates = 0
        self._members: dict[str, _Member] = {}
        self._attempts = 0
        self._pushing = 0
        self._committed = 0
        self._group_version = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ftstate-verl-manager", daemon=True)
        self._thread.start()

    # -- verl's API -------------------------------------------------------------------------

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """verl's update with ftstate's bounds and failover (see the module docstring)."""
        future = asyncio.run_coroutine_threadsafe(self._update(global_steps), self._loop)
        return await asyncio.wrap_future(future)

    def serving_replicas(self) -> list[Any]:
        """Replicas whose every worker serves the current weights (route traffic to these only)."""
        out = []
        for replica in self.replicas:
            members = [self._members.get(self._key(w)) for w in replica.workers]
            if members and all(m is not None and m.machine.serving for m in members):
                out.append(replica)
        return out

    def states(self) -> dict[str, str]:
        """Every verl worker's machine state, by name."""
        return {m.name: m.machine.state for m in self._members.values()}

    def close(self) -> None:
        """Stop the manager's event loop (its machines are kept for reading)."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # -- one update ---------------------------------------------------------------------------

    async def _update(self, global_steps: int | None) -> dict[str, Any]:
        await self.abort_replicas()
        await self.release_kv_cache_replicas()
        while True:
            try:
                metrics = await self._attempt(global_steps)
                break
            except _ReplicasLost as lost:
                await self._remove(lost)
        self.updates += 1
        await self.resume_kv_cache_replicas()
        await self.resume_generation_replicas()
        return metrics

    async def _attempt(self, global_steps: int | None) -> dict[str, Any]:
        trainers = [self._member(w, "trainer", f"trainer rank {i}") for i, w in enumerate(self.actor_wg.workers)]
        rollouts: list[_Member] = []
        for replica in self.replicas:
            for i, w in enumerate(replica.workers):
                rollouts.append(self._member(w, "rollout", f"rollout replica {replica.replica_rank} worker {i}", replica))
        if not rollouts:
            raise NoServingWorkers("verl weight update: no rollout replica left to update")
        self._attempts += 1
        group = StateMachine(get_spec("group"), member=f"verl-weights update {self._attempts}", config=self.cfg,
                             audit=self.audit, budgets={BUDGET_KEY: self.budget})
        # The group machine is per update; the weights and membership versions are the run's.
        group.now_holds(self._committed)
        group.group_version = self._group_version
        self.group = group
        everyone = trainers + rollouts
        # the group's deadline first: it is the one that decides (see _member)
        await group.fire("start", reason="verl update_weights")
        for m in everyone:
            if m.machine.state == "INIT":
                await m.machine.fire("join", reason="verl update")
            elif m.machine.state == "READY":
                await m.machine.fire("sync", reason="verl update")
            elif m.machine.state == "STALE":
                await m.machine.fire("resync", reason="verl update")
        rollout_wg = RayWorkerGroup(worker_handles=[m.handle for m in rollouts],
                                    ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls))
        version: int | None = None

        # 1. the rebuild, bounded by the group's RENDEZVOUS deadline (init_timeout_s)
        pending: set[str] = set()
        group.describe_wait("verl rebuild of the weight group (prepare, build_topology, init_process_group)",
                            missing=lambda: sorted(pending), arrived=lambda: sorted(
                                m.name for m in everyone if m.name not in pending))
        try:
            async with group.deadline_scope():
                refs = (self.actor_wg.execute_checkpoint_engine(["prepare"] * len(trainers))
                        + rollout_wg.execute_checkpoint_engine(["prepare"] * len(rollouts)))
                metadata = await self._all(everyone, refs, pending, "prepare")
                actor_kwargs, rollout_kwargs = self.backend_cls.build_topology(len(trainers), len(rollouts), metadata)
                version = rollout_kwargs["version"][0]
                group.group_version = self._group_version = version
                actor_kwargs["method"] = ["init_process_group"] * len(trainers)
                rollout_kwargs["method"] = ["init_process_group"] * len(rollouts)
                refs = self.actor_wg.execute_checkpoint_engine(**actor_kwargs) + rollout_wg.execute_checkpoint_engine(
                    **rollout_kwargs)
                await self._all(everyone, refs, pending, "init_process_group", on_done=self._joined)
        except BaseException as exc:
            await self._abandon(group, everyone, rollout_wg, version, exc, pending)
            raise
        await group.fire("rendezvous_done", reason=f"group version {version} formed")

        # 2. the transfer, bounded by the group's SYNCING deadline (sync_timeout_s)
        wv = global_steps if global_steps is not None else self.updates + 1
        self._pushing = wv
        await group.fire("sync_start", reason=f"weights version {wv}", for_version=wv)
        group.describe_wait("verl weight transfer", missing=lambda: sorted(pending))
        try:
            async with group.deadline_scope():
                refs = (self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
                        + rollout_wg.update_weights(global_steps=global_steps))
                results = await self._all(everyone, refs, pending, "update_weights", on_done=self._synced)
        except BaseException as exc:
            await self._abandon(group, everyone, rollout_wg, version, exc, pending)
            raise
        await self._finalize(everyone, rollout_wg)
        self._committed = wv
        group.now_holds(wv)
        await group.fire("sync_done", reason="every rollout verified and applied the update")
        await group.fire("stop", reason="update finished (verl rebuilds the group on every update)")
        metrics: dict[str, Any] = {}
        for r in results[: len(trainers)]:
            if isinstance(r, dict):
                metrics.update(r)
        metrics["ftstate/group_version"] = version
        metrics["ftstate/replicas_removed"] = len(self.removed)
        return metrics

    # -- waiting on verl's workers --------------------------------------------------------------

    async def _all(self, members: Sequence[_Member], refs: Sequence[Any], pending: set[str], what: str,
                   on_done: Callable[[_Member], Awaitable[None]] | None = None) -> list[Any]:
        """Every worker's result of one call, in order, moving each machine by ``on_done``. Deaths are
        collected and raised as one :class:`_ReplicasLost` (a dead trainer as ``MemberLost``); other errors as
        the worker's typed error."""
        pending.clear()
        pending.update(m.name for m in members)
        results: list[Any] = [None] * len(members)
        errors: dict[int, BaseException] = {}

        async def one(i: int, m: _Member, ref: Any) -> None:
            try:
                results[i] = await asyncio.wrap_future(ref.future())
            except asyncio.CancelledError:
                raise  # the deadline: it stays pending (named, and not waited for again)
            except BaseException as exc:  # noqa: BLE001 - sorted below: deaths first
                pending.discard(m.name)
                errors[i] = exc
                if _died(exc):
                    # a transfer blocked on the dead member may not notice: tell the others now
                    for other in members:
                        if other.name in pending and other is not m:
                            other.handle.execute_checkpoint_engine.remote("abandon", f"{m.name} died during {what}")
                return
            pending.discard(m.name)
            if on_done is not None:
                await on_done(m)

        await asyncio.gather(*(one(i, m, ref) for i, (m, ref) in enumerate(zip(members, refs, strict=True))))
        if not errors:
            return results
        dead = [members[i] for i, e in errors.items() if _died(e)]
        why = {members[i].name: f"{type(e).__name__} during {what}" for i, e in errors.items() if _died(e)}
        for m in dead:
            if m.machine.can("died"):
                await m.machine.fire("died", reason=why[m.name])
        dead_trainers = [m for m in dead if m.role == "trainer"]
        if dead_trainers:
            raise MemberLost(dead_trainers[0].name, f"the process died during {what}; verl cannot replace a trainer rank",
                             group_version=self.group.group_version if self.group else None)
        if dead:
            raise _ReplicasLost(dead, why)
        at = min(errors)  # the trainer's error first: it names every rollout that failed
        first = _unwrap(errors[at])
        if isinstance(first, FTError):
            raise first
        raise TransportError(f"verl {what} failed on {members[at].name}: {first}") from first

    async def _joined(self, m: _Member) -> None:
        if m.machine.state == "RENDEZVOUS":
            await m.machine.fire("joined_as_source" if m.role == "trainer" else "joined", reason="init_process_group")
            if m.machine.state == "STALE":
                await m.machine.fire("resync", reason="receives the update")

    async def _synced(self, m: _Member) -> None:
        m.machine.now_holds(self._pushing)
        state = m.machine.state
        if state == "SYNCING":
            await m.machine.fire("committed", reason="update applied")
        elif state in ("RESYNCING", "RESYNCED"):
            if state == "RESYNCING":
                await m.machine.fire("verified", reason="complete verified update")
            await m.machine.fire("admit", reason="holds the current weights")

    # -- failure paths ------------------------------------------------------------------------

    async def _abandon(self, group: StateMachine, members: Sequence[_Member], rollout_wg: RayWorkerGroup,
                       version: int | None, exc: BaseException, pending: set[str]) -> None:
        """After a failed attempt: fence the version, finalize every worker that answers, and move the
        machines (a silent worker LOST; a rollout caught in the attempt STALE)."""
        if version is not None:
            driver_store(self.settings.store_host).fence(self.settings.group, version + 1)
        answering = [m for m in members if m.machine.state != "LOST" and m.name not in pending]
        await self._finalize(answering, rollout_wg, quiet=True)
        if version is not None and self.settings.commit_mode == "staged":
            # A SIGKILLed writer cannot unlink its node's copy: the driver's node by name here, others at
            # their next join
            nodestage.remove_update(self.settings.group, version)
        why = f"update abandoned: {type(exc).__name__}"
        for m in members:
            state = m.machine.state
            if state == "RENDEZVOUS":
                if m.name in pending:
                    await m.machine.fire("unresponsive", reason=f"never answered: {why}")
                else:
                    await m.machine.fire("joined_as_source" if m.role == "trainer" else "joined", reason=why)
            elif state == "SYNCING":
                # A rollout may hold part of this update (stream mode): STALE until a complete verified
                # update.
                keeps = m.role == "trainer" or self.settings.commit_mode == "staged"
                await m.machine.fire("sync_aborted" if keeps else "sync_failed", reason=why)
            elif state == "RESYNCING":
                await m.machine.fire("resync_failed", reason=why)
        if group.terminal:
            return  # the deadline already took it to FAILED
        committed = [m for m in members if m.role == "rollout" and m.machine.state == "READY"
                     and m.machine.weights_version == self._pushing and m.name not in pending]
        if isinstance(exc, _ReplicasLost):
            await group.fire("member_lost", reason=f"lost {exc}")
        elif group.state == "SYNCING" and not isinstance(exc, MemberLost) and committed:
            # The rollouts that verified the whole update hold it; the others are STALE and named in the
            # error.
            self._committed = self._pushing
            group.now_holds(self._pushing)
            await group.fire("sync_done", reason=f"committed by {', '.join(m.name for m in committed)} only: "
                                                  f"{type(exc).__name__}")
            await group.fire("stop", reason="update partly failed; verl rebuilds the group on the next update")
        elif group.state == "SYNCING" and not isinstance(exc, MemberLost):
            await group.fire("sync_failed", reason=f"{type(exc).__name__}: {exc}")
            await group.fire("stop", reason="update failed; verl rebuilds the group on the next update")
        else:
            await group.fire("fail", reason=f"{type(exc).__name__}: {exc}",
                             error=exc if isinstance(exc, FTError) else None)

    async def _remove(self, lost: _ReplicasLost) -> None:
        group = self.group
        assert group is not None
        replicas = []
        for m in lost.dead:
            if m.replica is not None and m.replica not in replicas:
                replicas.append(m.replica)
        reason = "; ".join(f"{name}: {why}" for name, why in lost.why.items())
        now = asyncio.get_running_loop().time()
        refused = self.budget.refusal([reason], now)
        if refused is not None:
            exc = FailoverBudgetExhausted(limit=refused.limit, spent_on=refused.spent_on, member=lost.dead[0].name,
                                          key=refused.key, window_s=refused.window_s)
            await group.fire("budget_exhausted", reason=reason, error=exc)
            raise exc
        self.budget.spend(reason, now)
        self.audit.record("budget_spent", machine="group", member=group.member, key=BUDGET_KEY, reason=reason,
                          remaining=self.budget.remaining)
        for replica in replicas:
            names = [self._members[self._key(w)].name for w in replica.workers if self._key(w) in self._members]
            for w in replica.workers:
                member = self._members.get(self._key(w))
                if member is not None and member.machine.can("retire"):
                    await member.machine.fire("retire", reason=f"replica {replica.replica_rank} removed")
            entry = {"replica": replica.replica_rank, "workers": names, "reason": reason,
                     "group_version": group.group_version}
            self.removed.append(entry)
            self.audit.record("replica_removed", **entry)
        self.remove_replicas(replicas)
        await group.fire("shrink", reason=f"removed replica(s) {[r.replica_rank for r in replicas]}; "
                                          "the update runs again for the survivors")
        await group.fire("stop", reason="superseded by the next group version")

    async def _finalize(self, members: Sequence[_Member], rollout_wg: RayWorkerGroup, *, quiet: bool = False) -> None:
        """``finalize`` on every worker, bounded by ``init_timeout_s`` (teardown of a group version)."""
        trainers = [m for m in members if m.role == "trainer"]
        rollouts = [m for m in members if m.role == "rollout"]
        refs = []
        for m in trainers:
            refs.append(m.handle.execute_checkpoint_engine.remote("finalize"))
        for m in rollouts:
            refs.append(m.handle.execute_checkpoint_engine.remote("finalize"))
        if not refs:
            return
        done, not_done = await asyncio.to_thread(ray.wait, refs, num_returns=len(refs),
                                                 timeout=self.cfg.init_timeout_s)
        if quiet:
            return
        failed = []
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - reported as one typed error below
                failed.append(str(_unwrap(exc)))
        if not_done or failed:
            raise RendezvousTimeout(
                "verl finalize of the weight group", key="init_timeout_s", seconds=self.cfg.init_timeout_s,
                missing=[f"{len(not_done)} worker(s) did not answer finalize", *failed],
            )

    # -- bookkeeping -------------------------------------------------------------------------

    @staticmethod
    def _key(handle: Any) -> str:
        return handle._actor_id.hex()

    def _member(self, handle: Any, role: str, name: str, replica: Any = None) -> _Member:
        key = self._key(handle)
        member = self._members.get(key)
        if member is None:
            # The group's deadlines decide; a worker machine's own are a backstop at twice their length, so
            # the manager moves a worker caught in an abandoned attempt before its timer fails it.
            machine = StateMachine(get_spec("worker"), member=name, config=self._backstop, audit=self.audit,
                                   role=role)
            member = self._members[key] = _Member(name, handle, machine, role, replica)
        return member


__all__ = ["FTStateCheckpointEngineManager"]
