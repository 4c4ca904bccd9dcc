"""Goodput, for ``ftstate simulate``: the fraction of a job's time that made progress, with ftstate (every
failure replayed through the real controller on a simulated cluster, the budget carried from failure to
failure, quiet time jumped over) and with the status quo (restart from the last checkpoint).
docs/simulation.md ("What a replay runs") describes both."""

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
    """The job without ftstate: ``checkpoint_interval_s`` of progress between checkpoints and ``restart_s``
    from a failure to training again (docs/benchmarks.md has the measured restart)."""

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
    """A job's goodput and each failure's cost; ``ended_at``: when a failure ended the job, else None."""

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
    """ftstate's goodput on ``schedule``, measured on the real controller (run it in a VirtualTimeLoop)."""
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
    """Run ``cycles`` steps with ``f`` injected ``after_s`` into the first; returns what it hit and how long
    the steps took (steps after the job is steady count as ``steady_s``)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # The step's head before the fault is undisturbed, not replayed: its calls end as they would have.
    cluster.step_under_way = (t0, after_s)
    first = asyncio.ensure_future(cycle())
    await asyncio.sleep(_CALLS_OUT_S)
    target, drain = _hit(rt, cluster, f)
    await first
    cluster.step_under_way = None
    skipped = 0.0
    for _ in range(cycles - 1):
        if drain is None and _steady(rt, cluster):
            # Nothing of the failure is left: the remaining cycles count as steady ones.
            skipped = (cycles - 1) * steady_s
            break
        await cycle()
    if drain is not None:
        await drain
    return target, loop.time() - t0 - _CALLS_OUT_S + after_s + skipped


async def _settle(rt: Any, cluster: Any, bound_s: float) -> None:
    """The calm before a failure: until the job is steady again, at most ``bound_s``, in intervals."""
    loop = asyncio.get_running_loop()
    end, step = loop.time() + bound_s, rt.config.heartbeat_interval_s
    while loop.time() < end and not _steady(rt, cluster):
        await asyncio.sleep(min(step, end - loop.time()))


def _steady(rt: Any, cluster: Any) -> bool:
    """Whether nothing of a failure is left in flight, by the controller's view and the simulated cluster's
    truth: group ready, no failover pending, every counted member READY (spares STANDBY) and answering, none
    on a poisoned node."""
    if rt.state != "READY" or rt.failover_pending:
        return False
    version, now = rt.weights_version, cluster.loop.time()
    for m in rt.members():
        if m.state in _GONE:
            continue
        if m.state != ("READY" if m.rank >= 0 else "STANDBY") or (m.rank >= 0 and m.weights_version != version):
            return False
        p = cluster.members.get(m.member)
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
