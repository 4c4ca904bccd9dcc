"""Benchmark: the route of a failover's point-to-point resync, shared memory against gloo.

A resync always runs under a new group version (the failover formed one), so on the same-host
route the source makes new ``/dev/shm`` slots and the newcomer maps them for the first time;
over gloo the source sends straight from its committed buffer into the newcomer's reserved
staging. This runs one source and one newcomer as processes on this host, forms a new group
version before every round (as a failover does), and times one point-to-point transfer of
``--sizes`` MiB each way, in the same run, medians of ``--rounds``. The ratio shm / gloo is
what ``resync_shared_memory_min_mb`` (ftstate.core.config) is set from: below the size where it
crosses 1, the collective is the faster route for one newcomer.

    python benchmarks/resync_route.py [--sizes 64,256,512,1024] [--rounds 5]

The shared-memory side's own timers (new slots, the newcomer mapping them, copy and hash) are
printed beside it, as ``benchmarks/samehost_profile.py`` does for a sync.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.samehost_profile import _timed

MiB = 1024 * 1024
BUCKET_MB = 64


def _worker(idx: int, store: str, size: int, route: str, rounds: int, out: Any) -> None:
    import torch

    from benchmarks.transfer import make_weights
    from ftstate.transport import Receiver, Sender, create_communicator, samehost

    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)
    if route == "shm":
        for obj, name, label in [(samehost, "_new_slots", "new slots"), (samehost, "_mappings", "map slots"),
                                 (samehost, "_copy_hash", "copy+hash")]:
            _timed(acc, obj, name, label)
    sender, receiver = Sender(bucket_size=BUCKET_MB * MiB), Receiver()
    weights = make_weights(size) if idx == 0 else None
    rows: list[dict[str, float]] = []
    comm = None
    for rnd in range(rounds + 1):  # the first round warms up
        if comm is not None:
            comm.close()
        comm = create_communicator("gloo", store_addr=store, group="resync", version=rnd + 1, rank=idx,
                                   world_size=2, timeout_s=120)
        if idx == 1:  # a warm spare's staging, allocated and touched before the failover
            receiver.reserve(size * MiB + size * MiB // 64 + MiB, torch.device("cpu"))
        acc.clear()
        comm.barrier(timeout_s=120)
        t0 = time.perf_counter()
        if idx == 0 and route == "shm":
            samehost.send_to(sender, comm, 1, weights, weights_version=rnd + 1, timeout_s=300)
        elif idx == 0:
            sender.send_to(comm, 1, weights, weights_version=rnd + 1, timeout_s=300)
        elif route == "shm":
            samehost.receive(receiver, comm, 0, point_to_point=True, timeout_s=300)
        else:
            receiver.receive_from(comm, 0, timeout_s=300)
        wall = time.perf_counter() - t0
        comm.barrier(timeout_s=120)
        if rnd:
            rows.append({"wall": wall, **acc})
    comm.close()
    out.put((idx, {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0].keys() | acc.keys()}))


def _measure(size: int, route: str, rounds: int) -> dict[int, dict[str, float]]:
    from ftstate.transport import StoreServer

    ctx = mp.get_context("spawn")
    server = StoreServer("127.0.0.1")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, str(server.address), size, route, rounds, out), daemon=True)
             for i in range(2)]
    try:
        for p in procs:
            p.start()
        return dict(out.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,512,1024", help="MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"one source, one newcomer, a new group version every round; medians of {args.rounds}, ms")
    print(f"{'MiB':>6} | {'gloo':>7} {'shm':>7} {'shm/gloo':>8} | {'new slots':>9} {'map slots':>9} "
          f"{'copy+hash src/dst':>17}")
    for size in [int(s) for s in args.sizes.split(",")]:
        gloo = _measure(size, "gloo", args.rounds)
        shm = _measure(size, "shm", args.rounds)
        g, s = max(r["wall"] for r in gloo.values()), max(r["wall"] for r in shm.values())
        print(f"{size:>6} | {g * 1e3:>7.0f} {s * 1e3:>7.0f} {s / g:>8.2f} | {shm[0].get('new slots', 0) * 1e3:>9.0f} "
              f"{shm[1].get('map slots', 0) * 1e3:>9.0f} "
              f"{shm[0].get('copy+hash', 0) * 1e3:>8.0f}/{shm[1].get('copy+hash', 0) * 1e3:<8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
