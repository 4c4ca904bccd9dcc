"""Benchmark: a node's maintenance notice -> every drained member replaced and serving the
current weights version, beside the single-process failover of the same size, in the same run.

A 3-node ``ray.cluster_utils.Cluster`` on this machine (ftstate/cli/demo/nodes.py: 3 raylets
on 127.0.0.1), each node with a loopback GCE metadata server of its own
(ftstate/cli/demo/metadata_server.py, reached through the node's ``GCE_METADATA_HOST``). 64 MB
of float32 weights, the trainer on node ``a``, both rollouts packed on one of ``b``/``c``
(``placement.rollout``: PACK, label ``in(b,c)``), prewarmed spares (standby mode, ``--spares``
per role, on any node off the members they cover).

Each round is a fresh runtime (a drained node stays avoided by the runtime that drained it, so
one runtime drains one node once), with a sync loop running all along the drain (rollout_map,
train_step, sync, every ``--pause`` s); a sync that raises or a group sync that fails counts as
failed (the figure must be 0):

1. **drain** (``--notices`` rounds): ``await rt.drain(node, deadline=now + 120 s)`` on the
   rollouts' node, timed from the call to: the drain starting (it waits for a sync in flight:
   it runs under the membership lock), the last replacement admitted (READY: it holds the
   current version, checksum-proven; *serving*, the figure), and the call returning (the
   drained members retired too). Then the trainer's and every serving rollout's own checksums
   are compared, and none may be on the drained node.
2. **process failover**, same runtime, same size: SIGKILL one rollout (idle), timed to its
   replacement serving the current version (detection + failover), as benchmarks/failover.py.
3. **GCE notice** (``--gce-notices`` rounds, ``detect_node_maintenance`` on,
   ``maintenance_check_interval`` ``--check-interval``): the rollouts' node's metadata server
   starts answering ``TERMINATE_ON_HOST_MAINTENANCE`` (with a maintenance window 120 s ahead),
   timed to the watcher's read of it, the notice in the audit trail, the drain's start, the
   last replacement serving, and the drain's end: the watcher's added latency is the first two.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/drain.py [--notices 10] [--size-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ftstate
from ftstate.cli.demo.metadata_server import GceServer
from ftstate.cli.demo.nodes import LABEL, LocalCluster, start_local_cluster
from ftstate.controller.ray import cluster
from ftstate.core.errors import FTError
from tests.integration.workers import TinyRollout, TinyTrainer

NODES = ("a", "b", "c")
#: How long one wait (spares warm, a drain, a failover) may take before the round gives up.
WAIT_S = 180.0
NOTICE_S = 120.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class NotReady(Exception):
    """The run did not get where the benchmark waits for."""


def config(args: argparse.Namespace, *, gce: bool, name: str) -> ftstate.RuntimeConfig:
    ft: dict[str, Any] = {"enable": True, "mode": "standby", "standby_workers": args.spares,
                          "reverse_weight_sync": True, "max_failovers": 4}
    if gce:
        ft |= {"detect_node_maintenance": True, "maintenance_sources": ["gce"],
               "maintenance_check_interval": args.check_interval, "maintenance_request_timeout_s": 1.0}
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": 2, "bucket_size_mb": 64, "init_timeout_s": 300, "sync_timeout_s": 300,
        "failover_timeout_s": 300, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0,
        "fault_tolerance": ft,
        "audit_log": str(Path(args.trails) / f"{name}.jsonl") if args.trails else None,
        "placement": {
            "trainer": {"labels": {LABEL: "a"}},
            "rollout": {"strategy": "PACK", "labels": {LABEL: "in(b,c)"}},
            # Spares anywhere off the nodes they cover: after a drain of b or c that leaves a
            # node for the replenished spares (with in(b,c) they would land on the drained node).
        },
    }, environ={})


async def wait_for(cond, timeout: float, what: str, rt: ftstate.Runtime) -> float:
    """Poll ``cond`` every 5 ms; returns the loop time it first held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if rt.state == "FAILED":
            raise NotReady(f"the run failed: {rt.group.error if rt.group else 'unknown error'}")
        if loop.time() > deadline:
            raise NotReady(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.005)
    return loop.time()


