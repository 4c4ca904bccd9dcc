"""Where a same-host transfer's time goes: each process's own timers, per phase, per sync.

Runs one sender and ``--receivers`` receivers as processes on this host (gloo on loopback,
as ``benchmarks/transfer.py`` does) and times, in every process, the phases of
:mod:`ftstate.transport.samehost` by wrapping its functions with timers (a profiling aid:
the wrapped names are private and may move): copying and hashing (``copy+hash``; on a
reader it includes waiting for the writer to fill what it copies next, shown apart as
``wait ready``), the sender waiting for its readers to release the slots (``wait free``:
at the end, the readers' tail), the manifest / offer / seal messages and the vote on the
collective, plus the process's CPU time and context switches. Medians over the measured
rounds, milliseconds per sync.

    python benchmarks/samehost_profile.py [--size 256] [--receivers 2] [--route shm|xnode] [--rounds 6]

``--route xnode`` plans every receiver on another node: the cross-node leg (chunks over gloo,
hashed as they land).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1024 * 1024
WARMUP = 2


def _timed(acc: dict[str, float], obj: Any, name: str, label: str) -> None:
    inner = getattr(obj, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def _worker(idx: int, store: str, args: dict[str, Any], out: Any) -> None:
    import torch

    from benchmarks.transfer import make_weights
    from ftstate.transport import Receiver, Sender, create_communicator, samehost
    from ftstate.transport import stream as base
    from ftstate.transport.routes import collective, nodecopy, signalling, slots

    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)
    for obj, name, label in [
        # each where it is called: the routes import them by name
        (slots, "copy_hash", "copy+hash"), (collective, "copy_hash", "copy+hash"), (nodecopy, "copy_hash", "copy+hash"),
        (collective, "hash_bucket", "hash"),
        (signalling.Follower, "_next", "wait ready"), (signalling.Waiter, "free", "wait free"),
        (signalling.Waiter, "hellos", "hellos"), (base.BroadcastStream, "send_message", "messages"),
        (base.BroadcastStream, "recv_message", "messages"), (base.BroadcastStream, "vote", "vote"),
    ]:
        _timed(acc, obj, name, label)
    world = args["receivers"] + 1
    comm = create_communicator("gloo", store_addr=store, group="profile", version=1, rank=idx, world_size=world,
                               timeout_s=60)
    sender, receiver = Sender(bucket_size=args["bucket_mb"] * MiB), Receiver()
    weights = make_weights(args["size"]) if idx == 0 else None
    same_host = () if args["route"] == "xnode" else range(1, world)
    rows: list[dict[str, float]] = []
    for rnd in range(WARMUP + args["rounds"]):
        acc.clear()
        comm.barrier(timeout_s=60)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if idx == 0:
            samehost.broadcast(sender, comm, weights, same_host=same_host, weights_version=rnd, timeout_s=120)
        else:
            samehost.receive(receiver, comm, 0, timeout_s=120)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        comm.barrier(timeout_s=60)
        if rnd >= WARMUP:
            rows.append({"sync": wall, **acc, "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                         "switches": (r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw) / 1000})
    comm.close()
    out.put((idx, {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0].keys() | acc.keys()}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256, help="MiB of weights")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--route", choices=("shm", "xnode"), default="shm")
    ap.add_argument("--rounds", type=int, default=6, help="measured syncs (after 2 warm-up ones)")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ns = ap.parse_args(argv)
    from ftstate.transport import StoreServer

    args = {"size": ns.size, "receivers": ns.receivers, "route": ns.route, "rounds": ns.rounds,
            "bucket_mb": ns.bucket_mb}
    server = StoreServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, str(server.address), args, out), daemon=True)
             for i in range(ns.receivers + 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
        server.close()
    cols = ["sync", "copy+hash", "wait ready", "hash", "wait free", "hellos", "messages", "vote", "cpu"]
    print(f"{ns.size} MiB, route {ns.route}, {ns.receivers} receivers, {ns.rounds} syncs: medians, ms per sync "
          "(switches: context switches per sync)")
    print(f"{'process':>10} | " + " ".join(f"{c:>10}" for c in cols) + f" | {'switches':>8}")
    for idx in sorted(got):
        row = got[idx]
        who = "sender" if idx == 0 else f"reader {idx}" if ns.route == "shm" else f"recv {idx}"
        print(f"{who:>10} | " + " ".join(f"{row.get(c, 0.0) * 1e3:>10.1f}" for c in cols)
              + f" | {row.get('switches', 0.0) * 1e3:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
