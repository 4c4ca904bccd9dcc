"""Goodput: the fraction of a job's time that made progress, with ftstate and with the status
quo it replaces (``ftstate simulate``).

**ftstate** is measured, not modelled: every failure of the schedule is replayed through the
real controller (:class:`~ftstate.controller.runtime.Runtime` on a
:class:`~ftstate.simulation.cluster.SimulatedCluster`) while a trainer loop runs
(``train_step`` then ``sync()``): the fault is injected at a drawn moment of a step, and the
failure's downtime is how much longer the next ``cycles`` steps took than they take
undisturbed. The run carries its state from failure to failure (spares spent and replaced,
``max_failovers`` spent): a failure that exhausts the budget ends the job there, as it would
for real, and the rest of its time makes no progress. The quiet time between failures is not
replayed step by step (a simulated week would be 600,000 heartbeat intervals): the spares get
up to ``settle_s`` to warm up again, and the job's clock jumps to the next failure. Nor is what
would be undisturbed: the calm ends once the job is steady, and a step after it is steady again
counts as the steady step it is (docs/simulation.md, "What a replay runs").

**The status quo**: one failure kills the job, which restarts from its last checkpoint
(``checkpoint_interval_s`` of progress apart): each failure loses the progress since that
checkpoint plus ``restart_s``; a maintenance notice gives time to checkpoint first, so it loses
only the restart. Both are on the same steady state (a step plus a sync is progress), so the
figures compare what failures cost, not how fast a step is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ftstate.core.budget import FAILOVER_KEY
from ftstate.core.errors import ConfigError, FTError
from ftstate.simulation.costs import Costs
from ftstate.simulation.mix import Failure
from ftstate.simulation.scenario import Shape, simulated_runtime

#: A step's calls all go out at the instant it starts; the fault comes this much after them.
_CALLS_OUT_S = 1e-6
#: Worker states that are not a process to hit (gone already).
_GONE = frozenset({"LOST", "RETIRED", "FAILED", "STOPPED"})


@dataclasses.dataclass(frozen=True)
class StatusQuo:
    """The job without ftstate. checkpoint_interval_s: progress between checkpoints;
    restart_s: from the failure to training again (this project's measurement of restarting
    the whole Ray job from a checkpoint: 10.9-11.7 s plus ~3.5 s for a fresh driver,
    DESIGN.md; minutes on a large job)."""

    checkpoint_interval_s: float = 3600.0
    restart_s: float = 14.4

    def __post_init__(self) -> None:
        if self.checkpoint_interval_s <= 0:
            raise ConfigError("checkpoint_interval_s", f"{self.checkpoint_interval_s!r}: expected a number > 0")
        if self.restart_s < 0:
            raise ConfigError("restart_s", f"{self.restart_s!r}: expected a number >= 0")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One failure's cost to a job: what hit it, when, and the seconds of progress it took."""

    at: float
    cause: str
    effect: str
    target: str
    downtime_s: float


@dataclasses.dataclass(frozen=True)
class Result:
    """A job's goodput (progress / time) and each failure's cost; ended_at: when a failure
    ended the job (ftstate: ``max_failovers`` exhausted, or the run failed), else None."""

    goodput: float
    outcomes: tuple[Outcome, ...]
    ended_at: float | None = None
    error: str | None = None
    #: ftstate: the failover budget at the end (:attr:`ftstate.controller.runtime.Runtime.failover_budget`).
    budget: dict[str, Any] | None = None

    def progress_curve(self, seconds: float) -> list[tuple[float, float]]:
        """(time, progress so far) at each failure and at the end, for the plot."""
        points, lost = [(0.0, 0.0)], 0.0
        for o in self.outcomes:
            points.append((o.at, o.at - lost))
            lost += o.downtime_s
            points.append((o.at + o.downtime_s, o.at - lost + o.downtime_s))
        end = self.ended_at if self.ended_at is not None else seconds
        points.append((end, end - lost))
        if self.ended_at is not None:
            points.append((seconds, end - lost))
        return points


def status_quo(schedule: Sequence[Failure], seconds: float, sq: StatusQuo) -> Result:
    """The status quo's goodput on ``schedule`` (see the module docstring)."""
    progress = t = 0.0
    outcomes = []
    for f in schedule:
        if f.at < t:
            continue  # while it restarts there is nothing left to kill
        progress += f.at - t
        checkpointed = progress if f.effect == "maintenance" else (progress // sq.checkpoint_interval_s
                                                                    * sq.checkpoint_interval_s)
        outcomes.append(Outcome(f.at, f.cause, f.effect, "the job", progress - checkpointed + sq.restart_s))
        progress = checkpointed
        t = f.at + sq.restart_s
    progress += max(0.0, seconds - t)
    return Result(goodput=progress / seconds if seconds else 1.0, outcomes=tuple(outcomes))