def rollout_node(rt: ftstate.Runtime) -> str:
    nodes = {m.node_id for m in rt.members() if m.member in rt.serving_rollouts()}
    if len(nodes) != 1 or None in nodes:
        raise NotReady(f"the rollouts are not packed on one node: {nodes}")
    return nodes.pop()


def spares_ready(rt: ftstate.Runtime, node: str, n: int) -> bool:
    """``n`` warm rollout spares off ``node`` and a warm trainer spare."""
    warm = [m for m in rt.members() if m.rank < 0 and m.state == "STANDBY"]
    return (sum(1 for m in warm if m.role == "rollout" and m.node_id != node) >= n
            and any(m.role == "trainer" for m in warm))


@dataclasses.dataclass
class Traffic:
    """A sync loop beside the drain: rollout_map, train_step, sync, pause; nothing may fail."""

    rt: ftstate.Runtime
    pause: float
    syncs: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    iterations: list[float] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            self.iterations.append(loop.time())
            try:
                await self.rt.rollout_map("generate", [f"p{i}" for i in range(4)])
                await self.rt.trainer("train_step")
                t0 = loop.time()
                await self.rt.sync()
                self.syncs.append((t0, loop.time()))
            except FTError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                if self.rt.state == "FAILED":
                    return
            await asyncio.sleep(self.pause)

    async def __aenter__(self) -> Traffic:
        self.task = asyncio.ensure_future(self._run())
        await wait_for(lambda: len(self.syncs) >= 1 or bool(self.failures), WAIT_S, "the sync loop", self.rt)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        if self.task is not None:
            await self.task

    def overlapping(self, start: float, end: float) -> int:
        return sum(1 for s, e in self.syncs if s < end and e > start)


def group_sync_failures(rt: ftstate.Runtime, since: int) -> int:
    return sum(1 for r in rt.audit.records[since:] if r["event"] == "transition" and r.get("machine") == "group"
               and r.get("from") == "SYNCING" and r.get("trigger") in ("sync_failed", "sync_timeout"))


def drain_times(rt: ftstate.Runtime, marker: str, moved: dict[str, str]) -> dict[str, float]:
    """Seconds from the marker record to the drain's start, the last replacement admitted
    (serving) and the drain's end, all in the audit trail's clock."""
    recs = rt.audit.records
    i0 = next(i for i, r in enumerate(recs) if r["event"] == "note" and r.get("mark") == marker)
    t0 = recs[i0]["t"]
    after = recs[i0:]
    started = next(r["t"] for r in after if r["event"] == "drain_started")
    admitted = [r["t"] for r in after if r["event"] == "transition" and r.get("member") in moved.values()
                and r.get("to") == "READY" and r.get("trigger") == "admit"]
    ended = next(r["t"] for r in after if r["event"] in ("drain_drained", "drain_failed", "drain_cancelled"))
    if not admitted:
        raise NotReady("no replacement was admitted")
    return {"started": started - t0, "serving": max(admitted) - t0, "drained": ended - t0}


async def consistent(rt: ftstate.Runtime, drained_node: str) -> None:
    trainer_sum = await rt.trainer("checksum")
    sums = await rt.rollout("checksum")
    if not sums or any(s != trainer_sum for s in sums):
        raise NotReady(f"rollouts do not hold the trainer's weights: {trainer_sum} vs {sums}")
    on = {m.member: m.node_id for m in rt.members()}
    if any(on[s] == drained_node for s in rt.serving_rollouts()):
        raise NotReady("a rollout still serves on the drained node")


