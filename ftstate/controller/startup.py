"""Starting a run: what the runtime is given, checked; the facts of its first record; and its
first group version.

:class:`~ftstate.controller.runtime.Runtime` checks its arguments here before it keeps them
(:func:`check_arguments`), records :func:`run_facts` as the trail's ``run_start``, and, once it
assembled its parts and started every actor, forms group version 1 with
:func:`first_rendezvous` (bounded by ``init_timeout_s``; with fault tolerance on, a member that
dies before it formed is failed over). Runs in the driver process, on the controller's event
loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ftstate.controller.backend import ClusterBackend
from ftstate.controller.calls import ActorCalls
from ftstate.controller.formation import GroupFormation
from ftstate.controller.launcher import ActorLauncher
from ftstate.controller.membership import GROUP, Member, Membership
from ftstate.controller.progress import Progress
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError, MemberLost
from ftstate.core.protocol import Info
from ftstate.core.worker import RolloutWorker, TrainerWorker


def run_facts(cfg: RuntimeConfig, node: str | None, backend: ClusterBackend | None = None) -> dict[str, Any]:
    """What a run's ``run_start`` record says started: the config's digest (sha256 of its
    canonical JSON, so two runs of one config compare equal), the workers asked for, the
    versions of ftstate, Python and what the backend runs on (Ray, torch; default: Ray's),
    and where the controller runs."""
    import platform
    import socket

    import ftstate

    if backend is None:
        from ftstate.controller.ray.backend import RayBackend

        backend = RayBackend()

    return {
        "config_digest": cfg.digest(),
        "trainer_workers": cfg.trainer_workers, "rollout_workers": cfg.rollout_workers,
        "fault_tolerance": cfg.fault_tolerance.enable,
        "versions": {"ftstate": ftstate.__version__, **backend.versions(), "python": platform.python_version()},
        "controller": {"host": socket.gethostname(), "node": node, "pid": os.getpid()},
        "nodes": cluster_nodes_brief(backend),
    }


def cluster_nodes_brief(backend: ClusterBackend) -> list[str]:
    """The alive nodes, ``id@address CPU=n`` each (a run_start fact; empty if the cluster cannot say)."""
    try:
        return sorted(f"{n['node_id'][:8]}@{n['address']} CPU={float(n['resources'].get('CPU', 0)):g}"
                      for n in backend.nodes())
    except Exception:  # noqa: BLE001 - a fact for the trail, never a reason to fail start()
        return []


def check_arguments(
    config: Any,
    trainer: Any,
    rollout: Any,
    trainer_args: Any,
    trainer_kwargs: Any,
    rollout_args: Any,
    rollout_kwargs: Any,
    run_id: Any,
    audit: Any,
    backend: Any,
) -> None:
    """Raise TypeError (ConfigError for a config several trainer ranks cannot run) unless the
    runtime's arguments are what :class:`~ftstate.controller.runtime.Runtime` takes."""
    if not isinstance(config, RuntimeConfig):
        raise TypeError(f"config must be a ftstate.RuntimeConfig (RuntimeConfig.from_dict / from_yaml), "
                        f"got {type(config).__name__}")
    if not (isinstance(trainer, type) and issubclass(trainer, TrainerWorker)):
        raise TypeError(f"trainer must be a TrainerWorker subclass, got {trainer!r}")
    if not (isinstance(rollout, type) and issubclass(rollout, RolloutWorker)):
        raise TypeError(f"rollout must be a RolloutWorker subclass, got {rollout!r}")
    for name, value in (("trainer_args", trainer_args), ("rollout_args", rollout_args)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"{name} must be a sequence of constructor arguments, got {type(value).__name__}")
    for name, value in (("trainer_kwargs", trainer_kwargs), ("rollout_kwargs", rollout_kwargs)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a mapping of constructor keyword arguments, got {type(value).__name__}")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise TypeError(f"run_id must be a non-empty str, got {run_id!r}")
    if audit is not None and not isinstance(audit, AuditTrail):
        raise TypeError(f"audit must be a ftstate.AuditTrail, got {type(audit).__name__}")
    if backend is not None and not isinstance(backend, ClusterBackend):
        raise TypeError(f"backend must be a ftstate ClusterBackend, got {type(backend).__name__}")
    if config.trainer_workers > 1:
        # Several trainer ranks (ftstate.controller.ranks): the same-host route and NCCL are
        # not there yet, and a replaced rank gets its part back from a rollout only;
        # refused here rather than half-working.
        ft = config.fault_tolerance
        if ft.enable and not ft.reverse_weight_sync:
            raise ConfigError(
                "fault_tolerance.reverse_weight_sync",
                f"false: with {config.trainer_workers} trainer ranks a replaced rank gets its part of the "
                "last committed version back from a rollout (a sharded checkpoint is not implemented)",
            )
        if config.shared_memory == "require":
            raise ConfigError("shared_memory", "require: several trainer ranks send over the collective only")
        if config.backend != "gloo":
            raise ConfigError("backend", f"{config.backend}: several trainer ranks run on gloo only")


async def first_rendezvous(
    *,
    config: RuntimeConfig,
    membership: Membership,
    formation: GroupFormation,
    launcher: ActorLauncher,
    calls: ActorCalls,
    progress: Progress,
    start_spares: Callable[[], None],
    recover: Callable[[], Awaitable[None]],
) -> None:
    """Form group version 1 with every member started (``init_timeout_s``, the group's
    deadline); spares start warming once the pools are placed (``start_spares``). With fault
    tolerance on, a member that died before it formed is replaced by ``recover`` (a failover
    round, which forms the next version with everyone)."""
    ms = membership
    group = ms.group
    group.group_version += 1
    version = group.group_version
    members = ms.group_members()
    await group.fire("start")
    for m in members:
        m.machine.group_version = version
        await m.machine.fire("join")

    def arrived() -> list[str]:
        return formation.arrived(version, members)

    def missing() -> list[str]:
        here = set(arrived())
        return [m.name for m in members if m.name not in here]

    ready: set[str] = set()

    def report_ready() -> None:
        progress.report("workers", f"starting {len(members)} workers: {len(ready)} ready",
                             workers=len(members), ready=len(ready))

    async def join(m: Member) -> None:
        info = await calls.call(m.name, m.handle, Info())
        ms.located(m, info)
        ready.add(m.name)  # its process is up and its class constructed
        report_ready()
        await formation.join(m, version, len(members))

    group.describe_wait(launcher.describe_pools(), missing=launcher.unplaced)
    async with group.deadline_scope():
        progress.report("placement", f"placing {len(members)} workers ({launcher.describe_pools()})",
                             workers=len(members))
        await launcher.pools_ready()
        # Spares warm up while the group forms; started once the pools are placed, so each
        # can take a slot away from the nodes of the members it covers.
        start_spares()
        group.describe_wait(f"rendezvous of group {GROUP!r}", missing=missing, arrived=arrived)
        report_ready()
        joins = [asyncio.ensure_future(join(m)) for m in members]
        try:
            await asyncio.gather(*joins)
            lost_before_forming = False
        except MemberLost:
            # Replaced only if it really died (LOST, and perhaps already being replaced by
            # the failover its death started), not if it merely failed to answer.
            died = any(m.machine.state in ("LOST", "RETIRED") for m in members)
            if not (config.fault_tolerance.enable and died):
                raise
            lost_before_forming = True
    if lost_before_forming:
        # Fault tolerance on and a member died before version 1 formed: the failover
        # replaces it and forms the next version with everyone (its fence releases the
        # survivors still waiting in this one), spending one of max_failovers.
        await recover()
    else:
        await group.fire("rendezvous_done")
        formation.mark_formed(version)
    progress.report("group", f"group {GROUP!r} formed: version {group.group_version}, "
                         f"{len(ms.group_members())} members", group_version=group.group_version)
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
