"""Benchmark: whole-node loss -> every replaced member serving the current weights version,
beside the single-process failover of the same size in the same run.

A 3-node ``ray.cluster_utils.Cluster`` on this machine (tests/multinode/harness.py): node
``a`` (the driver's) holds the trainer; the two rollouts are packed on one of ``b``/``c``
(``placement.rollout``: PACK, label ``in(b,c)``), the prewarmed spares (standby mode, one per
role) on ``b``/``c`` off the members they cover; 64 MB of float32 weights, heartbeats every
0.2 s. Two phases, on the same cluster and with the same config:

1. process: SIGKILL one rollout process ``--losses`` times (the failover of benchmarks/failover.py);
2. node: lose the node holding the rollouts ``--losses`` times (``kill_node``: its raylet and
   every process it started SIGKILLed at once), then add it back (a fresh node id).

Each loss is timed from the kill to: the first member declared LOST (detection); every lost
group member replaced, group READY again (replaced); and, through the next ``rt.sync()`` the
trainer loop makes, both rollouts serving the current weights version, none on the lost node
(serving: the figure). The next sync is part of it because a node that held every rollout
leaves nobody to copy the current version from: its replacements are resynced by that sync
(a lost process's replacement is copied from the surviving rollout before it). Median / p95,
the node / process ratios, and a plain sync of the same bytes (no loss) as the baseline.
Each node loss says what it took down (rollouts, spares, trainer). Before each loss the run
trains a step, syncs and waits for a warm spare per role.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/node_loss.py [--losses 10] [--size-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ftstate
from ftstate.controller.ray import cluster
from ftstate.core.config import leaf_paths
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import LABEL, MultiNode, resource, start_cluster, stop_cluster

#: How long one loss may take to be recovered from before the benchmark gives up on it.
RECOVERY_TIMEOUT_S = 120.0
SPARE_TIMEOUT_S = 120.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class NotReady(Exception):
    """The run did not get where the benchmark waits for (a controller side not there yet)."""


def config(args: argparse.Namespace, losses: int) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2, "bucket_size_mb": 64, "init_timeout_s": 300, "sync_timeout_s": 300,
        "failover_timeout_s": 300, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": args.heartbeat_timeout,
        "fault_tolerance": {"enable": True, "mode": "standby", "standby_workers": 1, "reverse_weight_sync": True,
                            "max_failovers": 4 * losses + 4},
        "placement": {
            "trainer": {"resources": {resource("a"): 1}},
            "rollout": {"strategy": "PACK", "labels": {LABEL: "in(b,c)"}},
            "standby": {"labels": {LABEL: "in(b,c)"}},
        },
    }
    if "placement.rollout.strategy" not in leaf_paths():  # the placement block has not landed yet
        print("note: this ftstate has no `placement` config: workers go where Ray puts them", file=sys.stderr)
        del data["placement"]
    return ftstate.RuntimeConfig.from_dict(data, environ={})


async def wait_for(cond, timeout: float, what: str, rt: ftstate.Runtime) -> float:
    """Poll ``cond`` every 5 ms; returns the loop time it first held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if rt.state == "FAILED":
            raise SystemExit(f"the run failed: {rt.group.error if rt.group else 'unknown error'}")
        if loop.time() > deadline:
            raise NotReady(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.005)
    return loop.time()


def spares_warm(rt: ftstate.Runtime) -> bool:
    warm = {m.role for m in rt.members() if m.rank < 0 and m.state == "STANDBY"}
    return {"rollout", "trainer"} <= warm


def serving_off(rt: ftstate.Runtime, lost_node: str | None, n: int) -> bool:
    """Group READY, ``n`` rollouts serving the current version, none on ``lost_node``."""
    if rt.state != "READY":
        return False
    serving = rt.serving_rollouts()
    if len(serving) < n:
        return False
    nodes = {m.member: getattr(m, "node_id", None) for m in rt.members()}
    return lost_node is None or all(nodes.get(s) != lost_node for s in serving)


