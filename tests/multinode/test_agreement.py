"""Agreement with reality (issue 27): one small scenario run for real on the 3-node cluster and
simulated gives the same audit events per member, and durations the simulation derives
within 30 % of the measured ones (or 15 ms, for the rounds of tens of milliseconds); when the
figures of one comparison disagree, another, independent one is made (``ATTEMPTS``).

The scenario (:func:`scenario`, one code for both): 1 trainer, 3 rollouts, 2 prewarmed spares
(one per role); a sync; a rollout SIGKILLed, its replacement serving, a sync; the trainer
SIGKILLed, rebuilt from a rollout, a sync; the node holding rollout-0 lost (its raylet and
every process it started SIGKILLed at once), its members replaced, a sync. Placement pins
every member to the same node in both runs: the trainer and the spares on node ``a`` (the
driver's, never lost), the rollouts packed on one of ``b``, ``c``; the simulated cluster has
the same per-node resources and labels.

What is calibrated from the real run (machine-dependent costs, fed to the simulation's
:class:`~ftstate.simulation.costs.Costs`): ``call_s`` (the median round trip of a user call
to the trainer, measured before the scenario), ``death_detect_s`` (a SIGKILL to the
member's ``died`` transition, from the rollout kill), ``start_s`` (the median of the
replacement spares' starts: a failover round to the new spare warm), ``weights_bytes`` (what
the sync sent); fitted by a first simulated run: ``receiver_s`` (so that the no-fault sync
takes the measured time) and ``group_form_s`` (so that the rollout round's re-rendezvous
does). What is predicted (derived by the real controller's code on the simulated cluster,
compared): each failover round (LOST to serving, ``total_s``: the rollout's point-to-point
resync, the trainer rebuilt from a rollout, the node's two rounds waiting for a cold start)
and the node loss from the kill to its last member replaced (found by heartbeats, not by
death: nothing of the node reports it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import statistics
from collections.abc import Callable
from typing import Any

import pytest

from tests.multinode.harness import LABEL, resource
from tests.multinode.test_node_loss import config as node_loss_config

pytestmark = pytest.mark.ray

#: The real cluster's nodes, as the simulated one has them (index 0 is ``a``).
PER_NODE = [{"resources": {resource(n): 4}, "labels": {LABEL: n}} for n in ("a", "b", "c")]
#: Every wait of the scenario (loop seconds: real or virtual).
WAIT_S = 60.0
#: How far a simulated duration may be from the measured one: 30 %, or for the rounds of tens of
#: milliseconds SLACK_S, whichever is more (the trainer's re-rendezvous, the same code on the same
#: cluster, measured 30 and 45 ms in two consecutive runs: the scheduling of a dozen calls on 2
#: cores, which no model of this one takes).
TOLERANCE = 0.30
SLACK_S = 0.015
#: Comparisons made before the figures count as disagreeing: a real run on 2 shared cores now
#: and then meets a stall of tens of milliseconds, which only ever makes a measured round slower
#: (the trainer's round, simulated at 50-65 ms, measured up to 0.15 s when struck while Ray
#: started a worker process: QUIET_BUSY); another, independent comparison (a real run,
#: calibrated and simulated again) tells that from a model that is wrong, which disagrees in
#: each. A comparison whose real run missed a heartbeat the simulated one did not (a stall past
#: 0.2 s: :func:`machine_stalls`) is void and counts as one of these.
ATTEMPTS = 3
#: Before the rollout's and the trainer's kills the real run waits (at most QUIET_WAIT_S) until the machine's CPUs were
#: less than QUIET_BUSY busy over one QUIET_WINDOW_S: Ray starts an idle worker process (an
#: interpreter importing Ray, most of a core for a second) in the background after a spare took
#: one, and a fault in that second met it. Measured: the trainer killed ~50 ms after the new
#: spare was warm found the CPUs 0.21-0.58 busy and its round took 0.100-0.110 s; killed once
#: they were quiet (0.05-0.15 busy: the heartbeats), 0.054-0.077 s (simulated 0.05-0.065).
#: The members of a real cluster have hosts of their own; the simulation models theirs. Not
#: before the node loss: its rounds wait seconds for a spare's start, and ``start_s`` is
#: calibrated from starts made as Ray started its idle workers beside them (struck on a quiet
#: machine, the node's start took the idle worker Ray had ready, 1.6 s against a calibrated
#: 2.2-2.6 s: the model 23-60 % slow).
QUIET_BUSY = 0.25
QUIET_WINDOW_S = 0.2
QUIET_WAIT_S = 10.0


def config(tmp_path, audit: bool):
    """The multinode tests' config (heartbeats every 0.2 s, LOST after 2 s), 3 rollouts, every
    member pinned (module docstring); the simulated run keeps its trail in memory only."""
    placement = {"trainer": {"resources": {resource("a"): 0.5}},
                 "rollout": {"strategy": "PACK", "labels": {LABEL: "in(b,c)"}},
                 "standby": {"resources": {resource("a"): 0.5}}}
    return node_loss_config(tmp_path, rollout_workers=3, worker_cpus=0.25, placement=placement,
                            **({} if audit else {"audit_log": None}))


async def wait_until(cond: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        await asyncio.sleep(0.05)


def settled(rt, failovers: int) -> Callable[[], bool]:
    """``failovers`` rounds done, the group READY and both spares warm again: the next fault
    then meets the same cluster in both runs."""
    def cond() -> bool:
        members = rt.members()
        return (len(rt.failovers) >= failovers and rt.state == "READY"
                and sum(m.state == "STANDBY" for m in members) >= 2)
    return cond


class SimStrikes:
    """The faults, on a simulated cluster."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    async def quiet(self) -> None:
        """A simulated host has no background work (module docstring: QUIET_BUSY)."""

    def kill(self, rt, member: str) -> None:
        self.cluster.kill_member(member)

    def lose_node_of(self, rt, member: str) -> list[str]:
        node = next(m.node_id for m in rt.members() if m.member == member)
        return self.cluster.lose_node(node)


