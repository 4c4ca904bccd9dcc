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

Each loss is timed from the kill to: group READY, both rollouts serving the current weights
version, none of them on the lost node (the figure), with the kill -> first LOST
(detection) beside it; median / p95, and the node / process ratio. Each node loss says what
it took down (rollouts, spares, trainer). Before each loss the run syncs (the current
version is what the newcomers must reach) and waits for its spares to be warm.

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
from ftstate.controller import cluster
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


async def prepare(rt: ftstate.Runtime) -> None:
    """A sync (the current version moves on) and warm spares before each loss."""
    await wait_for(lambda: spares_warm(rt), SPARE_TIMEOUT_S, "a warm spare per role", rt)
    await rt.trainer("train_step")
    await rt.sync()


async def process_phase(args: argparse.Namespace, cfg: ftstate.RuntimeConfig, floats: int) -> dict[str, list]:
    out: dict[str, list] = {"detection": [], "total": []}
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout,
                               trainer_kwargs={"big_floats": floats}) as rt:
        await rt.sync()
        for i in range(args.losses):
            await prepare(rt)
            before = len(rt.failovers)
            victim = await rt.chaos.kill("rollout", 1)
            t_kill = rt.chaos.injected[-1][0]
            t_done = await wait_for(lambda b=before: len(rt.failovers) > b and serving_off(rt, None, 2),
                                    RECOVERY_TIMEOUT_S, f"{victim} replaced", rt)
            f = rt.failovers[-1]
            out["detection"].append(f.detected_at - t_kill)
            out["total"].append(t_done - t_kill)
            print(f"  process loss {i + 1}/{args.losses}: {victim}, total {out['total'][-1] * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
    return out


async def node_phase(args: argparse.Namespace, cfg: ftstate.RuntimeConfig, floats: int,
                     mn: MultiNode) -> dict[str, list]:
    out: dict[str, list] = {"detection": [], "total": [], "lost": [], "kill_s": [], "error": []}
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout,
                               trainer_kwargs={"big_floats": floats}) as rt:
        await rt.sync()
        for i in range(args.losses):
            try:
                await prepare(rt)
            except NotReady as exc:
                out["error"].append(f"before node loss {i + 1}: {exc}")
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
            lost_rollouts = sum(1 for m in on_node if m.role == "rollout" and m.rank >= 0)
            trainer_lost = any(m.role == "trainer" and m.rank >= 0 for m in on_node)
            before = len(rt.failovers)
            killed = mn.kill(name)
            expected = lost_rollouts + trainer_lost
            try:
                t_done = await wait_for(
                    lambda b=before, e=expected, n=lost_node: len(rt.failovers) - b >= e and serving_off(rt, n, 2),
                    RECOVERY_TIMEOUT_S, f"node {name} ({', '.join(lost_roles)}) replaced", rt)
            except NotReady as exc:
                out["error"].append(f"node loss {i + 1}: {exc}; {where(rt, mn)}")
                break
            rounds = rt.failovers[before:]
            out["detection"].append(min(f.detected_at for f in rounds) - killed.killed_at)
            out["total"].append(t_done - killed.killed_at)
            out["lost"].append(", ".join(lost_roles))
            out["kill_s"].append(killed.kill_s)
            versions = sorted({f.group_version for f in rounds})
            print(f"  node loss {i + 1}/{args.losses}: node {name} ({', '.join(lost_roles)}), "
                  f"{len(killed.pids)} processes, total {out['total'][-1] * 1e3:.0f} ms, "
                  f"group versions {versions}", file=sys.stderr, flush=True)
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
            results["process"] = await process_phase(args, cfg, floats)
        if "node" in args.phases:
            results["node"] = await node_phase(args, cfg, floats, mn)
    finally:
        stop_cluster(mn)

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:7.0f}/{pct(xs, 0.95) * 1e3:<7.0f}" if xs else f"{'-':>15}"

    print(f"{'loss':>8} {'n':>3} | {'detection':>15} {'to serving':>15}   (median / p95, ms)")
    for phase, r in results.items():
        print(f"{phase:>8} {len(r['total']):>3} | {cell(r['detection'])} {cell(r['total'])}")
    node, proc = results.get("node", {}), results.get("process", {})
    if node.get("total") and proc.get("total"):
        print(f"node / process (median to serving): "
              f"{statistics.median(node['total']) / statistics.median(proc['total']):.2f}")
    if node.get("lost"):
        kinds: dict[str, int] = {}
        for lost in node["lost"]:
            kinds[lost] = kinds.get(lost, 0) + 1
        print("each node loss took down: " + "; ".join(f"{k} (x{v})" for k, v in kinds.items())
              + f"; kill_node's kill loop {statistics.median(node['kill_s']) * 1e3:.1f} ms (median)")
    for err in node.get("error", []):
        print(f"stopped early: {err}")
    if node.get("error"):
        raise SystemExit(1)


if __name__ == "__main__":
    t0 = time.monotonic()
    asyncio.run(main())
    print(f"took {time.monotonic() - t0:.0f} s", file=sys.stderr)
