"""A fault schedule against a live run on a multi-node Ray cluster, invariants after every step.

:class:`ChaosRun` starts one :class:`ftstate.Runtime` (1 trainer, 3 rollouts, 2 spares per role,
fault tolerance on) on a :class:`~tests.multinode.harness.MultiNode` cluster and plays a
:class:`~tests.chaos.schedule.Schedule`: each step is a train step and a sync, with the step's
faults landing before it, during the train step, during the sync or during a failover the sync
went through. Every fault is real: SIGKILL and SIGSTOP to the member's process, a whole node
lost (:func:`~tests.multinode.harness.kill_node`; a fresh node of the same name added after the
step), a drain through ``rt.drain`` (what a maintenance notice does), a corrupted bucket, a
trainer slow to produce its state.

After every step it checks the invariants (the first one broken ends the run as a violation):

- the sync completed, or ended the run with a typed ftstate error that the failover budget
  explains (``max_failovers`` spent); never a bare ``FTError``, never another exception;
- every serving rollout holds the trainer's bytes at the reported version: the trainer's own
  hash of its state, the run's committed checksum and each serving rollout's hash of what it
  holds are one value, and ``rt.weights_version`` is the version the sync reported;
- no version goes backwards (weights or group);
- no serving member runs on a node that was lost.

After the run: no actor or process of the run is left, no ``/dev/shm`` segment of its
processes, and its audit trail passes ``ftstate audit --check``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import FailoverBudgetExhausted, FTError
from ftstate.core.protocol import ChaosCorrupt
from tests.chaos.schedule import Fault, Schedule
from tests.integration.workers import TinyRollout
from tests.multinode.harness import MultiNode, pid_alive, resource
from tests.multinode.test_node_loss import SlowTrainer

#: The head node (the driver's): never lost, never drained.
HEAD = "a"
#: How long the trainer's slowed state_dict() takes (a fault that lands mid-sync), seconds.
SLOW_STATE_S = 0.8
#: How long a train step takes when a fault is to land during it, seconds.
SLOW_STEP_S = 0.6
#: Bound on waiting for a moment (the sync under way, a failover under way), seconds.
MOMENT_WAIT_S = 20.0
#: Bound on waiting for the spares to warm before the schedule starts, seconds.
SPARES_WAIT_S = 120.0


#: The trainer: TinyTrainer whose next state_dict() can be made slow (a fault then lands mid-sync).
ChaosTrainer = SlowTrainer


def chaos_config(tmp: Path, *, heartbeat_interval_s: float | None = None, heartbeat_timeout_s: float | None = None,
                 max_failovers: int = 12) -> ftstate.RuntimeConfig:
    """The run a schedule plays against; heartbeats default to ftstate's own defaults."""
    data: dict[str, Any] = {
        "rollout_workers": 3,
        "bucket_size_mb": 0.0625,
        "init_timeout_s": 90,
        "sync_timeout_s": 180,
        "failover_timeout_s": 90,
        "audit_log": str(tmp / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "mode": "standby", "standby_workers": 2,
                            "reverse_weight_sync": True, "max_failovers": max_failovers},
        "placement": {"trainer": {"resources": {resource(HEAD): 1}}},
    }
    if heartbeat_interval_s is not None:
        data["heartbeat_interval_s"] = heartbeat_interval_s
    if heartbeat_timeout_s is not None:
        data["heartbeat_timeout_s"] = heartbeat_timeout_s
    return ftstate.RuntimeConfig.from_dict(data, environ={})


