"""Benchmark: in-flight updates against a barrier, with generations of uneven length.

An asynchronous RL loop on a local Ray cluster: every rollout generates without stop, one
generation after another, each of a length drawn from a log-normal (a long tail, as agentic
rollouts have: median ``--median-steps`` tokens, sigma ``--sigma``); the trainer trains
(``--train-s``) and syncs, ``--steps`` times. The same loop, the same draws, runs once with
``rollout_updates: barrier`` and once with ``in_flight``, in one process:

- the trainer's idle time per step: the time inside ``rt.sync()`` (a barrier waits there for
  every generation in flight; goal for in_flight: at most 0.1x the barrier's);
- the time from ``rt.sync()`` to every rollout on the new version (in_flight: each busy
  rollout swaps at its next safe point, one token later; goal: at most one safe-point interval
  plus the load);
- samples lost: generations that never completed (with ``--kill``, one rollout is SIGKILLed
  mid-run in the in_flight loop and its sample made again on a serving rollout; goal 0).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/async_update.py [--rollouts 4] [--steps 8] [--kill]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ftstate
from ftstate.controller.ray import cluster
from ftstate.core.errors import MemberLost, NoServingWorkers
from ftstate.core.protocol import UserCall
from tests.integration.workers import InFlightRollout, TinyTrainer


def cfg(mode: str, rollouts: int, kill: bool) -> ftstate.RuntimeConfig:
    ft = {"enable": True, "mode": "standby", "max_failovers": 4} if kill else {"enable": False}
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": rollouts, "rollout_updates": mode, "init_timeout_s": 120, "sync_timeout_s": 120,
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "fault_tolerance": ft,
    }, environ={})


def lognormal_lengths(seed: int, median: float, sigma: float, cap: int = 10**9) -> list[int]:
    """The run's generation lengths: the same draws for every mode of one invocation."""
    rng = random.Random(seed)
    return [min(cap, max(1, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(10_000)]


async def sample_forever(rt: ftstate.Runtime, i: int, done: asyncio.Event, draws: Iterator[int],
                         call: Callable[[int], UserCall], samples: list, tally: dict[str, int]) -> None:
    """Rollout ``i``'s loop until ``done``: one generation after another, each ``call(next draw)``; a
    generation whose rollout was lost is made again on a serving one (``tally["retried"]``), given up
    after 5 tries (``tally["lost"]``)."""
    while not done.is_set():
        length, tries = next(draws), 0
        while True:
            names = rt.serving_rollouts()
            if not names:
                await asyncio.sleep(0.05)
                continue
            name = names[i % len(names)]
            try:
                samples.extend(await rt._calls.call(name, rt.handle(name), call(length)))
                break
            except (MemberLost, NoServingWorkers):
                tries += 1
                tally["retried"] += 1
                if tries > 5:
                    tally["lost"] += 1
                    break
                await asyncio.sleep(0.1)


async def run(mode: str, args: argparse.Namespace, kill: bool = False) -> dict[str, float]:
    lengths = lognormal_lengths(args.seed, args.median_steps, args.sigma)
    done = asyncio.Event()
    samples: list[dict] = []
    tally = {"lost": 0, "retried": 0}
    async with ftstate.Runtime(cfg(mode, args.rollouts, kill), trainer=TinyTrainer, rollout=InFlightRollout) as rt:
        await rt.sync()
        draws = iter(lengths)

        def call(steps: int) -> UserCall:
            return UserCall("generate_steps", (["s"],), {"steps": steps, "step_s": args.step_s})

        tasks = [asyncio.ensure_future(sample_forever(rt, i, done, draws, call, samples, tally))
                 for i in range(args.rollouts)]
        await asyncio.sleep(args.warmup_s)
        idle, reach = [], []
        for step in range(args.steps):
            await rt.trainer("train_step", seconds=args.train_s)
            if kill and step == args.steps // 2:
                victim = rt._membership.get(rt.serving_rollouts()[-1])
                os.kill(victim.pid, signal.SIGKILL)
            t0_wall, t0 = time.time(), time.perf_counter()
            report = await rt.sync()
            idle.append(time.perf_counter() - t0)
            if report.pending:
                reach.append((report.weights_version, t0_wall, set(report.pending)))
        done.set()
        await asyncio.gather(*tasks)
        # each pending rollout's first swap to the version after that sync began
        gaps = []
        for version, t0_wall, _pending in reach:
            swaps = [t for s in samples for v, t in s.get("swaps", []) if v >= version and t >= t0_wall]
            if swaps:
                gaps.append(min(swaps) - t0_wall)
    return {"idle_s": statistics.mean(idle), "idle_max_s": max(idle), "samples": len(samples), "lost": tally["lost"],
            "retried": tally["retried"], "reach_p50_s": statistics.median(gaps) if gaps else float("nan")}


def loop_options(description: str, rollouts: int, steps: int, warmup_s: float) -> argparse.ArgumentParser:
    """The options every in-flight benchmark's loop takes (these defaults differ per benchmark)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rollouts", type=int, default=rollouts)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--train-s", type=float, default=0.2)
    p.add_argument("--warmup-s", type=float, default=warmup_s)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kill", action="store_true", help="also an in_flight run with a rollout SIGKILLed mid-run")
    return p


def main() -> None:
    p = loop_options(__doc__.splitlines()[0], rollouts=4, steps=8, warmup_s=1.0)
    p.add_argument("--median-steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.025)
    args = p.parse_args()
    cluster.connect(None, num_cpus=max(4, args.rollouts + 2), log_to_driver=False)
    try:
        barrier = asyncio.run(run("barrier", args))
        in_flight = asyncio.run(run("in_flight", args))
        print(f"{'mode':10s} {'idle/step s':>12s} {'max s':>8s} {'samples':>8s} {'reach p50 s':>12s}")
        for name, r in (("barrier", barrier), ("in_flight", in_flight)):
            print(f"{name:10s} {r['idle_s']:12.3f} {r['idle_max_s']:8.3f} {r['samples']:8d} {r['reach_p50_s']:12.3f}")
        print(f"idle ratio in_flight / barrier: {in_flight['idle_s'] / barrier['idle_s']:.3f} (goal <= 0.1); "
              f"safe-point interval {args.step_s:.3f} s")
        if args.kill:
            faulted = asyncio.run(run("in_flight", args, kill=True))
            print(f"in_flight with a rollout SIGKILLed: samples {faulted['samples']}, lost {faulted['lost']} "
                  f"(goal 0), made again {faulted['retried']}, idle/step {faulted['idle_s']:.3f} s")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