class RealStrikes:
    """The faults, on the real cluster: SIGKILL of a member's process; a node's raylet and
    every process it started SIGKILLed (tests/multinode/harness.py)."""

    def __init__(self, mn) -> None:
        self.mn = mn

    async def quiet(self) -> None:
        """Until the machine's CPUs were less than QUIET_BUSY busy over a window, at most
        QUIET_WAIT_S (then the fault is struck anyway: a round it slowed disagrees, and another
        comparison is made)."""
        def busy_total() -> tuple[int, int]:
            with open("/proc/stat") as f:  # cpu user nice system idle iowait irq softirq steal ...
                ticks = [int(v) for v in f.readline().split()[1:]]
            # busy: this machine's processes (not idle, I/O wait, or time the hypervisor took)
            return sum(ticks[:3]) + sum(ticks[5:7]), sum(ticks)

        loop = asyncio.get_running_loop()
        give_up = loop.time() + QUIET_WAIT_S
        while loop.time() < give_up:
            b0, t0 = busy_total()
            await asyncio.sleep(QUIET_WINDOW_S)
            b1, t1 = busy_total()
            if (b1 - b0) < QUIET_BUSY * max(1, t1 - t0):
                return
        print(f"agreement: the machine was not quiet within {QUIET_WAIT_S} s; the fault is struck anyway")

    def kill(self, rt, member: str) -> None:
        pid = next(m.pid for m in rt.members() if m.member == member)
        os.kill(pid, signal.SIGKILL)

    def lose_node_of(self, rt, member: str) -> list[str]:
        node_id = next(m.node_id for m in rt.members() if m.member == member)
        lost = [m.member for m in rt.members() if m.node_id == node_id and m.state not in ("RETIRED", "LOST")]
        self.mn.kill(self.mn.name_of(node_id))
        return lost


async def scenario(rt, strikes) -> dict[str, Any]:
    """The scenario (module docstring); returns what it measured on the loop's clock."""
    loop = asyncio.get_running_loop()
    await wait_until(settled(rt, 0), "two warm spares")
    out: dict[str, Any] = {}
    await rt.sync()  # the first: the rollouts serve from here on
    rounds = []
    # a call to one member (what most of a round's calls are): call_s. 31 of them: with 9 the
    # median swung 2-8 ms run to run on 2 cores, and the trainer's round (a dozen calls) with it
    for _ in range(31):
        t0 = loop.time()
        await rt.trainer("checksum")
        rounds.append(loop.time() - t0)
    out["call_s"] = statistics.median(rounds)
    await rt.trainer("train_step")
    report = await rt.sync()
    out["sync_s"], out["nbytes"] = report.seconds, report.nbytes
    await strikes.quiet()
    rt.audit.record("note", fault="SIGKILL rollout-1")  # the trail's own clock, for calibrated_costs
    strikes.kill(rt, "rollout-1")
    await wait_until(settled(rt, 1), "rollout-1 replaced")
    await rt.sync()
    await strikes.quiet()
    strikes.kill(rt, "trainer-0")
    await wait_until(settled(rt, 2), "trainer-0 replaced")
    await rt.sync()
    t0 = loop.time()
    lost = strikes.lose_node_of(rt, "rollout-0")
    out["node_lost"] = sorted(lost)
    await wait_until(settled(rt, 2 + len(lost)), "the lost node's members replaced")
    out["node_replaced_s"] = max(f.detected_at + f.total_s for f in rt.failovers[2:]) - t0
    await rt.sync()
    return out


