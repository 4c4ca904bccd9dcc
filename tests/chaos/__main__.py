"""``python -m tests.chaos``: seeded fault schedules on a 3-node cluster of this machine.

    python -m tests.chaos --seeds 1,2,3 --faults 6          # draw and run; a failure prints its seed,
                                                              # schedule and the JSON to replay it
    python -m tests.chaos --replay failed.json [--shrink]    # one schedule again (and shrink it)
    python -m tests.chaos --soak-minutes 120                 # seeds 1, 2, … until the time is up
                                                              # (make soak), with the figures at the end

Heartbeats are ftstate's defaults unless ``--heartbeat-interval`` / ``--heartbeat-timeout`` say
otherwise (the CI seeds use shorter ones to fit their time). Exit status 1 when a schedule broke
an invariant.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos.runner import ChaosRun, Outcome
from tests.chaos.schedule import Schedule, draw, shrink


def _play(mn, schedule: Schedule, out: Path, hb: dict) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="ftstate-chaos-") as tmp:
        outcome = asyncio.run(ChaosRun(mn, schedule, Path(tmp), **hb).run())
        if not outcome.ok:
            name = f"seed-{schedule.seed}" if schedule.seed is not None else f"shrunk-{len(schedule.faults)}"
            (out / f"{name}.json").write_text(schedule.to_json())
            trail = Path(tmp) / "audit.jsonl"
            if trail.exists():
                (out / f"{name}.audit.jsonl").write_bytes(trail.read_bytes())
    return outcome


def _figures() -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return {"rss_mib": round(rss / 1024, 1), "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "fds": len(os.listdir("/proc/self/fd")),
            "shm_segments": sum(1 for n in os.listdir("/dev/shm") if n.startswith("ftstate-"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1", help="comma-separated seeds (default 1)")
    p.add_argument("--faults", type=int, default=6, help="faults per schedule (default 6)")
    p.add_argument("--steps", type=int, default=None, help="steps per schedule (default faults + 1)")
    p.add_argument("--replay", type=Path, help="a schedule's JSON (written when one fails)")
    p.add_argument("--shrink", action="store_true", help="reduce a failing schedule (one run per candidate)")
    p.add_argument("--soak-minutes", type=float, default=0.0, help="run seeds 1, 2, … for this long")
    p.add_argument("--heartbeat-interval", type=float, default=None, help="default: ftstate's (1 s)")
    p.add_argument("--heartbeat-timeout", type=float, default=None, help="default: ftstate's (10 s)")
    p.add_argument("--out", type=Path, default=Path("chaos-out"), help="where failing schedules go (chaos-out/)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    hb = {"heartbeat_interval_s": args.heartbeat_interval, "heartbeat_timeout_s": args.heartbeat_timeout}

    from tests.multinode.harness import start_cluster, stop_cluster

    mn = start_cluster()
    failed = 0
    try:
        if args.replay:
            schedules = iter([Schedule.from_json(args.replay.read_text())])
        elif args.soak_minutes:
            def endless():
                seed = 1
                while True:
                    yield draw(seed, args.faults, args.steps)
                    seed += 1
            schedules = endless()
        else:
            schedules = iter([draw(int(s), args.faults, args.steps) for s in args.seeds.split(",")])
        start, t0 = _figures(), time.monotonic()
        totals = {"schedules": 0, "syncs": 0, "faults": 0, "failovers": 0}
        for schedule in schedules:
            if args.soak_minutes and time.monotonic() - t0 > args.soak_minutes * 60:
                break
            outcome = _play(mn, schedule, args.out, hb)
            totals["schedules"] += 1
            totals["syncs"] += outcome.syncs
            totals["faults"] += len(outcome.injected)
            totals["failovers"] += outcome.failovers
            print(outcome.report(), flush=True)
            if outcome.ok:
                continue
            failed += 1
            if args.shrink:
                def fails(candidate: Schedule) -> bool:
                    return not _play(mn, candidate, args.out, hb).ok

                def told(candidate: Schedule, failed_too: bool) -> None:
                    print(f"shrink: {len(candidate.faults)} faults -> {'still fails' if failed_too else 'passes'}",
                          flush=True)

                smallest = shrink(schedule, fails, on_try=told)
                print("shrunk to:\n" + smallest.describe() + "\n" + smallest.to_json(), flush=True)
        end = _figures()
        print(f"\n{totals['schedules']} schedules, {totals['faults']} faults injected, {totals['syncs']} syncs, "
              f"{totals['failovers']} failovers, {failed} failed, {time.monotonic() - t0:.0f}s; "
              f"driver at start {start}, at end {end}", flush=True)
    finally:
        stop_cluster(mn)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
