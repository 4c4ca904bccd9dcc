"""Benchmark: what weight sync costs the rollouts in memory, and that the memory is not bought with speed.

One node (a local Ray cluster), one trainer, 1, 2 and 4 rollouts whose parameters exist from
their construction and whose ``load_weights`` copies into them, as an inference engine does
(``tests.integration.workers.ResidentRollout``). Two kinds of rollout:

* ``plain``: no ``held_weights()``; the transport keeps the committed copy (the source of
  resyncs and reverse recovery) and a spare staging buffer for the next transfer;
* ``held``: ``held_weights()`` gives the engine's weights back (``HeldResidentRollout``), so
  the engine's copy is the only one: the transport lets go of its buffers after each load.

and, both with ``held_weights()``, the node copy (``staging: node``):

* ``node``: the version lands once in the node's shared-memory copy (owned by the node's
  agent); the rollouts verify it in place and load from it; a fresh copy per sync;
* ``spare``: the same with ``node_copy_spare: true`` (the previous copy rewritten in place).

A node copy is shared memory mapped by several processes (or by none: the agent only owns
the file), so no process's USS shows it: the node's figures add the growth of the machine's
``Shmem`` (``/proc/meminfo``: every ``/dev/shm`` file, the trainer's slots included) to the
rollouts' anonymous memory (``RssAnon``), sampled every 10 ms during the syncs for the peak.

For each: resident memory of every rollout process from ``/proc/PID/smaps_rollup`` (USS:
private clean + dirty; PSS) before the first sync (parameters already resident) and after
two syncs, the extra per rollout and for the node in all as a multiple of the weights' size,
the peak staging the runtime recorded (``SyncReport.staging_bytes``), and the sync time
against a bare gloo broadcast of the same bytes between the same processes and against the
same-host floor (one in-process copy of the weights per rollout), all in the same run.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/memory.py [--sizes 256,1024]
        [--rollouts 1,2,4] [--kinds plain,held,node,spare] [--syncs 3]

Goals (issue 24): extra unique memory per rollout <= 0.1x the weights + 2 buckets; the node's
extra <= 1x the weights at rest and <= 2x during a sync, whatever the number of rollouts.
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

import torch

import ftstate
from ftstate.controller.ray import cluster
from ftstate.core.protocol import RawBroadcast
from tests.integration.workers import HeldResidentRollout, ResidentRollout, TinyTrainer

BUCKET_MB = 64


def smaps(pid: int) -> dict[str, int]:
    """USS and PSS of process ``pid``, bytes."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0), "pss": fields.get("Pss", 0)}


def node_extra(pids: list[int]) -> int:
    """What the node holds for the rollouts, bytes: their anonymous memory plus the machine's
    shared memory (every /dev/shm file, node copies and the trainer's slots)."""
    anon = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            anon += next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024
    with open("/proc/meminfo") as f:
        shmem = next(int(line.split()[1]) for line in f if line.startswith("Shmem:")) * 1024
    return anon + shmem


class PeakSampler:
    """Samples :func:`node_extra` every ``interval_s`` in a thread; ``peak`` is the highest seen."""

    def __init__(self, pids: list[int], interval_s: float = 0.01) -> None:
        import threading

        self.pids, self.interval_s, self.peak = pids, interval_s, node_extra(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, node_extra(self.pids))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


KINDS = {  # kind: (rollout class, config)
    "plain": (ResidentRollout, {}),
    "held": (HeldResidentRollout, {}),
    "node": (HeldResidentRollout, {"staging": "node"}),
    "spare": (HeldResidentRollout, {"staging": "node", "node_copy_spare": True}),
}


def floor_seconds(nbytes: int, readers: int) -> float:
    """The same-host floor: one copy of the weights per reader, in this process (best of 3)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(readers):
            dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


async def run(size_mb: int, rollouts: int, kind: str, syncs: int) -> dict[str, float]:
    floats = size_mb * 2**20 // 4
    rollout, staging = KINDS[kind]
    cfg = ftstate.RuntimeConfig.from_dict({
        "rollout_workers": rollouts, "init_timeout_s": 300, "sync_timeout_s": 300,
        "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0, "bucket_size_mb": BUCKET_MB,
        "fault_tolerance": {"enable": True, "mode": "cold"}, **staging,
    }, environ={})
    weights = floats * 4
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=rollout, trainer_kwargs={"big_floats": floats},
                               rollout_kwargs={"big_floats": floats}) as rt:
        pids = [m.pid for m in rt.members() if m.role == "rollout"]
        before = [smaps(p) for p in pids]
        node_before = node_extra(pids)
        times, peaks, nodes = [], [], []
        with PeakSampler(pids) as sampler:
            for i in range(syncs):
                if i:
                    await rt.trainer("train_step")
                report = await rt.sync()
                times.append(report.seconds)
                peaks.append(max(report.staging_bytes.values()))
                nodes.append(sum(report.node_staging_bytes.values()))
        after = [smaps(p) for p in pids]
        node_rest = node_extra(pids) - node_before
        members = [m for m in rt.members() if m.rank >= 0]
        raw = await asyncio.gather(*(rt.handle(m.member).bench_raw_broadcast.remote(RawBroadcast(report.nbytes, 0, 300.0))
                                     for m in members))
        held = sum(report.held_bytes.values())
    uss = [(a["uss"] - b["uss"]) / weights for a, b in zip(after, before, strict=True)]
    pss = sum(a["pss"] - b["pss"] for a, b in zip(after, before, strict=True)) / weights
    sync = statistics.median(times[1:] or times)
    return {"uss_per_rollout": max(uss), "node_at_rest": pss, "node_held": held / weights,
            "node_rest_measured": node_rest / weights, "node_peak_measured": (sampler.peak - node_before) / weights,
            "peak_per_rollout": max(peaks) / weights, "node_peak": max(nodes) / weights,
            "sync_s": sync, "raw_ratio": sync / max(raw), "floor_ratio": sync / floor_seconds(weights, rollouts)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--rollouts", default="1,2,4")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--syncs", type=int, default=3)
    args = ap.parse_args()
    started = cluster.connect(None, num_cpus=16, log_to_driver=False)
    try:
        print("extra memory as a multiple of the weights' size; sync time as a ratio to a bare gloo broadcast "
              "of the same bytes and to one in-process copy per rollout (same run)")
        print(f"{'kind':>6} {'MiB':>5} {'rollouts':>8} | {'USS/rollout':>11} {'node rest':>9} "
              f"{'peak/rollout':>12} {'node peak':>9} | {'node rest*':>10} {'node peak*':>10} | "
              f"{'sync s':>7} {'/bcast':>7} {'/floor':>7}   (* measured: rollouts' RssAnon + machine Shmem)")
        for size in [int(s) for s in args.sizes.split(",")]:
            for n in [int(s) for s in args.rollouts.split(",")]:
                for kind in args.kinds.split(","):
                    r = await run(size, n, kind, args.syncs)
                    print(f"{kind:>6} {size:>5} {n:>8} | {r['uss_per_rollout']:>11.2f} {r['node_at_rest']:>9.2f} "
                          f"{r['peak_per_rollout']:>12.2f} {r['node_peak']:>9.2f} | "
                          f"{r['node_rest_measured']:>10.2f} {r['node_peak_measured']:>10.2f} | {r['sync_s']:>7.3f} "
                          f"{r['raw_ratio']:>7.2f} {r['floor_ratio']:>7.2f}", flush=True)
    finally:
        if started:
            cluster.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
