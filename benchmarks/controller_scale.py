"""Benchmark: the real controller's CPU as the job grows, against simulated members.

For N = 10, 100, 1,000 and 10,000 members (one trainer rank per 8 members: 1 to 1,250 ranks,
sending their parts in the sharded sync; rollouts; a spare per role per 200 members; 8 members
a node: 2 to 1,250 nodes), the real :class:`~ftstate.controller.runtime.Runtime`
drives a :class:`~ftstate.simulation.cluster.SimulatedCluster` in virtual time, and this
measures the process's CPU seconds (``time.process_time``: real CPU, not virtual time) for

- start: every actor started, group version 1 formed;
- sync: one ``await rt.sync()`` (mean of ``--syncs``), and the audit trail's bytes it wrote;
  also net of the heartbeats that ran meanwhile (``sync_net_s``: a sync lasts about one
  heartbeat interval of virtual time, whose watchdog CPU is measured on its own below), and
  the objects it left to the collector's oldest generation (``sync_promoted``, a count);
- heartbeat interval: one ``heartbeat_interval_s`` with nothing happening but the watchdog
  (mean of ``--intervals``, from the fourth interval after the last sync: ``QUIET_AFTER``), and the same with the garbage collector off (what the Python
  collector costs of it: its full collections walk every live object);
- the collector's full collections per sync and per heartbeat interval (counted: the CPU
  figures at 10,000 members swing by whether one lands in a short measurement, the count does
  not; use ``--intervals 12`` or more for a steady interval figure);
- failover of one member: a rollout SIGKILLed, from the loss noticed (the group leaves READY)
  until its replacement serves and the group is READY;
- failover of one trainer rank (with several): rank 1 SIGKILLed, replaced by a spare, its
  part of the last sync restored from a rollout (:mod:`ftstate.controller.ranks`);
- failover of one node: a node's 8 members lost at once (found by their heartbeats, as on
  Ray), from the loss noticed until all are replaced (one round);
  each also net of the heartbeats that ran meanwhile (its virtual duration times the
  watchdog's CPU per second), which is the round's own cost; each the median of ``--failovers``
  rounds (default 3, each of a member not touched before: one round's CPU moves by up to 2x
  from one to the next), each round's CPU kept in ``failover_*_rounds_s``;
- scaling (issue 44): the fleet grown by a tenth of its rollouts in one ``rt.add_rollouts``
  (started, one group version formed, each newcomer fed by a rollout holding the version and
  proven; ``scale_add_s``, its virtual duration ``scale_add_virtual_s``) and those removed again
  (``scale_remove_s``);

The CPU is the whole process's: the controller's and the simulated members' own (a member's
answer is one future and one timer, a fraction of the controller's work for it), so it is an
upper bound on the controller's. The controller's own is measured too, by sampling
(:class:`_MembersShare`: a sample every half millisecond, the members' if it lands in their
modelled code, else the controller's): ``sync_controller_s`` (a sync without the members' share
and without the samples taken in the watchdog's rounds that ran meanwhile,
``sync_heartbeat_share``), ``heartbeat_interval_controller_s`` and ``failover_*_controller_s``
(the median round less the members' and the watchdog's rounds' share of that kind's rounds,
``failover_*_members_share``); ``sync_members_share`` is the members' fraction of a sync.
Syncs and heartbeat rounds run with the collector paused, as the runtime does by default
(``gc_pause_s``); what that defers is counted where it lands. Each figure of N is also given as a ratio to the figure of
N/10 (linear: 10). ``--gc-threshold 50000`` runs it with a larger first threshold of the
collector (its young collections scan every call in flight: 10,000 pending calls are scanned
again every 700 allocations). ``--loop looptime`` runs the same on the ``looptime`` library's loop
instead of :class:`~ftstate.simulation.clock.VirtualTimeLoop` (if installed). ``--gc-freeze``
calls ``gc.freeze()`` once the runtime has started: the run's members and machines, which live as
long as it does, are then never walked again by the collector's full collections (at 10,000
members those are half of a sync's CPU).

``--repeat R`` measures each size R times, each in a fresh process, the sizes in turn, and gives
the median of each figure, the ratios of the medians, and the goal's ratios run by run: one run's
ratio moves by ±30 % on this shared two-core machine (docs/benchmarks.md).

    python benchmarks/controller_scale.py [--sizes 10,100,1000,10000] [--syncs 3] [--intervals 3]
        [--failovers 3] [--repeat 1] [--loop virtual|looptime] [--gc-threshold N] [--gc-freeze]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ftstate.controller.backend import AgentMemory
from ftstate.simulation.clock import VirtualTimeLoop
from ftstate.simulation.cluster import SimulatedCluster
from ftstate.simulation.scenario import Shape, simulated_runtime

#: Syncs and heartbeat intervals are repeated (``--syncs``, ``--intervals`` at least) until they
#: take about this much CPU, so that the members' share rests on a few hundred samples and the
#: CPU on many clock ticks at every N.
SAMPLED_CPU_S = 0.5

#: Heartbeat intervals left to pass after the syncs before the quiet intervals are measured.
QUIET_AFTER = 3

#: Enough failovers for every fault this benchmark injects (the default 5 would end the run).
OVERRIDES = {"fault_tolerance": {"max_failovers": 1_000_000}}


async def _until(done: Callable[[], bool], step: float = 0.01, limit: float = 600.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not done():
        if loop.time() > end:
            raise TimeoutError("the simulated failover did not finish")
        await asyncio.sleep(step)


async def _failover_round(rt: Any, share: _MembersShare | None = None) -> tuple[float, float, int]:
    """Wait until the group has noticed the loss (left READY: detection, the heartbeats' work)
    and is READY again; returns the CPU and the virtual seconds of that round, and its
    function calls (:class:`_CallCount`, with ``--calls``). ``share``: sampled while it runs."""
    loop = asyncio.get_running_loop()
    await _until(lambda: rt.state != "READY", step=0.005)
    t, v = time.process_time(), loop.time()
    with share if share is not None else contextlib.nullcontext(), _CallCount() as counted:
        await _until(lambda: rt.state == "READY", step=0.005)
    return time.process_time() - t, loop.time() - v, counted.calls


class _CallCount:
    """With ``--calls``: counts the Python function calls made while entered (cProfile's count,
    C functions included). The work done, exact and the same from run to run for a seed, where
    the CPU a call costs grows with the heap (the caches): ×10.0 calls for ×10 members says the
    code does linear work, whatever a run's CPU ratio says. Off (the default), it counts nothing
    and costs nothing: the profiler slows every call, so the CPU figures of a run with
    ``--calls`` are not comparable."""

    enabled = False

    def __init__(self) -> None:
        self.calls = 0
        self._profile: cProfile.Profile | None = None

    def __enter__(self) -> _CallCount:
        if _CallCount.enabled:
            self._profile = cProfile.Profile()
            self._profile.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._profile is not None:
            self._profile.disable()
            self.calls = sum(entry.callcount for entry in self._profile.getstats())


async def measure(members: int, syncs: int, intervals: int, trail: str, freeze: bool = False,
                  failovers: int = 3) -> dict[str, Any]:
    shape = Shape.of(members)
    rt, cluster = simulated_runtime(shape, keep_records=False, audit_path=trail, overrides=OVERRIDES)
    out: dict[str, Any] = {"members": shape.members, "nodes": shape.nodes, "rollouts": shape.rollouts,
                           "trainers": shape.trainers}
    cpu = time.process_time
    t = cpu()
    await rt.start()
    out["start_s"] = cpu() - t
    if freeze:  # the run's long-lived objects (members, machines) out of the collector's scans
        gc.freeze()
    await rt.sync()  # the first sync resyncs the constructed rollouts: not the steady state
    t = cpu()
    await rt.sync()
    # enough syncs for the members' share to rest on a few hundred samples
    syncs = max(syncs, math.ceil(SAMPLED_CPU_S / max(cpu() - t, 1e-4)))
    size = os.path.getsize(trail)
    full = _FullCollections()
    loop = asyncio.get_running_loop()
    sync_share = _MembersShare()
    t, v = cpu(), loop.time()
    with full, sync_share, _CallCount() as counted:
        for _ in range(syncs):
            await rt.sync()
    out["syncs"] = syncs
    out["sync_calls"] = counted.calls / syncs
    out["sync_s"] = (cpu() - t) / syncs
    out["sync_virtual_s"] = (loop.time() - v) / syncs
    out["sync_full_gcs"] = full.count / syncs
    out["sync_promoted"] = full.promoted / syncs
    out["audit_bytes_per_sync"] = (os.path.getsize(trail) - size) / syncs
    interval = rt.config.heartbeat_interval_s
    # The rounds just after a sync judge every answer the sync moved (then vouch for them all):
    # the sync's tail, not a quiet interval. Measured, they were 2 of ~460 intervals at 1,000
    # members and 2 of ~32 at 10,000, which alone made the ratio ×14-20 where a quiet interval's
    # is ×10-11.
    await asyncio.sleep(QUIET_AFTER * interval)
    t = cpu()
    await asyncio.sleep(interval)
    intervals = max(intervals, min(math.ceil(SAMPLED_CPU_S / max(cpu() - t, 1e-5)), 10_000))
    out["intervals"] = intervals
    full = _FullCollections()
    hb_share = _MembersShare()
    t = cpu()
    with full, hb_share, _CallCount() as counted:
        await asyncio.sleep(intervals * interval)
    out["heartbeat_interval_calls"] = counted.calls / intervals
    out["heartbeat_interval_s"] = (cpu() - t) / intervals
    out["heartbeat_full_gcs"] = full.count / intervals
    gc.disable()
    try:
        t = cpu()
        await asyncio.sleep(intervals * interval)
        out["heartbeat_interval_gc_off_s"] = (cpu() - t) / intervals
    finally:
        gc.enable()
    hb = out["heartbeat_interval_s"] / interval  # the watchdog's CPU per second of virtual time
    out["sync_net_s"] = out["sync_s"] - hb * out["sync_virtual_s"]
    # the controller's own: the members' sampled share taken out of the sync and of the
    # heartbeats that ran meanwhile
    out["sync_members_share"] = sync_share.share
    out["heartbeat_members_share"] = hb_share.share
    out["heartbeat_interval_controller_s"] = out["heartbeat_interval_s"] * (1 - hb_share.share)
    # The heartbeats' rounds during a sync are found by sampling, not subtracted at a quiet
    # interval's rate: during a sync every member is busy, and a busy member's answer is judged
    # one by one where a quiet one is vouched for by its node's round (docs/benchmarks.md).
    out["sync_heartbeat_share"] = sync_share.watchdog_share
    out["sync_controller_s"] = out["sync_s"] * (1 - sync_share.share - sync_share.watchdog_share)
    # Each failover is a single event whose CPU moves by tens of percent from one to the next
    # (where the collector and the cache stand when it lands): ``failovers`` of each kind, the
    # median taken (``--failovers``), each of a member not touched before.
    rounds: dict[str, list[tuple[float, float, int]]] = {"member": [], "rank": [], "node": []}
    shares = {kind: _MembersShare() for kind in rounds}
    for k in range(1, failovers + 1):
        cluster.kill_member(f"rollout-{k}")
        rounds["member"].append(await _failover_round(rt, shares["member"]))
    for k in range(1, failovers + 1 if shape.trainers > 1 else 1):
        cluster.kill_member(f"trainer-{k}")
        rounds["rank"].append(await _failover_round(rt, shares["rank"]))
    lost_nodes: set[str] = set()
    for _ in range(min(failovers, max(shape.nodes // 4, 1))):  # three quarters of the nodes stay
        node = next(m.node_id for m in rt.members() if m.role == "rollout" and m.rank >= 1
                    and m.node_id is not None and m.node_id not in lost_nodes)
        lost_nodes.add(node)
        out.setdefault("node_members", len(cluster.lose_node(node)))
        rounds["node"].append(await _failover_round(rt, shares["node"]))
    out["failovers"] = failovers
    for kind, measured in rounds.items():
        if measured:
            out[f"failover_{kind}_s"] = statistics.median(c for c, _, _ in measured)
            out[f"failover_{kind}_virtual_s"] = statistics.median(v for _, v, _ in measured)
            out[f"failover_{kind}_net_s"] = statistics.median(c - hb * v for c, v, _ in measured)
            out[f"failover_{kind}_rounds_s"] = [round(c, 5) for c, _, _ in measured]  # each round's CPU
            out[f"failover_{kind}_calls"] = statistics.median(n for _, _, n in measured)
            share = shares[kind]
            out[f"failover_{kind}_members_share"] = share.share
            out[f"failover_{kind}_controller_s"] = out[f"failover_{kind}_s"] * (1 - share.share - share.watchdog_share)
    # The fleet grown by a tenth and shrunk back (issue 44): rt.add_rollouts (each newcomer
    # started, fed by a holder, proven) and rt.remove_rollouts, CPU and virtual time of each.
    added = max(1, shape.rollouts // 10)
    t, v = cpu(), loop.time()
    with _CallCount() as counted:
        names = await rt.add_rollouts(added)
    out["scale_added"] = added
    out["scale_add_s"], out["scale_add_virtual_s"], out["scale_add_calls"] = cpu() - t, loop.time() - v, counted.calls
    assert rt.scalings[-1].trainer_sources == 0, rt.scalings[-1]
    t, v = cpu(), loop.time()
    with _CallCount() as counted:
        await rt.remove_rollouts(names)
    out["scale_remove_s"], out["scale_remove_virtual_s"], out["scale_remove_calls"] = (
        cpu() - t, loop.time() - v, counted.calls)
    await rt.close()
    return out


class _FullCollections:
    """Counts the collector's full collections while entered (``gc.callbacks``): at 10,000
    members each walks every live object (~0.3 s), so whether one lands in a short measurement
    is most of its spread; their rate (a count, the same run to run) is what changes with code.

    Also counts the objects promoted to the oldest generation (``promoted``: those alive at a
    generation-1 collection). That is what sets the rate of full collections: one comes once
    a quarter of the long-lived heap has been promoted since the last, so their cost per sync
    is proportional to what a sync keeps alive across collections, whatever the heap's size."""

    def __init__(self) -> None:
        self.count = 0
        self.promoted = 0
        self._young = 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2 and phase == "stop":
            self.count += 1
        elif info["generation"] == 1:
            if phase == "start":
                self._young = len(gc.get_objects(0)) + len(gc.get_objects(1))
            else:
                self.promoted += self._young - info["collected"]

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class _MembersShare:
    """While entered, samples where the process's CPU goes (``SIGALRM`` every ``INTERVAL_S``
    of the wall clock: a run in virtual time never sleeps, so its wall time is its CPU time,
    and the kernel's CPU timer, ``SIGPROF``, fires only at its 4 ms ticks here, a handful of
    samples in a 13 ms failover round) and counts the samples taken in the simulated members' own code: what, on a
    real cluster, runs in the workers' and the agents' processes, not the controller's. A
    sample is theirs when the innermost frame of ftstate's or asyncio's is in
    :mod:`ftstate.simulation.members` (a member deciding its answer and when, a collective,
    the answer's outcome, a node agent calling its members and collecting their outcomes; not
    the rest of :class:`~ftstate.simulation.members.AgentBatch`, the stream the controller
    iterates as it would Ray's) or the simulation's :class:`TimerQueue` (when the
    members' answers come). Everything else is the controller's: its own code, the event loop,
    the audit trail, the backend's entry points (Ray's call submission on a real cluster, far
    dearer than the simulation's), and the garbage collector. The cluster's ``loop`` accessor, and
    the agents' memory of their last reply (``AgentMemory``), are their callers'. A signal is
    handled between two bytecodes, so a sample after a system call (the audit trail's write)
    lands on the controller's side: an error against the controller, never for it."""

    INTERVAL_S = 0.0005

    def __init__(self) -> None:
        self.samples = 0
        self.members = 0
        #: The controller's samples taken in its watchdog's rounds (the heartbeats that run
        #: while a sync does: their own figure, not the sync's).
        self.watchdog = 0
        self._previous: Any = None

    @staticmethod
    def _members_code(frame: Any) -> bool:
        while frame is not None:
            code = frame.f_code
            if code is _LOOP_ACCESSOR or code is _AGENT_MEMORY:  # read or run by whoever called it: theirs
                frame = frame.f_back
                continue
            name = code.co_filename
            if name.endswith(_MEMBERS_FILE):
                return not code.co_qualname.startswith("AgentBatch.") or code.co_qualname in _AGENTS_WORK
            if name.endswith(_CLOCK_FILE):
                return code.co_qualname.startswith("TimerQueue.")
            if _FTSTATE_DIR in name or _ASYNCIO_DIR in name:
                return False
            frame = frame.f_back
        return False

    @staticmethod
    def _watchdog_round(frame: Any) -> bool:
        while frame is not None:
            code = frame.f_code
            if code.co_filename.endswith(_VIGIL_FILE) or (
                    code.co_filename.endswith(_WATCHDOG_FILE) and code.co_qualname in _ROUND_FRAMES):
                return True
            frame = frame.f_back
        return False

    def _sample(self, signum: int, frame: Any) -> None:
        self.samples += 1
        if self._members_code(frame):
            self.members += 1
        elif self._watchdog_round(frame):
            self.watchdog += 1

    @property
    def share(self) -> float:
        """The members' share of the samples (0 with none taken)."""
        return self.members / self.samples if self.samples else 0.0

    @property
    def watchdog_share(self) -> float:
        """The share of the samples taken in the watchdog's periodic rounds (and the vigils)."""
        return self.watchdog / self.samples if self.samples else 0.0

    def __enter__(self) -> _MembersShare:
        self._previous = signal.signal(signal.SIGALRM, self._sample)
        signal.setitimer(signal.ITIMER_REAL, self.INTERVAL_S, self.INTERVAL_S)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, self._previous)