@dataclasses.dataclass
class Outcome:
    """How a schedule went. violation: the first invariant broken (None: every one held);
    ended: the typed error that ended the run, explained by the budget (None: it ran to the
    end); injected: what each fault hit; log: one line per step and fault."""

    schedule: Schedule
    violation: str | None = None
    ended: str | None = None
    steps_run: int = 0
    injected: list[str] = dataclasses.field(default_factory=list)
    syncs: int = 0
    failovers: int = 0
    seconds: float = 0.0
    log: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        head = "ok" if self.ok else f"VIOLATION: {self.violation}"
        lines = [f"{head} ({self.steps_run} steps, {self.syncs} syncs, {self.failovers} failovers, "
                 f"{self.seconds:.1f}s){f'; ended by {self.ended}' if self.ended else ''}",
                 self.schedule.describe(), "log:", *(f"  {line}" for line in self.log)]
        if not self.ok:
            lines.append("replay: python -m tests.chaos --replay SCHEDULE.json  (the schedule above as JSON)")
        return "\n".join(lines)


class Violation(AssertionError):
    """An invariant did not hold."""


class ChaosRun:
    """Plays one schedule on ``cluster``. tmp: a directory for the run's audit trail."""

    def __init__(self, cluster: MultiNode, schedule: Schedule, tmp: Path, **config: Any) -> None:
        self.mn = cluster
        self.schedule = schedule
        self.tmp = tmp
        self.config = chaos_config(tmp, **config)
        self.outcome = Outcome(schedule)
        self.lost_nodes: set[str] = set()
        self._readd: list[str] = []
        self._stopped: list[int] = []
        self._pids: set[int] = set()

    # -- the run -------------------------------------------------------------------------

    async def run(self) -> Outcome:
        t0 = time.monotonic()
        rt = ftstate.Runtime(self.config, trainer=ChaosTrainer, rollout=TinyRollout)
        try:
            try:
                async with rt:
                    self.rt = rt
                    await self._spares_warm(4)
                    first = await rt.sync()
                    self._track()
                    self._last = (first.weights_version, first.group_version)
                    await self._consistent(first)
                    for step in range(self.schedule.steps):
                        if not await self._step(step):
                            break
                        self.outcome.steps_run += 1
                    self._track()
                    self.outcome.failovers = len(rt.failovers)
            finally:
                self._release()
                self._readd_nodes()
            self._after(rt)
        except Violation as exc:
            self.outcome.violation = str(exc)
        self.outcome.seconds = time.monotonic() - t0
        return self.outcome

    async def _step(self, step: int) -> bool:
        """One step; False when the run ended (explained). Raises Violation."""
        rt = self.rt
        faults = self.schedule.at(step)
        moments = {w: [f for f in faults if f.when == w] for w in ("before", "mid-step", "mid-sync", "mid-failover")}
        try:
            for f in moments["before"]:
                await self._inject(f)
            if moments["mid-step"]:
                train = asyncio.ensure_future(rt.trainer("train_step", 0.1, SLOW_STEP_S))
                await asyncio.sleep(SLOW_STEP_S / 3)
                for f in moments["mid-step"]:
                    await self._inject(f)
                await train
            else:
                await rt.trainer("train_step")
            if moments["mid-sync"] or moments["mid-failover"]:
                await rt.trainer("slow_next_state_dict", SLOW_STATE_S)
            sync = asyncio.ensure_future(rt.sync())
            if moments["mid-sync"]:
                await self._moment(sync, lambda: rt.state == "SYNCING", "the sync under way")
                for f in moments["mid-sync"]:
                    await self._inject(f)
            if moments["mid-failover"]:
                if not await self._moment(sync, lambda: rt.state in ("DEGRADED", "PROMOTING"), "a failover"):
                    self.outcome.log.append(f"step {step}: no failover under way; mid-failover faults land now")
                for f in moments["mid-failover"]:
                    await self._inject(f)
            report = await sync
            self.outcome.syncs += 1
            self._track()
            await self._consistent(report)
        except Violation:
            raise
        except FTError as exc:
            if type(exc) is FTError:
                raise Violation(f"step {step}: a bare FTError reached the user: {exc}") from exc
            why = self._explained(exc)
            if why is None:
                raise Violation(f"step {step}: the run ended with {type(exc).__name__}, which the failover "
                                f"budget does not explain ({self._spent()}/{self.config.fault_tolerance.max_failovers} "
                                f"spent): {exc}") from exc
            self.outcome.ended = f"{type(exc).__name__} ({why})"
            self.outcome.log.append(f"step {step}: ended: {type(exc).__name__}: {exc}")
            return False
        except Exception as exc:
            raise Violation(f"step {step}: {type(exc).__name__} is not an ftstate error: {exc}") from exc
        self.outcome.log.append(f"step {step}: v{report.weights_version} g{report.group_version} "
                                f"{len(report.rollouts)} rollouts, {report.failovers} failovers, {report.seconds:.2f}s")
        self._readd_nodes()
        return True

    # -- faults ----------------------------------------------------------------------------

    async def _inject(self, f: Fault) -> None:
        rt = self.rt
        members = [m for m in rt.members() if m.state not in ("LOST", "RETIRED", "STOPPED", "FAILED")]
        hit: str
        if f.kind in ("kill", "stop"):
            if f.target == "spare":
                cands = [m for m in members if m.rank < 0 and m.state == "STANDBY" and m.pid]
            else:
                cands = [m for m in members if m.role == f.target and m.rank >= 0 and m.pid]
            if not cands:
                return self._skip(f, f"no live {f.target}")
            m = sorted(cands, key=lambda m: m.member)[f.pick % len(cands)]
            if not pid_alive(m.pid):  # died already (its node was lost) and not declared yet
                return self._skip(f, f"{m.member} (pid {m.pid}) is already dead")
            rt.audit.record("chaos", member=m.member, fault="kill" if f.kind == "kill" else "hang", pid=m.pid)
            try:
                os.kill(m.pid, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:
                return self._skip(f, f"{m.member} (pid {m.pid}) died as it was hit")
            if f.kind == "stop":
                self._stopped.append(m.pid)
            hit = f"{f.kind} {m.member} (pid {m.pid})"
        elif f.kind in ("node", "drain"):
            names = sorted(n for n in self.mn.alive() if n != HEAD and self.mn.node_id(n) not in self.lost_nodes)
            if f.kind == "drain":
                occupied = {m.node_id for m in members}
                names = [n for n in names if self.mn.node_id(n) in occupied]
            if not names:
                return self._skip(f, "no node to hit")
            name = names[f.pick % len(names)]
            node_id = self.mn.node_id(name)
            on_node = sorted(m.member for m in members if m.node_id == node_id)
            if f.kind == "node":
                rt.audit.record("chaos", fault="node lost", node_id=node_id, members=on_node)
                await asyncio.to_thread(self.mn.kill, name)
                self.lost_nodes.add(node_id)
                self._readd.append(name)
                hit = f"node {name} lost ({', '.join(on_node) or 'nobody'})"
            else:
                rt.audit.record("chaos", fault="drain", node_id=node_id, members=on_node)
                record = await rt.drain(node_id, reason="chaos maintenance notice", source="chaos")
                hit = f"drain {name} ({', '.join(on_node) or 'nobody'}): {record.outcome}"
        elif f.kind == "corrupt":
            cands = sorted(rt.serving_rollouts())
            if not cands:
                return self._skip(f, "no serving rollout")
            name = cands[f.pick % len(cands)]
            import ray.exceptions

            try:  # the runner's own call: a rollout hit by the fault before it may be dead already
                await rt.handle(name).chaos_corrupt_next_bucket.remote(ChaosCorrupt())
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
                return self._skip(f, f"{name} is dead or unreachable")
            rt.audit.record("chaos", member=name, fault="corrupt")
            hit = f"corrupt the next bucket of {name}"
        else:  # slow
            await rt.trainer("slow_next_state_dict", SLOW_STATE_S)
            hit = f"trainer slow ({SLOW_STATE_S}s state_dict)"
        self.outcome.injected.append(hit)
        self.outcome.log.append(f"{f.describe()} -> {hit}")

    def _skip(self, f: Fault, why: str) -> None:
        self.outcome.log.append(f"{f.describe()} -> skipped: {why}")

    async def _moment(self, sync: asyncio.Future[Any], cond: Any, what: str) -> bool:
        """Until ``cond()`` or the sync ended (bounded by MOMENT_WAIT_S); whether cond held."""
        deadline = time.monotonic() + MOMENT_WAIT_S
        while not cond():
            if sync.done() or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def _release(self) -> None:
        for pid in self._stopped:  # their actors are dead to the run; the processes must go
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self._stopped.clear()

    def _readd_nodes(self) -> None:
        # In the main thread (Ray's node start installs signal handlers), so it holds the event
        # loop for the second or two a node takes to start: between steps, with no sync in flight.
        while self._readd:
            self.mn.add(self._readd.pop(0))  # a fresh node (new node id) under the same name

    # -- invariants ----------------------------------------------------------------------------

    def _spent(self) -> int:
        return sum(1 for r in self.rt.audit.records if r["event"] == "budget_spent")

    def _explained(self, exc: FTError) -> str | None:
        budget = self.config.fault_tolerance.max_failovers
        if isinstance(exc, FailoverBudgetExhausted) or self._spent() >= budget:
            return f"max_failovers {budget} spent"
        return None

    def _track(self) -> None:
        self._pids |= {m.pid for m in self.rt.members() if m.pid}

    async def _consistent(self, report: Any) -> None:
        rt = self.rt
        wv, gv = report.weights_version, report.group_version
        if rt.weights_version != wv:
            raise Violation(f"the sync reported weights version {wv}, the run holds {rt.weights_version}")
        last_wv, last_gv = getattr(self, "_last", (0, 0))
        if wv < last_wv or gv < last_gv:
            raise Violation(f"a version went backwards: weights {last_wv} -> {wv}, group {last_gv} -> {gv}")
        self._last = (wv, gv)
        trainer_sum = await rt.trainer("checksum")
        sums = await rt.rollout("checksum")
        serving = rt.serving_rollouts()
        if not sums or len(sums) != len(serving):
            raise Violation(f"{len(sums)} checksums from {len(serving)} serving rollouts")
        if any(s != trainer_sum for s in sums) or trainer_sum != rt.checksum:
            raise Violation(f"not every serving rollout holds the trainer's bytes at v{wv}: trainer {trainer_sum}, "
                            f"committed {rt.checksum}, rollouts {dict(zip(serving, sums, strict=True))}")
        on_lost = [m.member for m in rt.members() if m.member in serving and m.node_id in self.lost_nodes]
        if on_lost:
            raise Violation(f"serving on a lost node: {on_lost}")

    def _after(self, rt: Any) -> None:
        import ray

        deadline = time.monotonic() + 20
        while True:
            actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if rt.run_id in a["name"]]
            alive = sorted(p for p in self._pids if pid_alive(p))
            if not actors and not alive:
                break
            if time.monotonic() > deadline:
                raise Violation(f"left behind after the run: actors {actors}, processes {alive}")
            time.sleep(0.1)
        segments = [n for n in os.listdir("/dev/shm") if n.startswith("ftstate-")
                    and any(f"-p{p}-" in n for p in self._pids)]
        if segments:
            raise Violation(f"/dev/shm segments of the run left behind: {segments}")
        violations = check_trail(str(self.config.audit_log))
        if violations:
            raise Violation(f"the audit trail fails --check: {[str(v) for v in violations[:5]]}")

    async def _spares_warm(self, n: int) -> None:
        """Until ``n`` spares are warm, for at most SPARES_WAIT_S; the schedule then starts with
        what there is (how many spares a run has is no invariant; a loss finds out)."""
        deadline = time.monotonic() + SPARES_WAIT_S
        while sum(m.state == "STANDBY" for m in self.rt.members()) < n:
            if time.monotonic() > deadline:
                self.outcome.log.append(f"start: fewer than {n} spares warm after {SPARES_WAIT_S:g}s: "
                                        f"{[(m.member, m.state) for m in self.rt.members() if m.rank < 0]}")
                return
            await asyncio.sleep(0.1)
