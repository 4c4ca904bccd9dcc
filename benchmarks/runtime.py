"""Benchmark: the runtime's control-plane cost per sync, and detection latency.

1. Control plane. For 1, 2, 4 and 8 rollouts, ``rt.sync()`` of a tiny state (so the bytes
   on the wire cost nothing) against the transport alone between the same actors in the
   same run: the trainer's ``send_weights`` and every rollout's ``receive_weights`` called
   directly, without machines, audit, checksum comparison or the commit round. The ratio
   is what the runtime adds around a transfer.
2. Detection. SIGKILL of a rollout, idle (found by the heartbeat poll) and with a call
   pending (found by Ray's ActorDiedError), to its machine entering LOST: median and p95.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/runtime.py [--rollouts 1,2,4,8] [--rounds 20] [--kills 20]
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
from ftstate.core.protocol import ReceiveWeights, SendWeights, UserCall
from tests.integration.workers import TinyRollout, TinyTrainer


def cfg(rollouts: int, **ft) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": rollouts, "init_timeout_s": 120, "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 2.0, "fault_tolerance": ft or {"enable": False},
    }, environ={})


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def control_plane(rollouts: int, rounds: int) -> tuple[float, float]:
    async with ftstate.Runtime(cfg(rollouts), trainer=TinyTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        t0 = time.perf_counter()
        for _ in range(rounds):
            await rt.sync()
        sync_s = (time.perf_counter() - t0) / rounds
        trainer = rt.handle("trainer-0")
        handles = [rt.handle(m.member) for m in rt.members() if m.role == "rollout"]
        t0 = time.perf_counter()
        for i in range(rounds):
            version = 10_000 + i
            await asyncio.gather(trainer.send_weights.remote(SendWeights(version, 60.0)),
                                 *(h.receive_weights.remote(ReceiveWeights(version, 0, 60.0)) for h in handles))
        raw_s = (time.perf_counter() - t0) / rounds
    return sync_s, raw_s


async def detection(kills: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"idle": [], "call pending": []}
    config = cfg(2, enable=True, reverse_weight_sync=True, max_failovers=2 * kills + 2)
    async with ftstate.Runtime(config, trainer=TinyTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        for i in range(2 * kills):
            mode = "idle" if i % 2 == 0 else "call pending"
            while not any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()):
                await asyncio.sleep(0.05)
            victim = rt.serving_rollouts()[-1]
            before = len(rt.failovers)
            pending = None
            if mode == "call pending":
                pending = asyncio.ensure_future(rt._calls.call(victim, rt.handle(victim), UserCall("generate", ("x",))))
                await asyncio.sleep(0)
            await rt.chaos.kill(victim)
            t_kill = rt.chaos.injected[-1][0]
            while len(rt.failovers) == before:
                await asyncio.sleep(0.005)
            out[mode].append(rt.failovers[-1].detected_at - t_kill)
            if pending is not None:
                await asyncio.gather(pending, return_exceptions=True)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kills", type=int, default=20)
    args = ap.parse_args()
    started = cluster.connect(None, num_cpus=16, log_to_driver=False)
    try:
        print(f"{'rollouts':>8} | {'rt.sync() ms':>12} {'transport ms':>12} {'ratio':>6}")
        for n in [int(x) for x in args.rollouts.split(",")]:
            sync_s, raw_s = await control_plane(n, args.rounds)
            print(f"{n:>8} | {sync_s * 1e3:>12.1f} {raw_s * 1e3:>12.1f} {sync_s / raw_s:>6.2f}")
        if args.kills:
            det = await detection(args.kills)
            print(f"\ndetection latency (SIGKILL -> LOST), {args.kills} kills each, heartbeat_interval_s=0.2")
            for mode, xs in det.items():
                print(f"  {mode:>12}: median {statistics.median(xs) * 1e3:.0f} ms, p95 {pct(xs, 0.95) * 1e3:.0f} ms, "
                      f"max {max(xs) * 1e3:.0f} ms")
    finally:
        if started:
            cluster.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