_MEMBERS_FILE = os.path.join("ftstate", "simulation", "members.py")
_CLOCK_FILE = os.path.join("ftstate", "simulation", "clock.py")
_WATCHDOG_FILE = os.path.join("ftstate", "controller", "watchdog.py")
#: ``SimulatedCluster.loop`` (a property returning the running loop), which the members' code
#: reads at every answer: a sample in it belongs to its caller.
_LOOP_ACCESSOR = SimulatedCluster.loop.fget.__code__  # type: ignore[attr-defined]
#: What a node's agent keeps to answer a quiet round (``AgentMemory.reply``): the agent's own
#: code, shared by Ray's agent and the simulated one, so a sample in it belongs to its caller.
_AGENT_MEMORY = AgentMemory.reply.__code__
#: What of a node agent's batch is the agent's own work on its node (calling its members,
#: collecting their outcomes), not the stream the controller reads.
_AGENTS_WORK = frozenset({"AgentBatch._call_members", "AgentBatch._ended", "AgentBatch.reply"})
_VIGIL_FILE = os.path.join("ftstate", "controller", "vigil.py")
#: The watchdog's own periodic round (not settle_suspects or verdict: a sync or a failover calls those).
_ROUND_FRAMES = frozenset({"Watchdog.run", "Watchdog._round", "Watchdog._replied", "Watchdog._judge_reply"})
_FTSTATE_DIR = os.sep + "ftstate" + os.sep
_ASYNCIO_DIR = os.sep + "asyncio" + os.sep


