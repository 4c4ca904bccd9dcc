"""Point-to-point resync of another node from a node copy, against today's resync and raw gloo, in one run.

Two processes on this host, gloo on loopback. Process 0 holds the committed version twice over:
as a rollout would (its tensors, sent by ``Sender.send_to``) and as its node's agent would (a
node copy in ``/dev/shm`` it owns, served by :func:`ftstate.transport.nodecopy.serve`).
Process 1 is the newcomer. Every round runs, in turn: ``raw`` (a bare ``ProcessGroupGloo``
send/recv of the same bytes, the floor), ``gloo`` (today's point-to-point resync from a
rollout: manifest, buckets, checksums, vote, into the newcomer's staging) and ``p2p`` (the
node copy served by its owner over one socket, received into the newcomer's staging and proven
by the whole-state checksum). ``--reserve``: the newcomer is a prewarmed spare, whose receiver
reserved (and touched) its staging before the transfer (``Receiver.reserve``, what the runtime's
spares do), for both routes; without it both receive into fresh memory. Median seconds over the measured rounds; ``gloo/p2p`` >= 1 means
the node copy's route is no slower than today's. The checksum each newcomer computed is
compared with the holder's every round.

    python benchmarks/nodecopy_p2p.py [--sizes 64,256] [--bucket-mb 64] [--reps 3] [--reserve]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.transfer import make_weights

MiB = 1024 * 1024
KINDS = ("raw", "gloo", "p2p")


def _node_copy(weights: dict[str, Any], bucket: int) -> Any:
    """The committed version as a node copy owned by this process (what the agent holds)."""
    from ftstate.transport import nodecopy
    from ftstate.transport.buckets import plan_layout
    from ftstate.transport.checksum import byte_view, dtype_name
    from ftstate.transport.manifest import encode_manifest, manifest_for

    entries, buckets, total = plan_layout([(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in weights.items()],
                                          bucket)
    manifest = manifest_for("bench-p2p", 1, 1, bucket, entries, buckets, total)
    node = nodecopy.NodeCopy.create("bench-p2p", group_version=1, owner=os.getpid(), weights_version=1,
                                    manifest=encode_manifest(manifest), data_bytes=total)
    for e in entries:
        node.data[e.offset : e.offset + e.nbytes].copy_(byte_view(weights[e.name]))
    return node


def _worker(idx: int, store_addr: str, args: dict[str, Any], pipe: Any, results: Any) -> None:
    import torch

    from ftstate.transport import Receiver, Sender, create_communicator, nodecopy, state_checksum

    torch.set_num_threads(1)
    bucket = int(args["bucket_mb"] * MiB)
    comm = create_communicator("gloo", store_addr=store_addr, group="bench-p2p", version=1, rank=idx,
                               world_size=2, timeout_s=120)
    pg = comm._pg
    sender = Sender(bucket_size=bucket)
    for size in args["sizes"]:
        weights = make_weights(size) if idx == 0 else None
        checksum = state_checksum(weights) if idx == 0 else None
        node = _node_copy(weights, bucket) if idx == 0 else None
        raw = torch.ones(size * MiB, dtype=torch.uint8) if idx == 0 else torch.zeros(size * MiB, dtype=torch.uint8)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        checks: list[bool] = []
        for rnd in range(args["warmup"] + args["reps"]):
            for kind in KINDS:
                newcomer = Receiver()
                if idx == 1 and args["reserve"]:  # a prewarmed spare: its staging reserved while it waited
                    newcomer.reserve(int(size * MiB * 1.02) + bucket, torch.device("cpu"))
                comm.barrier(timeout_s=60)
                t0 = time.perf_counter()
                if kind == "raw":
                    (pg.send([raw], 1, 0) if idx == 0 else pg.recv([raw], 0, 0)).wait()
                elif kind == "gloo":
                    if idx == 0:
                        sender.send_to(comm, 1, weights, weights_version=1, timeout_s=120)
                    else:
                        got = newcomer.receive_from(comm, 0, timeout_s=120)
                elif idx == 0:
                    served = nodecopy.serve(node.name, host="127.0.0.1", timeout_s=120)
                    pipe.send({**served, "name": node.name, "owner": os.getpid(), "checksum": checksum})
                    pipe.recv()  # the newcomer is done
                else:
                    served = pipe.recv()
                    got = nodecopy.fetch(newcomer, served, name=served["name"], group="bench-p2p",
                                         owner=served["owner"], weights_version=1, checksum=served["checksum"],
                                         timeout_s=120)
                    pipe.send(True)
                seconds = time.perf_counter() - t0
                if rnd >= args["warmup"]:
                    times[kind].append(seconds)
                    if idx == 1 and kind != "raw":
                        checks.append(got.state_checksum == args["expected"][size])
                comm.barrier(timeout_s=60)
        if node is not None:
            node.unlink()
            node.close()
        results.put((idx, size, times, checks))
    comm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="weights sizes in MiB, comma separated")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MiB (config bucket_size_mb)")
    parser.add_argument("--reps", type=int, default=3, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted rounds")
    parser.add_argument("--reserve", action="store_true", help="the newcomer reserved its staging first (a prewarmed spare)")
    ns = parser.parse_args(argv)
    from ftstate.transport import StoreServer, state_checksum

    sizes = [int(s) for s in ns.sizes.split(",") if s]
    args = {"sizes": sizes, "bucket_mb": ns.bucket_mb, "reps": ns.reps, "warmup": ns.warmup, "reserve": ns.reserve,
            "expected": {s: state_checksum(make_weights(s)) for s in sizes}}
    load_before = os.getloadavg()[0]
    server = StoreServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ends = ctx.Pipe()
    procs = [ctx.Process(target=_worker, args=(i, str(server.address), args, ends[i], results), daemon=True)
             for i in range(2)]
    for p in procs:
        p.start()
    cells: dict[int, dict[int, Any]] = {}
    try:
        for _ in range(2 * len(sizes)):
            idx, size, times, checks = results.get(timeout=900)
            cells.setdefault(size, {})[idx] = (times, checks)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    print(f"# load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}; bucket {ns.bucket_mb:g} MiB; "
          f"medians over {ns.reps} rounds, seconds; newcomer's staging {'reserved' if ns.reserve else 'fresh'}")
    print("| MiB | raw gloo | today (gloo p2p from a rollout) | node copy p2p | gloo/p2p | p2p/raw | checksums |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for size in sizes:
        times, checks = cells[size][1]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {size} | {med['raw']:.3f} | {med['gloo']:.3f} | {med['p2p']:.3f} | {med['gloo'] / med['p2p']:.2f} | "
              f"{med['p2p'] / med['raw']:.2f} | {'equal' if all(checks) else 'DIFFER'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