def where(rt: ftstate.Runtime, mn: MultiNode) -> str:
    """The run's state for a report that stops early: group, members (state, node), last events."""
    members = ", ".join(f"{m.member} {m.state} v{m.weights_version} on {mn.name_of(getattr(m, 'node_id', None))}"
                        for m in rt.members())
    events = [f"{r['event']}:{r.get('member', '')}:{r.get('to', r.get('reason', ''))}"
              for r in rt.audit.records[-8:]]
    return f"group {rt.state} g{rt.group_version} w{rt.weights_version}; members: {members}; last events: {events}"


async def prepare(rt: ftstate.Runtime) -> float:
    """Warm spares and a sync before each loss; returns the sync's seconds (the baseline)."""
    await wait_for(lambda: spares_warm(rt), SPARE_TIMEOUT_S, "a warm spare per role", rt)
    await rt.trainer("train_step")
    return (await rt.sync()).seconds


async def recover(rt: ftstate.Runtime, out: dict[str, list], *, t_kill: float, before: int, expected: int,
                  lost_node: str | None, what: str) -> None:
    """Time a loss: kill -> first LOST, -> every lost member replaced (group READY), -> the
    next sync done with both rollouts serving, none on the lost node."""
    t_replaced = await wait_for(lambda: len(rt.failovers) - before >= expected and rt.state == "READY",
                                RECOVERY_TIMEOUT_S, f"{what} replaced", rt)
    await rt.sync()
    t_serving = asyncio.get_running_loop().time()
    if not serving_off(rt, lost_node, 2):
        raise NotReady(f"after the next sync, not every rollout serves off the lost node ({what})")
    out["detection"].append(min(f.detected_at for f in rt.failovers[before:]) - t_kill)
    out["replaced"].append(t_replaced - t_kill)
    out["serving"].append(t_serving - t_kill)


def results_dict() -> dict[str, list]:
    return {"detection": [], "replaced": [], "serving": [], "sync": [], "lost": [], "kill_s": [], "error": []}