async def failover(rt: ftstate.Runtime, out: dict[str, list]) -> None:
    """SIGKILL an idle rollout; kill -> its replacement serving the current version."""
    await wait_for(lambda: any(m.rank < 0 and m.state == "STANDBY" and m.role == "rollout" for m in rt.members()),
                   WAIT_S, "a warm rollout spare", rt)
    before = len(rt.failovers)
    victim = await rt.chaos.kill("rollout", 1)
    t_kill = rt.chaos.injected[-1][0]
    await wait_for(lambda: len(rt.failovers) > before and rt.state == "READY", WAIT_S, f"{victim} replaced", rt)
    f = rt.failovers[-1]
    if not f.resynced:
        raise NotReady(f"{victim}'s replacement was not resynced point to point")
    out["failover"].append(f.detected_at - t_kill + f.total_s)
    out["fo_detection"].append(f.detected_at - t_kill)
    out["fo_rerendezvous"].append(f.rerendezvous_s)
    out["fo_transfer"].append(f.transfer_s)


def cycle(traffic: Traffic) -> float:
    """One iteration of the sync loop as measured so far (rollout_map, train_step, sync, pause)."""
    return traffic.syncs[0][1] - traffic.iterations[0] + traffic.pause


async def drain_round(args: argparse.Namespace, lc: LocalCluster, floats: int, out: dict[str, list],
                      phase: random.Random) -> None:
    async with ftstate.Runtime(config(args, gce=False, name=f"drain-{len(out['serving']) + len(out['error']) + 1}"),
                               trainer=TinyTrainer, rollout=TinyRollout,
                               trainer_kwargs={"big_floats": floats}) as rt:
        report = await rt.sync()
        node = rollout_node(rt)
        await wait_for(lambda: spares_ready(rt, node, min(2, args.spares)), WAIT_S, "warm spares off the rollouts' node", rt)
        await rt.trainer("train_step")
        out["sync"].append((await rt.sync()).seconds)
        since = len(rt.audit.records)
        async with Traffic(rt, args.pause) as traffic:
            loop = asyncio.get_running_loop()
            # The notice lands anywhere in the loop's cycle (mid-sync too), not just after a sync.
            await asyncio.sleep(phase.uniform(0.0, cycle(traffic)))
            t0 = loop.time()
            rt.audit.record("note", mark="bench_notice", node=node)
            record = await rt.drain(node, reason="benchmark: host maintenance", deadline=time.time() + NOTICE_S,
                                    source="api", kind="terminate")
            t1 = loop.time()
            await wait_for(lambda: traffic.syncs and traffic.syncs[-1][0] > t1, WAIT_S, "a sync after the drain", rt)
        if record.outcome != "drained":
            raise NotReady(f"drain {record.outcome}: {record.reason}")
        times = drain_times(rt, "bench_notice", record.moved)
        await consistent(rt, node)
        for key in ("started", "serving", "drained"):
            out[key].append(times[key])
        out["call"].append(t1 - t0)
        out["syncs_during"].append(traffic.overlapping(t0, t1))
        out["syncs"].append(len(traffic.syncs))
        out["failed"].append(len(traffic.failures) + group_sync_failures(rt, since))
        out["failures"] += traffic.failures
        out["budget_spent"].append(sum(1 for r in rt.audit.records if r["event"] == "budget_spent"))
        out["moved"].append(len(record.moved))
        out["nbytes"] = [report.nbytes]
        await failover(rt, out)


