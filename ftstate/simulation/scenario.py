"""A run of the real controller on a simulated cluster: the job's :class:`Shape`, its config, and
:func:`simulated_runtime`, which builds the Runtime as a user would, with a SimulatedCluster backend and a
trail on the virtual clock. The worker classes are never constructed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ftstate.controller.runtime import Runtime
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError
from ftstate.core.worker import RolloutWorker, TrainerWorker
from ftstate.simulation.cluster import SimulatedCluster
from ftstate.simulation.costs import Costs

#: Where the virtual clock's epoch lies (the trail's ``ts`` of virtual time 0): fixed, so that
#: two runs of one seed write the same bytes.
EPOCH = 1_767_225_600.0  # 2026-01-01T00:00:00Z
#: The ratio :meth:`Shape.of` builds: one trainer rank per 8 members (disaggregated RL is
#: rollout-heavy), e.g. 1,250 trainer ranks among 10,000 members.
MEMBERS_PER_TRAINER_RANK = 8


class SimulatedTrainer(TrainerWorker):
    """The trainer class a simulated run names (never constructed: see the module docstring)."""


class SimulatedRollout(RolloutWorker):
    """The rollout class a simulated run names (never constructed)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The job: ``rollouts`` and ``trainers`` ranks, ``spares`` per role (0: cold mode; trainer ranks share
    them), on ``nodes`` nodes, each with its members' CPUs plus ``headroom``."""

    rollouts: int
    nodes: int = 1
    spares: int = 1
    headroom: int = 1
    trainers: int = 1

    def __post_init__(self) -> None:
        for name, low in (("rollouts", 1), ("nodes", 1), ("spares", 0), ("headroom", 0), ("trainers", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(name, f"{value!r}: expected an integer >= {low}")

    @classmethod
    def of(cls, members: int, nodes: int | None = None) -> Shape:
        """A job of ``members`` members, 8 a node unless ``nodes`` is given: a trainer rank per
        :data:`MEMBERS_PER_TRAINER_RANK`, a spare per role per 200 members, the rest rollouts."""
        if not isinstance(members, int) or isinstance(members, bool) or members < 4:
            raise ConfigError("members", f"{members!r}: expected an integer >= 4")
        spares = max(1, members // 200)
        trainers = max(1, members // MEMBERS_PER_TRAINER_RANK)
        nodes = nodes if nodes is not None else max(1, math.ceil(members / 8))
        return cls(rollouts=members - trainers - 2 * spares, nodes=nodes, spares=spares, trainers=trainers)

    @property
    def members(self) -> int:
        return self.trainers + self.rollouts + 2 * self.spares

    @property
    def cpus_per_node(self) -> int:
        return math.ceil(self.members / self.nodes) + self.headroom


def config_for(shape: Shape, overrides: Mapping[str, Any] | None = None) -> RuntimeConfig:
    """The run's config: fault tolerance on (standby with spares), then ``overrides`` (a nested dict)."""
    base: dict[str, Any] = {
        "trainer_workers": shape.trainers,
        "rollout_workers": shape.rollouts,
        "fault_tolerance": {"enable": True, "mode": "standby" if shape.spares else "cold",
                            "standby_workers": max(shape.spares, 1), "reverse_weight_sync": True,
                            "trainer_ranks_per_spare": shape.trainers},
    }
    for key, value in (overrides or {}).items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return RuntimeConfig.from_dict(base, environ={})


def simulated_runtime(shape: Shape, *, costs: Costs | None = None, overrides: Mapping[str, Any] | None = None,
                      audit_path: str | None = None, keep_records: bool = True,
                      run_id: str = "sim", seed: int = 0) -> tuple[Runtime, SimulatedCluster]:
    """The real runtime on a simulated cluster of ``shape`` (start it inside a
    :class:`~ftstate.simulation.clock.VirtualTimeLoop`)."""
    cluster = SimulatedCluster(shape.nodes, cpus_per_node=shape.cpus_per_node, costs=costs, seed=seed)
    rt = runtime_on(cluster, config_for(shape, overrides), audit_path=audit_path, keep_records=keep_records,
                    run_id=run_id)
    return rt, cluster


def runtime_on(cluster: SimulatedCluster, config: RuntimeConfig, *, audit_path: str | None = None,
               keep_records: bool = True, run_id: str = "sim") -> Runtime:
    """The real runtime with ``config`` on ``cluster``, its audit trail on the loop's virtual clock."""
    import asyncio

    loop = asyncio.get_running_loop()
    audit = AuditTrail(audit_path, keep=keep_records, clock=loop.time, wall_clock=lambda: EPOCH + loop.time())
    return Runtime(config, trainer=SimulatedTrainer, rollout=SimulatedRollout, run_id=run_id, audit=audit,
                   backend=cluster)


__all__ = ["EPOCH", "MEMBERS_PER_TRAINER_RANK", "Shape", "SimulatedRollout", "SimulatedTrainer", "config_for", "runtime_on", "simulated_runtime"]