def run_one(members: int, syncs: int, intervals: int, loop_kind: str, freeze: bool = False,
            failovers: int = 3) -> dict[str, Any]:
    def factory() -> asyncio.AbstractEventLoop:
        if loop_kind == "looptime":
            import looptime

            return looptime.new_event_loop(start=0.0)
        return VirtualTimeLoop()

    with tempfile.TemporaryDirectory() as tmp, asyncio.Runner(loop_factory=factory) as runner:
        gc.collect()
        try:
            return runner.run(measure(members, syncs, intervals, os.path.join(tmp, "audit.jsonl"), freeze, failovers))
        finally:
            gc.unfreeze()


FIGURES = ("start_s", "sync_s", "sync_net_s", "sync_controller_s", "sync_members_share", "sync_heartbeat_share", "sync_full_gcs", "sync_promoted", "heartbeat_interval_s", "heartbeat_interval_controller_s", "heartbeat_full_gcs",
           "heartbeat_interval_gc_off_s", "failover_member_s",
           "failover_member_net_s", "failover_member_controller_s", "failover_rank_s", "failover_rank_net_s",
           "failover_rank_controller_s", "failover_node_s", "failover_node_net_s", "failover_node_controller_s",
           "scale_add_s", "scale_add_virtual_s", "scale_remove_s", "audit_bytes_per_sync")

