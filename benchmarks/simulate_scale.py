"""Benchmark: the CPU ``ftstate simulate`` takes for a job's days, per failure replayed, against
the goal of issue 43 (``--members 10000 --days 54`` in under 3 minutes of CPU).

Runs :func:`ftstate.cli.simulate.simulate` in this process for each seed and reports the user
CPU, the wall time, the failures replayed, the CPU per failure, and the CPU a 54-day run of the
same job would take at that rate (the run's CPU scaled by the days: the failures of a mix grow
with them; the start, paid once, is scaled too, which errs high). ``--bound-s`` fails the run (exit 1) when that projection is above it: a shorter run
checks the goal proportionally, where the 54 days themselves take too long for a test.

    python benchmarks/simulate_scale.py [--members 10000] [--days 5] [--seeds 1] [--bound-s 180]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftstate.cli.simulate import SimulateOptions, parse_seeds, simulate

#: The days the goal is stated for.
GOAL_DAYS = 54.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=10_000)
    p.add_argument("--days", type=float, default=5.0)
    p.add_argument("--seeds", default="1", help="as ftstate simulate's --seeds: 1-5 or 1,3")
    p.add_argument("--poisoned-nodes", type=int, default=0)
    p.add_argument("--bound-s", type=float, default=None,
                   help=f"fail when the CPU projected to {GOAL_DAYS:g} days is above this many seconds")
    args = p.parse_args(argv)
    failed = False
    for seed in parse_seeds(args.seeds):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        _, figures = simulate(SimulateOptions(members=args.members, days=args.days, seeds=(seed,),
                                              poisoned_nodes=args.poisoned_nodes))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        run = figures["seeds"][0]
        failures = len(run["failures"])
        per = cpu / max(failures, 1)
        projected = cpu * GOAL_DAYS / args.days if args.days else float("nan")
        ours, theirs = run["ftstate"], run["status_quo"]
        print(f"seed {seed}: {args.members} members, {args.days:g} days, {failures} failures: CPU {cpu:.1f} s, "
              f"wall {wall:.1f} s, {per:.2f} s of CPU a failure; {GOAL_DAYS:g} days at this rate ~{projected:.0f} s; "
              f"goodput ftstate {ours['goodput']:.5f}"
              + (f" (ended at {ours['ended_at'] / 3600:.1f} h)" if ours["ended_at"] is not None else "")
              + f", status quo {theirs['goodput']:.5f}", flush=True)
        if args.bound_s is not None and projected > args.bound_s:
            print(f"  above the bound: {projected:.0f} s > {args.bound_s:g} s", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