async def replay_ftstate(schedule: Sequence[Failure], seconds: float, *, shape: Shape, costs: Costs,
                         overrides: Mapping[str, Any] | None = None, seed: int = 0, cycles: int = 2,
                         settle_s: float | None = None, audit_path: str | None = None) -> Result:
    """ftstate's goodput on ``schedule``, measured on the real controller (run it in a
    :class:`~ftstate.simulation.clock.VirtualTimeLoop`; see the module docstring)."""
    loop = asyncio.get_running_loop()
    rt, cluster = simulated_runtime(shape, costs=costs, overrides=overrides, seed=seed, audit_path=audit_path,
                                    keep_records=False)
    settle = settle_s if settle_s is not None else 2 * costs.start_s
    rng = cluster.rng

    async def cycle() -> None:
        await rt.trainer("train_step")
        await rt.sync()

    outcomes: list[Outcome] = []
    ended_at: float | None = None
    error: str | None = None
    #: ftstate: the failover budget at the end (:attr:`ftstate.controller.runtime.Runtime.failover_budget`).
    budget: dict[str, Any] | None = None
    started = False
    try:
        await rt.start()
        await rt.sync()
        t0 = loop.time()
        await cycle()
        steady = loop.time() - t0
        started = True
        budget = rt.group.budget(FAILOVER_KEY)
        last_at, last_t = 0.0, loop.time()
        for f in schedule:
            await _settle(rt, cluster, settle)  # the quiet time before it: spares warm again
            # the job's clock jumps to the failure; the failover budget's window must see it
            budget.skip((f.at - last_at) - (loop.time() - last_t))
            last_at, last_t = f.at, loop.time()
            target = await _inject_during_a_step(rt, cluster, f, rng.random() * costs.train_step_s, cycle,
                                                 cycles, steady)
            took = target[1]
            outcomes.append(Outcome(f.at, f.cause, f.effect, target[0], max(0.0, took - cycles * steady)))
    except FTError as exc:  # the job ends at the failure it could not survive (or at its start)
        ended_at = schedule[len(outcomes)].at if started and len(outcomes) < len(schedule) else 0.0
        error = f"{type(exc).__name__}: {exc}"
    finally:
        budget = rt.failover_budget if started else None
        await rt.close()
    lost = sum(o.downtime_s for o in outcomes)
    made = (ended_at if ended_at is not None else seconds) - lost
    return Result(goodput=max(0.0, made) / seconds if seconds else 1.0, outcomes=tuple(outcomes),
                  ended_at=ended_at, error=error, budget=budget)


async def _inject_during_a_step(rt: Any, cluster: Any, f: Failure, after_s: float, cycle: Any,
                                cycles: int, steady_s: float) -> tuple[str, float]:
    """Run ``cycles`` steps with ``f`` injected ``after_s`` into the first; returns what it hit
    and how long the steps took (a step after the job is steady again counted as ``steady_s``,
    not replayed)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # The step's head before the fault is undisturbed: not replayed. Its trainer ranks' calls,
    # made now, end as they would have after_s from now, and the fault comes at once.
    cluster.step_under_way = (t0, after_s)
    first = asyncio.ensure_future(cycle())
    await asyncio.sleep(_CALLS_OUT_S)
    target, drain = _hit(rt, cluster, f)
    await first
    cluster.step_under_way = None
    skipped = 0.0
    for _ in range(cycles - 1):
        if drain is None and _steady(rt, cluster):
            # Nothing of the failure is left: the cycles still to come are undisturbed ones
            # and take the steady cycle's time, which the caller subtracts again.
            skipped = (cycles - 1) * steady_s
            break
        await cycle()
    if drain is not None:
        await drain
    return target, loop.time() - t0 - _CALLS_OUT_S + after_s + skipped


async def _settle(rt: Any, cluster: Any, bound_s: float) -> None:
    """The calm before a failure: until the job is steady again (spares warm), ``bound_s`` at
    most, in heartbeat intervals; nothing when it already is (the usual case at the end of a
    failure's cycles, where sleeping through the bound replayed only quiet heartbeat rounds)."""
    loop = asyncio.get_running_loop()
    end, step = loop.time() + bound_s, rt.config.heartbeat_interval_s
    while loop.time() < end and not _steady(rt, cluster):
        await asyncio.sleep(min(step, end - loop.time()))


def _steady(rt: Any, cluster: Any) -> bool:
    """Whether nothing of a failure is left in flight, told by the controller's view and the
    simulated cluster's truth together: the group ready, no failover pending, every member the
    controller counts on READY at the current weights version (a spare STANDBY) with its
    process up and answering, and none on a node that kills what it hosts."""
    ms, *_, failover, _ = rt._parts()  # the simulator's own look, one walk of the members
    if rt.state != "READY" or failover.pending:
        return False
    version, now = ms.weights_version, cluster.loop.time()
    for m in ms:
        state = m.machine.state
        if state in _GONE:
            continue
        if state != ("READY" if m.rank >= 0 else "STANDBY") or (m.rank >= 0 and m.machine.weights_version != version):
            return False
        p = cluster.members.get(m.name)
        if p is None or not p.alive or p.hung or p.cut_off or p.up_at > now or p.node_id in cluster.poisoned:
            return False
    return True


def _hit(rt: Any, cluster: Any, f: Failure) -> tuple[str, asyncio.Future[Any] | None]:
    members = [m for m in rt.members() if m.state not in _GONE and m.state != "INIT"]
    if f.effect in ("member", "hang"):
        m = members[int(f.pick * len(members))]
        (cluster.kill_member if f.effect == "member" else cluster.hang_member)(m.member)
        return m.member, None
    nodes = sorted({m.node_id for m in members if m.node_id is not None})
    node = nodes[int(f.pick * len(nodes))]
    if f.effect == "node":
        cluster.lose_node(node)
        return node, None
    if f.effect == "poison":
        cluster.poison_node(node)
        return node, None

    async def maintenance() -> None:  # notice, drain, then the node goes for its maintenance
        await rt.drain(node, reason=f.cause, source="simulation", kind="maintenance")
        cluster.lose_node(node, reason="host maintenance")

    return node, asyncio.ensure_future(maintenance())


__all__ = ["Outcome", "Result", "StatusQuo", "replay_ftstate", "status_quo"]