#: The figures whose ratio the goal (×10 members costs ≤ ×12) is about, shown run by run with ``--repeat``.
GOAL_FIGURES = ("sync_controller_s", "heartbeat_interval_controller_s", "failover_member_controller_s",
                "failover_rank_controller_s", "failover_node_controller_s")

#: What ``--calls`` counts instead (:class:`_CallCount`).
CALL_FIGURES = ("sync_calls", "heartbeat_interval_calls", "failover_member_calls", "failover_rank_calls",
                "failover_node_calls", "scale_add_calls", "scale_remove_calls")


def _in_own_process(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One size's row measured in a fresh interpreter (``--one``): what a run of another size
    left behind (the heap's layout, the collector's generations) does not weigh on it."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), "--syncs", str(args.syncs),
           "--intervals", str(args.intervals), "--loop", args.loop, "--failovers", str(args.failovers)]
    if args.gc_threshold is not None:
        cmd += ["--gc-threshold", str(args.gc_threshold)]
    if args.gc_freeze:
        cmd.append("--gc-freeze")
    if args.calls:
        cmd.append("--calls")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run of N={n} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float) or k.endswith("_calls"):  # not the shape (members, nodes, ...)
            row[k] = statistics.median(r[k] for r in runs)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100,1000,10000")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--intervals", type=int, default=3)
    ap.add_argument("--failovers", type=int, default=3,
                    help="failover rounds of each kind (a member, a trainer rank, a node); their median is the figure")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each size this many times, each in a fresh process, the sizes taken in turn; "
                         "each figure is the median of its runs (1: every size in this process, one after another)")
    ap.add_argument("--loop", choices=("virtual", "looptime"), default="virtual")
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--gc-threshold", type=int, default=None,
                    help="the collector's first threshold for the run (gc.set_threshold; default: Python's 700)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() once the runtime has started: what exists then is never scanned again")
    ap.add_argument("--calls", action="store_true",
                    help="count the Python function calls of each sync, interval and failover round instead "
                         "(the work done, exact: its ratio is the code's growth; the CPU figures of such a run "
                         "carry the profiler's cost)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # --repeat's child: one row as JSON
    args = ap.parse_args()
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, 20, 10)
    _CallCount.enabled = args.calls
    figures, goal = (CALL_FIGURES, CALL_FIGURES) if args.calls else (FIGURES, GOAL_FIGURES)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.syncs, args.intervals, args.loop, args.gc_freeze, args.failovers)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for _ in range(args.repeat):
        for n in sizes:
            if args.repeat == 1:
                runs[n].append(run_one(n, args.syncs, args.intervals, args.loop, args.gc_freeze, args.failovers))
            else:
                runs[n].append(_in_own_process(n, args))
    rows = []
    for n in sizes:
        row = _median_row(runs[n])
        rows.append(row)
        print(f"N={row['members']:>6} nodes={row['nodes']:>5} trainers={row['trainers']:>5}  " + "  ".join(
            f"{k}={row[k]:.4g}" for k in figures if k in row), flush=True)
    print("\nratio to N/10 (linear: 10)" + (f", of the medians of {args.repeat} runs:" if args.repeat > 1 else ":"))
    for small, large in itertools.pairwise(rows):
        print(f"N={large['members']:>6}/{small['members']:<5} " + "  ".join(
            f"{k}={large[k] / small[k]:.1f}" for k in figures if small.get(k) and k in large))
    if args.repeat > 1:
        print("\nthe same, run by run:")
        for small, large in itertools.pairwise(sizes):
            print(f"N={large:>6}/{small:<5} " + "  ".join(
                f"{k}=" + ",".join(f"{b[k] / a[k]:.1f}" for a, b in zip(runs[small], runs[large], strict=True))
                for k in goal if runs[small][0].get(k) and k in runs[large][0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loop": args.loop, "rows": rows, "runs": {str(n): r for n, r in runs.items()},
                       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)

if __name__ == "__main__":
    main()