async def gce_round(args: argparse.Namespace, lc: LocalCluster, servers: dict[str, GceServer], floats: int,
                    out: dict[str, list], phase: random.Random) -> None:
    async with ftstate.Runtime(config(args, gce=True, name=f"gce-{len(out['serving']) + len(out['error']) + 1}"),
                               trainer=TinyTrainer, rollout=TinyRollout,
                               trainer_kwargs={"big_floats": floats}) as rt:
        await rt.sync()
        node = rollout_node(rt)
        name = lc.name_of(node)
        if name is None:
            raise NotReady(f"the rollouts' node {node[:8]} is not one of the cluster's")
        await wait_for(lambda: spares_ready(rt, node, min(2, args.spares)), WAIT_S, "warm spares off the rollouts' node", rt)
        await wait_for(lambda: sum(r["event"] == "maintenance_sources" and r.get("place") == "node"
                                   for r in rt.audit.records) >= 2, WAIT_S, "the node watchers", rt)
        since = len(rt.audit.records)
        server = servers[name]
        async with Traffic(rt, args.pause) as traffic:
            await asyncio.sleep(phase.uniform(0.0, cycle(traffic)))
            t0 = time.monotonic()
            rt.audit.record("note", mark="bench_announce", node=node, name=name)
            server.announce("TERMINATE_ON_HOST_MAINTENANCE", seconds=NOTICE_S)
            await wait_for(lambda: any(d.node == node for d in rt.drains), WAIT_S, "the drain", rt)
            t1 = asyncio.get_running_loop().time()
            await wait_for(lambda: traffic.syncs and traffic.syncs[-1][0] > t1, WAIT_S, "a sync after the drain", rt)
        server.withdraw()
        [record] = [d for d in rt.drains if d.node == node]
        if record.outcome != "drained":
            raise NotReady(f"drain {record.outcome}: {record.reason}")
        read = server.first_answer.get(("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE"))
        marker = next(r["t"] for r in rt.audit.records[since:] if r["event"] == "note" and r.get("mark") == "bench_announce")
        notice = next(r["t"] for r in rt.audit.records[since:] if r["event"] == "maintenance_notice")
        times = drain_times(rt, "bench_announce", record.moved)
        await consistent(rt, node)
        out["read"].append(read - t0 if read is not None else float("nan"))
        out["notice"].append(notice - marker)
        for key in ("started", "serving", "drained"):
            out[key].append(times[key])
        out["failed"].append(len(traffic.failures) + group_sync_failures(rt, since))
        out["failures"] += traffic.failures
        out["syncs"].append(len(traffic.syncs))
        out["moved"].append(len(record.moved))