#: The triggers that declare a silent member LOST on a lost node: which one a member gets is
#: timing alone. Its own heartbeat deadline (``heartbeat_timeout``), or the failover's ask of
#: every member on the node of one lost first (``node_lost``): in the simulation the node's
#: members' deadlines expire in the same instant, on the real cluster a few milliseconds apart,
#: and one of them now and then first (2 real runs in 28).
SILENCE = {"heartbeat_timeout": "silent", "node_lost": "silent"}


def per_member(records: list[dict[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
    """Each member's transitions and failover rounds, in order (timings left out, and with them
    which of the SILENCE triggers declared a silent member lost)."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for r in records:
        if r["event"] == "transition" and r.get("member"):
            trigger = SILENCE.get(r["trigger"], r["trigger"]) if r["to"] == "LOST" else r["trigger"]
            out.setdefault(r["member"], []).append((r["from"], r["to"], trigger))
        elif r["event"] == "failover":
            out.setdefault(r["lost"], []).append(("failover", r["replacement"], r["group_version"]))
    return out


def machine_stalls(simulated: dict[str, list[tuple[Any, ...]]],
                   real: dict[str, list[tuple[Any, ...]]]) -> dict[str, int]:
    """The members whose events differ because the real run missed heartbeats the simulated one
    did not (how many more), empty if none. A member the real machine starved past one heartbeat
    interval (0.2 s) goes SUSPECT and back (CI saw the rollouts' first resync, while the two
    spares imported torch on the 2 shared cores, go RESYNCING -> SUSPECT -> RESYNCED): the
    simulation models no such stall, so that comparison is void and another is made. Events that
    differ with no extra missed heartbeat are the model's fault, and fail the test at once."""
    def missed(events: list[tuple[Any, ...]]) -> int:
        return sum(1 for e in events if e[-1] == "heartbeat_missed")

    return {m: missed(real.get(m, [])) - missed(simulated.get(m, []))
            for m in sorted(set(simulated) | set(real))
            if simulated.get(m) != real.get(m) and missed(real.get(m, [])) > missed(simulated.get(m, []))}


def calibrated_costs(rt, measured: dict[str, Any]):
    """The simulation's costs that depend on this machine, from the real run (module docstring);
    ``receiver_s`` is fitted afterwards (:func:`simulate`)."""
    from ftstate.simulation.costs import Costs

    records = rt.audit.records
    killed = next(i for i, r in enumerate(records) if r["event"] == "note")
    died = next(r for r in records[killed:] if r["event"] == "transition" and r.get("member") == "rollout-1"
                and r["trigger"] == "died")
    # Each spare started to replace a promoted one: from its failover round to it warm (the
    # median: one start may meet another's load).
    starts, last_round = [], None
    for r in records[killed:]:
        if r["event"] == "failover":
            last_round = r
        elif r["event"] == "transition" and r["to"] == "STANDBY" and last_round is not None:
            starts.append(r_time(r) - r_time(last_round))
            last_round = None
    return Costs(call_s=measured["call_s"], death_detect_s=r_time(died) - r_time(records[killed]),
                 start_s=statistics.median(starts), weights_bytes=max(1, measured["nbytes"]), jitter=0.1)


def events_differ(simulated: dict[str, Any], real: dict[str, Any]) -> str:
    """Each member whose events differ, from the first that does (a failure says what, not ``...``)."""
    out = []
    for member in sorted(set(simulated) | set(real)):
        s, r = simulated.get(member, []), real.get(member, [])
        if s != r:
            first = next((i for i, (a, b) in enumerate(zip(s, r, strict=False)) if a != b), min(len(s), len(r)))
            out.append(f"{member} from event {first}: simulated {s[first:]} real {r[first:]}")
    return "the audit events differ: " + "; ".join(out)


def r_time(record: dict[str, Any]) -> float:
    return float(record["t"])


async def compare(mn, tmp_path) -> tuple[dict[str, tuple[float, float]] | None, Any, dict[str, int] | None]:
    """One comparison: the scenario run for real, the simulation calibrated from it and run;
    returns each predicted figure as (simulated, measured), the calibrated costs, and None. The
    audit events per member must agree whatever the timings, except where the real machine
    stalled (:func:`machine_stalls`): then no figure is returned, and the stalls are."""
    import ftstate
    from ftstate.simulation import clock
    from ftstate.simulation.cluster import SimulatedCluster
    from ftstate.simulation.scenario import runtime_on
    from tests.integration.workers import TinyRollout, TinyTrainer

    rt = ftstate.Runtime(config(tmp_path, audit=True), trainer=TinyTrainer, rollout=TinyRollout)
    async with rt:
        real = await scenario(rt, RealStrikes(mn))
    costs = calibrated_costs(rt, real)

    async def simulated(costs):
        cluster = SimulatedCluster(3, cpus_per_node=2, per_node=PER_NODE, costs=costs, seed=0)
        srt = runtime_on(cluster, config(tmp_path, audit=False))
        async with srt:
            got = await scenario(srt, SimStrikes(cluster))
        return srt, got

    # The virtual-time loop runs in a thread of its own: this test's loop is the real one.
    # Twice: the first run fits what the model has no other figure for: the transfer's fixed
    # cost per receiver to the no-fault sync (a broadcast to the 3 rollouts), and the forming
    # of a group version to the rollout round's re-rendezvous; the second is compared (its
    # point-to-point resyncs, the trainer's round, the node's cold start and detection).
    first_rt, first = await asyncio.to_thread(clock.run, simulated(costs))
    costs = dataclasses.replace(
        costs, receiver_s=max(0.0, real["sync_s"] - first["sync_s"]) / 3,
        group_form_s=max(0.001, costs.group_form_s + rt.failovers[0].rerendezvous_s
                         - first_rt.failovers[0].rerendezvous_s))
    srt, sim = await asyncio.to_thread(clock.run, simulated(costs))
    assert sim["node_lost"] == real["node_lost"]
    simulated_events, real_events = per_member(srt.audit.records), per_member(rt.audit.records)
    stalled = machine_stalls(simulated_events, real_events)
    if stalled:  # the real machine stalled: this comparison says nothing, another is made
        print(f"agreement: the real run missed heartbeats the simulation has no cause for: {stalled}")
        return None, costs, stalled
    assert simulated_events == real_events, events_differ(simulated_events, real_events)
    predicted = {"node loss to replaced": (sim["node_replaced_s"], real["node_replaced_s"])}
    for i, (s, r) in enumerate(zip(srt.failovers, rt.failovers, strict=True)):
        predicted[f"failover {i} ({r.lost})"] = (s.total_s, r.total_s)
        print(f"agreement: failover {i} ({r.lost}) phases (re-rendezvous, transfer, LOST to the round): "
              f"simulated {s.rerendezvous_s:.3f}, {s.transfer_s:.3f}, {s.total_s - s.rerendezvous_s - s.transfer_s:.3f}; "
              f"measured {r.rerendezvous_s:.3f}, {r.transfer_s:.3f}, {r.total_s - r.rerendezvous_s - r.transfer_s:.3f}")
    for name, (s, r) in predicted.items():  # the figures, for `pytest -s` and the docs
        print(f"agreement: {name}: simulated {s:.3f} s, measured {r:.3f} s ({s / r - 1:+.0%})")
    print(f"agreement: calibrated {costs}")
    return predicted, costs, None


async def test_the_simulation_agrees_with_a_real_run(restore_nodes, tmp_path) -> None:
    offs = []
    for attempt in range(ATTEMPTS):
        if attempt:  # the lost node back, as the next comparison's cluster must be the same
            for name in restore_nodes.nodes:
                if name not in restore_nodes.alive():
                    restore_nodes.add(name)
        (tmp_path / f"attempt{attempt}").mkdir()
        predicted, costs, stalled = await compare(restore_nodes, tmp_path / f"attempt{attempt}")
        if stalled:
            offs.append(f"attempt {attempt}: void, the real run missed heartbeats (members: {stalled})")
            continue
        off = {k: (s, r) for k, (s, r) in predicted.items() if abs(s - r) > max(TOLERANCE * r, SLACK_S)}
        if not off:
            return
        offs.append(f"attempt {attempt}: {off}; calibrated {costs}")
    raise AssertionError(f"simulated vs measured (s) beyond {TOLERANCE:.0%} (or {SLACK_S} s) in each of {ATTEMPTS} "
                         "comparisons: " + " | ".join(offs))
