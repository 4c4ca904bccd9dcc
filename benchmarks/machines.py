"""Benchmark: the cost of ftstate's machines against bare ``transitions`` machines, same run.

For n = 1, 100, 1,000 and 10,000 worker machines it measures
- build: seconds to create n machines (ftstate: StateMachine with deadline arming and audit;
  baseline: models added to one ``transitions`` AsyncMachine with its stock ``add_model``),
- transitions per second, driving every machine READY -> SYNCING -> READY,
- memory per machine (tracemalloc, bytes allocated per model),
and prints each ftstate figure as a ratio to the baseline. The audit trail is kept in memory
with ``keep=False`` (records made and dropped) so file I/O does not dominate; building
each record is still paid on every transition.

    python benchmarks/machines.py [--sizes 1,100,1000,10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import tracemalloc

from transitions.extensions.asyncio import AsyncMachine

from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.deadline import ManualClock
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec

TO_READY = ("join", "joined", "resync", "verified", "admit")


class _BareModel:
    pass


def bare_machine():
    spec = get_spec("worker")
    return AsyncMachine(
        model=None,
        states=list(spec.states),
        transitions=[{"trigger": t.trigger, "source": t.source, "dest": t.dest} for t in spec.transitions],
        initial=spec.initial,
        auto_transitions=False,
        queued=False,
    )


async def run_bare(n: int, rounds: int) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    machine = bare_machine()
    models = [_BareModel() for _ in range(n)]
    for m in models:
        machine.add_model(m)
    build = time.perf_counter() - t0
    mem = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    for m in models:
        for trig in TO_READY:
            await m.trigger(trig)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for m in models:
            await m.trigger("sync")
            await m.trigger("committed")
    tps = 2 * rounds * n / (time.perf_counter() - t0)
    return {"build_s": build, "tps": tps, "bytes": mem}


async def run_ftstate(n: int, rounds: int) -> dict[str, float]:
    spec = get_spec("worker")
    cfg = RuntimeConfig.from_dict({}, environ={})
    clock = ManualClock()
    audit = AuditTrail(keep=False)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    machines = [StateMachine(spec, member=f"rollout-{i}", role="rollout", rank=i, config=cfg, clock=clock, audit=audit)
                for i in range(n)]
    build = time.perf_counter() - t0
    mem = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    for m in machines:
        for trig in TO_READY:
            await m.fire(trig)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for m in machines:
            await m.fire("sync")
            await m.fire("committed")
    tps = 2 * rounds * n / (time.perf_counter() - t0)
    for m in machines:
        m.close()
    return {"build_s": build, "tps": tps, "bytes": mem}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,100,1000,10000")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    header = (f"{'machines':>9} | {'build ftstate s':>15} {'build bare s':>12} {'ratio':>6} | "
              f"{'ftstate tr/s':>12} {'bare tr/s':>10} {'ratio':>6} | {'ftstate B/m':>11} {'bare B/m':>9} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    results = {}
    await run_bare(10, 1)  # warm-up: first-use costs (imports, spec load) out of the figures
    await run_ftstate(10, 1)
    for n in sizes:
        rounds = max(1, args.rounds if n >= 100 else 200)
        bare = await run_bare(n, rounds)
        ft = await run_ftstate(n, rounds)
        results[n] = (ft, bare)
        print(
            f"{n:>9} | {ft['build_s']:>15.4f} {bare['build_s']:>12.4f} {ft['build_s'] / bare['build_s']:>6.2f} | "
            f"{ft['tps']:>12.0f} {bare['tps']:>10.0f} {ft['tps'] / bare['tps']:>6.2f} | "
            f"{ft['bytes']:>11.0f} {bare['bytes']:>9.0f} {ft['bytes'] / bare['bytes']:>6.2f}"
        )
    if 1000 in results and 10000 in results:
        ft_growth = results[10000][0]["build_s"] / results[1000][0]["build_s"]
        bare_growth = results[10000][1]["build_s"] / results[1000][1]["build_s"]
        print(f"\nbuild time growth 1,000 -> 10,000 machines: ftstate x{ft_growth:.1f} (linear = x10), "
              f"bare transitions x{bare_growth:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
