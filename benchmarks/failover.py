"""Benchmark: failover latency, kill -> replacement serving the current weights version.

For a rollout, for the trainer (reverse weight sync from a rollout) and for one trainer
rank of two (``rank``: ``trainer_workers: 2``, each rank owning half of every tensor as dim-0
slices; rank 1 killed right after a sync, so only the newcomer gets its part back, from a
rollout), at 64 MB and 512 MB of float32 weights in all, SIGKILL the worker ``--kills`` times and split each failover into
detection (kill -> LOST), re-rendezvous (LOST handled -> group version N+1 formed) and
transfer (the current version to the newcomer only, checksum-verified). The transfer is
also given as a ratio to a bare point-to-point send of the same bytes (a rank's part: its half)
from the same source to the same newcomer, into a buffer touched beforehand as the spare's
reserved staging is, measured in the same run. Prewarmed spares (standby mode), heartbeat_interval_s 0.2.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/failover.py [--sizes 64,512] [--kills 30]
        [--shared-memory auto|off] [--roles rollout,trainer,rank] [--rollout tiny|resident]
        [--trainer tiny|resident] [--audit-dir DIR]

Tails: each cell is median / p95 / p99 / max, and under each row the slowest kill with its
stage timings from the ``failover`` audit record (the sender reading and sending its committed
state; the newcomer receiving into staging, waiting for its user lock, loading, proving what
it holds) and whether the promoted spare's staging was reserved. A kill waits for a spare that
is warm for the current size (STANDBY with its staging reserved), as a run that has been up
for a while has.

Detection rides on the vigil call kept pending on every worker (ftstate.controller.vigil).
``--shared-memory``: the config key; with ``auto`` (default) the newcomer, on its source's
node here, is resynced through shared memory, with ``off`` over gloo point to point.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ftstate
from ftstate.controller.ray import cluster
from ftstate.core.protocol import RawBroadcast
from tests.integration.workers import PartTrainer, ResidentRollout, ResidentTrainer, TinyRollout, TinyTrainer


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _stages_text(stages: dict | None) -> str:
    if not stages:
        return "no point-to-point resync"
    parts = [f"from {stages.get('source')} over {stages.get('route')}"]
    for side in ("sender", "newcomer"):
        got = stages.get(side) or {}
        parts.append(f"{side} " + " ".join(f"{k} {v * 1e3:.0f}" for k, v in got.items()))
    return "; ".join(parts) + " (ms)"


def _check(rt: ftstate.Runtime) -> None:
    """Stop the benchmark with the run's error instead of waiting forever for a READY that
    a failed group never reaches."""
    if rt.state == "FAILED":
        raise SystemExit(f"the run failed: {rt.group.error if rt.group else 'unknown error'}")


async def run(size_mb: int, role: str, kills: int, shared_memory: str = "auto",
              rollout: str = "tiny", trainer: str = "tiny", audit_dir: str | None = None) -> dict[str, list]:
    ranks = role == "rank"  # one trainer rank of two
    cfg = ftstate.RuntimeConfig.from_dict({
        "trainer_workers": 2 if ranks else 1,
        "rollout_workers": 2, "init_timeout_s": 300, "sync_timeout_s": 300, "failover_timeout_s": 300,
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "bucket_size_mb": 64,
        "shared_memory": "off" if ranks else shared_memory,  # several ranks: the collective only
        "fault_tolerance": {"enable": True, "reverse_weight_sync": True, "max_failovers": kills + 1},
        "audit_log": f"{audit_dir}/failover-{role}-{size_mb}.jsonl" if audit_dir else None,
    }, environ={})
    floats = size_mb * 2**20 // 4
    out: dict[str, list] = {k: [] for k in ("detection", "rerendezvous", "transfer", "total", "raw", "why")}
    resident = rollout == "resident"
    trainer_cls = PartTrainer if ranks else ResidentTrainer if trainer == "resident" else TinyTrainer
    async with ftstate.Runtime(cfg, trainer=trainer_cls,
                               rollout=ResidentRollout if resident else TinyRollout,
                               trainer_kwargs={"big_floats": floats},
                               rollout_kwargs={"big_floats": floats} if resident else None) as rt:
        report = await rt.sync()
        spare_role = "trainer" if ranks else role

        async def warm_spare() -> None:
            while not any(m.state == "STANDBY" and m.role == spare_role and m.reserved_bytes >= report.nbytes
                          for m in rt.members()):
                _check(rt)
                await asyncio.sleep(0.05)

        for _ in range(kills):
            await warm_spare()
            before = len(rt.failovers)
            victim = await rt.chaos.kill(spare_role, 0 if role == "trainer" else 1)
            t_kill = rt.chaos.injected[-1][0]
            while len(rt.failovers) == before or rt.state != "READY":
                _check(rt)
                await asyncio.sleep(0.005)
            f = rt.failovers[-1]
            assert f.lost == victim and f.resynced, f
            detection = f.detected_at - t_kill
            out["detection"].append(detection)
            out["rerendezvous"].append(f.rerendezvous_s)
            out["transfer"].append(f.transfer_s)
            out["total"].append(detection + f.total_s)
            out["why"].append(f"detection {detection * 1e3:.0f}, re-rendezvous {f.rerendezvous_s * 1e3:.0f}, "
                              f"transfer {f.transfer_s * 1e3:.0f}: {_stages_text(f.stages)}")
            # Baseline: a bare point-to-point send of the same bytes from the newcomer's source to
            # the newcomer, same processes, into a buffer touched beforehand as the spare's staging is;
            # once the next spare is warm, as the transfer ran (a spare starting up takes the CPUs)
            await warm_spare()
            members = [m for m in rt.members() if m.rank >= 0 and m.state == "READY"]
            nbytes = report.nbytes
            if ranks:  # the newcomer got its part only: half the bytes
                assert rt.audit.records and [r for r in rt.audit.records
                                             if r.get("event") == "trainer_ranks_recovered"][-1]["restored"] == [
                    f.replacement], "only the newcomer should have been restored right after a sync"
                nbytes //= 2
            rank_of = {m.member: m.rank for m in members}
            # a restored rank's part comes from a rollout (no point-to-point stages are recorded for it)
            source = rank_of.get((f.stages or {}).get("source"),
                                 next(m.rank for m in members if m.role == "rollout"))
            secs = await asyncio.gather(*(rt.handle(m.member).bench_raw_broadcast.remote(
                RawBroadcast(nbytes, source, 300.0, to=rank_of[f.replacement])) for m in members))
            out["raw"].append(max(secs))
            print(f"  {role} {size_mb} MB kill {len(out['total'])}/{kills}: total {out['total'][-1] * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--roles", default="rollout,trainer")
    ap.add_argument("--shared-memory", default="auto", choices=("auto", "off"))
    ap.add_argument("--rollout", default="tiny", choices=("tiny", "resident"),
                    help="tiny: load_weights keeps a fresh clone (new memory each load); resident: it copies "
                         "into parameters built with the rollout, as an inference engine does")
    ap.add_argument("--trainer", default="tiny", choices=("tiny", "resident"),
                    help="tiny: load_state_dict keeps clones (new memory each load); resident: it copies into "
                         "the tensors built with the trainer, as torch.nn.Module.load_state_dict does")
    ap.add_argument("--audit-dir", default=None, help="write each run's audit trail there")
    args = ap.parse_args()
    started = cluster.connect(None, num_cpus=16, log_to_driver=False)
    try:
        w = 19
        print(f"{'role':>8} {'MB':>5} | {'detection':>{w}} {'re-rendezvous':>{w}} {'transfer':>{w}} "
              f"{'total':>{w}} | {'transfer/raw p2p':>18}   (median / p95 / p99 / max, ms)")
        for size in [int(s) for s in args.sizes.split(",")]:
            for role in args.roles.split(","):
                r = await run(size, role, args.kills, args.shared_memory, args.rollout, args.trainer,
                              args.audit_dir)

                def cell(xs: list[float]) -> str:
                    return "/".join(f"{v * 1e3:.0f}" for v in (statistics.median(xs), pct(xs, 0.95),
                                                                pct(xs, 0.99), max(xs))).rjust(w)

                ratio = statistics.median(r["transfer"]) / statistics.median(r["raw"])
                print(f"{role:>8} {size:>5} | {cell(r['detection'])} {cell(r['rerendezvous'])} "
                      f"{cell(r['transfer'])} {cell(r['total'])} | {ratio:>18.2f}", flush=True)
                slowest = max(range(len(r["total"])), key=r["total"].__getitem__)
                print(f"{'':>16}slowest: kill {slowest + 1}, {r['total'][slowest] * 1e3:.0f} ms: "
                      f"{r['why'][slowest]}", flush=True)
    finally:
        if started:
            cluster.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