def results() -> dict[str, list]:
    keys = ("started", "serving", "drained", "call", "failover", "fo_detection", "fo_rerendezvous", "fo_transfer",
            "sync", "syncs", "syncs_during", "failed",
            "failures", "budget_spent", "moved", "nbytes", "read", "notice", "error")
    return {k: [] for k in keys}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notices", type=int, default=10, help="drain rounds (each a fresh runtime)")
    ap.add_argument("--gce-notices", type=int, default=1, help="rounds through a real loopback GCE notice")
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--spares", type=int, default=2, help="prewarmed spares per role (standby_workers)")
    ap.add_argument("--check-interval", type=float, default=1.0, help="maintenance_check_interval (GCE rounds)")
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between two iterations of the sync loop")
    ap.add_argument("--trails", default=None, help="folder for each round's audit trail (default: none kept)")
    ap.add_argument("--seed", type=int, default=0, help="seed of where in the sync loop's cycle each notice lands")
    args = ap.parse_args()
    floats = args.size_mb * 2**20 // 4
    servers = {name: GceServer(keep_requests=64) for name in NODES}
    lc = start_local_cluster(NODES, env={n: {"GCE_METADATA_HOST": s.host} for n, s in servers.items()})
    cluster.mute_worker_death_notices()  # every death is in the runs' audit trails
    print(f"cluster: 3 nodes up in {lc.started_s:.1f} s; {args.size_mb} MB of weights, {args.spares} spares per "
          f"role, sync loop pause {args.pause:g} s", flush=True)
    api, gce = results(), results()
    phase = random.Random(args.seed)
    try:
        for i in range(args.notices):
            try:
                await drain_round(args, lc, floats, api, phase)
            except NotReady as exc:
                api["error"].append(f"drain round {i + 1}: {exc}")
                print(f"  round {i + 1}: {exc}", file=sys.stderr, flush=True)
                continue
            print(f"  drain {i + 1}/{args.notices}: {api['moved'][-1]} moved, serving {api['serving'][-1] * 1e3:.0f} ms,"
                  f" drained {api['drained'][-1] * 1e3:.0f} ms ({api['syncs_during'][-1]} syncs overlapped, "
                  f"{api['failed'][-1]} failed); failover {api['failover'][-1] * 1e3:.0f} ms (detection "
                  f"{api['fo_detection'][-1] * 1e3:.0f}, re-rendezvous {api['fo_rerendezvous'][-1] * 1e3:.0f}, "
                  f"transfer {api['fo_transfer'][-1] * 1e3:.0f})", file=sys.stderr,
                  flush=True)
        for i in range(args.gce_notices):
            try:
                await gce_round(args, lc, servers, floats, gce, phase)
            except NotReady as exc:
                gce["error"].append(f"GCE round {i + 1}: {exc}")
                print(f"  GCE round {i + 1}: {exc}", file=sys.stderr, flush=True)
                continue
            print(f"  GCE notice {i + 1}/{args.gce_notices}: read {gce['read'][-1] * 1e3:.0f} ms, notice "
                  f"{gce['notice'][-1] * 1e3:.0f} ms, serving {gce['serving'][-1] * 1e3:.0f} ms, drained "
                  f"{gce['drained'][-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    finally:
        lc.shutdown()
        for s in servers.values():
            s.close()

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:7.0f}/{pct(xs, 0.95) * 1e3:<7.0f}" if xs else f"{'-':>15}"

    n = len(api["serving"])
    print(f"\n{'what':>31} {'n':>3} | {'median/p95 ms':>15}")
    rows = [("drain: notice -> started", api["started"]), ("drain: -> replacements serving", api["serving"]),
            ("drain: -> drained (retired)", api["drained"]), ("process failover (SIGKILL)", api["failover"]),
            ("  failover: detection", api["fo_detection"]), ("  failover: re-rendezvous", api["fo_rerendezvous"]),
            ("  failover: transfer", api["fo_transfer"]),
            ("sync, no drain (baseline)", api["sync"])]
    for label, xs in rows:
        print(f"{label:>31} {len(xs):>3} | {cell(xs)}")
    if api["serving"] and api["failover"]:
        print(f"drain serving / process failover (medians): "
              f"{statistics.median(api['serving']) / statistics.median(api['failover']):.2f}")
    if n:
        print(f"members moved per drain: {sorted(set(api['moved']))}; syncs during the rounds: {sum(api['syncs'])} "
              f"({sum(api['syncs_during'])} overlapping a drain), failed: {sum(api['failed'])}; "
              f"budget spent by drains: {sum(api['budget_spent'])}")
    if gce["serving"]:
        print(f"\nGCE notice (maintenance_check_interval {args.check_interval:g} s), {len(gce['serving'])} round(s), "
              "ms from the server's switch to TERMINATE_ON_HOST_MAINTENANCE:")
        for label, key in (("watcher read it", "read"), ("notice in the trail", "notice"), ("drain started", "started"),
                           ("replacements serving", "serving"), ("drained", "drained")):
            print(f"{label:>31} | {cell(gce[key])}")
        print(f"syncs during the GCE rounds: {sum(gce['syncs'])}, failed: {sum(gce['failed'])}")
    for f in api["failures"] + gce["failures"]:
        print(f"failed sync/call: {f}")
    for err in api["error"] + gce["error"]:
        print(f"stopped early: {err}")
    if api["error"] or gce["error"] or sum(api["failed"]) or sum(gce["failed"]):
        raise SystemExit(1)


if __name__ == "__main__":
    t0 = time.monotonic()
    asyncio.run(main())
    print(f"took {time.monotonic() - t0:.0f} s", file=sys.stderr)