async def process_phase(args: argparse.Namespace, cfg: ftstate.RuntimeConfig, floats: int,
                        mn: MultiNode) -> dict[str, list]:
    out = results_dict()
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout,
                               trainer_kwargs={"big_floats": floats}) as rt:
        await rt.sync()
        for i in range(args.losses):
            try:
                out["sync"].append(await prepare(rt))
                before = len(rt.failovers)
                victim = await rt.chaos.kill("rollout", 1)
                await recover(rt, out, t_kill=rt.chaos.injected[-1][0], before=before, expected=1,
                              lost_node=None, what=victim)
            except NotReady as exc:
                out["error"].append(f"process loss {i + 1}: {exc}; {where(rt, mn)}")
                break
            print(f"  process loss {i + 1}/{args.losses}: {victim}, replaced {out['replaced'][-1] * 1e3:.0f} ms, "
                  f"serving {out['serving'][-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    return out


async def node_phase(args: argparse.Namespace, cfg: ftstate.RuntimeConfig, floats: int,
                     mn: MultiNode) -> dict[str, list]:
    out = results_dict()
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout,
                               trainer_kwargs={"big_floats": floats}) as rt:
        await rt.sync()
        for i in range(args.losses):
            try:
                out["sync"].append(await prepare(rt))
            except NotReady as exc:
                out["error"].append(f"before node loss {i + 1}: {exc}; {where(rt, mn)}")
                break
            members = rt.members()
            node_ids = {m.member: getattr(m, "node_id", None) for m in members}
            if None in {node_ids[s] for s in rt.serving_rollouts()}:
                out["error"].append("members carry no node_id (MemberInfo.node_id not there yet): "
                                    "cannot tell which node holds the rollouts")
                break
            # The node holding the most serving rollouts (both, with PACK), never the driver's.
            counts: dict[str, int] = {}
            for s in rt.serving_rollouts():
                counts[node_ids[s]] = counts.get(node_ids[s], 0) + 1
            candidates = [n for n in counts if mn.name_of(n) not in (None, "a")]
            if not candidates:
                out["error"].append(f"before node loss {i + 1}: no rollout off the driver's node")
                break
            lost_node = max(candidates, key=lambda n: counts[n])
            name = mn.name_of(lost_node)
            on_node = [m for m in members if node_ids[m.member] == lost_node and m.state not in ("RETIRED", "LOST")]
            lost_roles = sorted(f"{'spare-' if m.rank < 0 else ''}{m.role}" for m in on_node)
            expected = sum(1 for m in on_node if m.rank >= 0)  # group members; spares are dropped, not replaced
            before = len(rt.failovers)
            killed = mn.kill(name)
            what = f"node {name} ({', '.join(lost_roles)})"
            try:
                await recover(rt, out, t_kill=killed.killed_at, before=before, expected=expected,
                              lost_node=lost_node, what=what)
            except NotReady as exc:
                out["error"].append(f"node loss {i + 1}: {exc}; {where(rt, mn)}")
                break
            out["lost"].append(", ".join(lost_roles))
            out["kill_s"].append(killed.kill_s)
            versions = sorted({f.group_version for f in rt.failovers[before:]})
            print(f"  node loss {i + 1}/{args.losses}: {what}, {len(killed.pids)} processes, replaced "
                  f"{out['replaced'][-1] * 1e3:.0f} ms, serving {out['serving'][-1] * 1e3:.0f} ms, "
                  f"failovers under group version(s) {versions}", file=sys.stderr, flush=True)
            mn.add(name)  # the cluster gets its node back (a fresh node id) for the next loss
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--losses", type=int, default=10)
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0,
                    help="heartbeat_timeout_s (an idle member of a lost node is caught by its heartbeats)")
    ap.add_argument("--phases", default="process,node")
    args = ap.parse_args()
    floats = args.size_mb * 2**20 // 4
    mn = start_cluster()
    cluster.mute_worker_death_notices()  # every death is in the run's audit trail
    print(f"cluster: 3 nodes up in {mn.started_s:.1f} s; {args.size_mb} MB of weights, "
          f"heartbeat 0.2 s / timeout {args.heartbeat_timeout:g} s", flush=True)
    results: dict[str, dict[str, list]] = {}
    try:
        cfg = config(args, args.losses)
        if "process" in args.phases:
            results["process"] = await process_phase(args, cfg, floats, mn)
        if "node" in args.phases:
            results["node"] = await node_phase(args, cfg, floats, mn)
    finally:
        stop_cluster(mn)

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:7.0f}/{pct(xs, 0.95) * 1e3:<7.0f}" if xs else f"{'-':>15}"

    print(f"{'loss':>8} {'n':>3} | {'detection':>15} {'replaced':>15} {'serving':>15} | {'sync, no loss':>15}"
          "   (median / p95, ms)")
    for phase, r in results.items():
        print(f"{phase:>8} {len(r['serving']):>3} | {cell(r['detection'])} {cell(r['replaced'])} "
              f"{cell(r['serving'])} | {cell(r['sync'])}")
    node, proc = results.get("node", {}), results.get("process", {})
    if node.get("serving") and proc.get("serving"):
        med = statistics.median
        print(f"node / process (medians): detection {med(node['detection']) / med(proc['detection']):.2f}, "
              f"replaced {med(node['replaced']) / med(proc['replaced']):.2f}, "
              f"serving {med(node['serving']) / med(proc['serving']):.2f}")
    if node.get("lost"):
        kinds: dict[str, list[float]] = {}
        for lost, serving in zip(node["lost"], node["serving"], strict=True):
            kinds.setdefault(lost, []).append(serving)
        print("what a node loss took down -> serving (median ms): " + "; ".join(
            f"{k}: {statistics.median(v) * 1e3:.0f} (x{len(v)})" for k, v in kinds.items()))
        print(f"kill_node's kill loop: {statistics.median(node['kill_s']) * 1e3:.1f} ms (median)")
    errors = [e for r in results.values() for e in r["error"]]
    for err in errors:
        print(f"stopped early: {err}")
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    t0 = time.monotonic()
    asyncio.run(main())
    print(f"took {time.monotonic() - t0:.0f} s", file=sys.stderr)
