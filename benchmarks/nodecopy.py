"""The node copy (``staging: node``) against today's same-host route, in one run: time and memory.

One sender and ``--receivers`` receivers as processes on this host (gloo on loopback, as
``benchmarks/transfer.py``). Every round runs, in turn, a raw gloo broadcast of the same
bytes (the floor the transport is compared with), the same-host route with private staging
(``slots``: two recycled bucket slots, each receiver copies and hashes into its own buffer),
and the node copy (``node``: the sender writes one full-size copy, every receiver hashes it
in place). Medians over the measured rounds; ``node/slots`` is the median over rounds of the
slots time over the node-copy time (>= 1: the node copy is no slower).

Memory, per receiver, from ``/proc/self/smaps_rollup`` after the rounds: what holding the
committed version costs beyond the process itself (``private``: its own anonymous memory;
``pss``: its share of what it maps with others), for each route alone; and for the node in all (the
receivers' Pss plus what the node copy holds in ``/dev/shm``), against the weights' size.

    python benchmarks/nodecopy.py [--size 256] [--receivers 1,2,4] [--bucket-mb 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1024 * 1024
KINDS = ("raw", "slots", "node", "spare")


def smaps(pid: int | str = "self") -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes (Rss, Pss, Private_Dirty, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def private(m: dict[str, int]) -> int:
    """The memory of a :func:`smaps` reading that is the process's own: anonymous pages (heap,
    staging buffers, copy-on-write copies), not the shared-memory pages it maps, which count
    as private too while it happens to be their only mapper."""
    return m["Anonymous"]


def _worker(idx: int, store_addr: str, args: dict[str, Any], owner: int, results: Any) -> None:
    import torch

    from benchmarks.transfer import make_weights
    from ftstate.transport import Receiver, Sender, create_communicator, nodecopy, samehost

    torch.set_num_threads(1)
    receivers, size = args["receivers"], args["size"]
    world = receivers + 1
    comm = create_communicator("gloo", store_addr=store_addr, group="benchnode", version=1, rank=idx,
                               world_size=world, timeout_s=60)
    sender = Sender(bucket_size=int(args["bucket_mb"] * MiB))
    staged = {"slots": Receiver(), "node": Receiver(), "spare": Receiver()}
    weights = make_weights(size) if idx == 0 else None
    raw = torch.zeros(size * MiB, dtype=torch.uint8)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    fresh_written = spare_written = None  # the sender's node copies, one set per route
    for rnd in range(args["warmup"] + args["reps"]):
        for kind in KINDS:
            comm.barrier(timeout_s=60)
            t0 = time.perf_counter()
            if kind == "raw":
                comm._pg.broadcast(raw, 0).wait()
            elif idx == 0:
                report = samehost.broadcast(sender, comm, weights, same_host=range(1, world), require_shm=True,
                                            weights_version=rnd, timeout_s=300,
                                            node_copy_owner=owner if kind != "slots" else None,
                                            node_copy_spare=kind == "spare")
                assert report.ok and (report.node_copy is not None) == (kind != "slots"), report
                if kind == "spare":  # its copies are not the fresh route's: one writer keeps one kind
                    sender._node_copy, spare_written = fresh_written, sender._node_copy
                elif kind == "node":
                    fresh_written, sender._node_copy = sender._node_copy, spare_written
            else:
                assert (samehost.receive(staged[kind], comm, 0, timeout_s=300)._node is not None) == (kind != "slots")
            comm.barrier(timeout_s=60)
            if rnd >= args["warmup"]:
                times[kind].append(time.perf_counter() - t0)
    del raw
    memory: dict[str, int] = {}
    if idx > 0:  # what each route's committed state costs this process, alone
        del staged["slots"], staged["spare"]
        gc.collect()
        comm.barrier(timeout_s=60)
        with_node = smaps()
        comm.barrier(timeout_s=60)  # every receiver read it before any drops its mapping
        del staged["node"]
        gc.collect()
        comm.barrier(timeout_s=60)
        bare = smaps()
        comm.barrier(timeout_s=60)  # the sender's next transfers: slots only
        again = Receiver()
        for _ in range(2):  # a committed buffer and a spare, as after any second sync
            samehost.receive(again, comm, 0, timeout_s=300)
        with_slots = smaps()
        memory = {"node_private": private(with_node) - private(bare), "node_pss": with_node["Pss"] - bare["Pss"],
                  "slots_private": private(with_slots) - private(bare),
                  "slots_pss": with_slots["Pss"] - bare["Pss"]}
        comm.barrier(timeout_s=60)
    else:  # what each node-copy route leaves in /dev/shm between syncs
        sender._node_copy = fresh_written  # (the spare route's is spare_written)
        memory = {kind: sum((nodecopy.SHM_DIR / c.name).stat().st_size for c in (w.committed, w.spare) if c)
                  for kind, w in (("node_rest", fresh_written), ("spare_rest", spare_written))}
        for _ in range(4):
            comm.barrier(timeout_s=60)
        for rnd in range(2):
            samehost.broadcast(sender, comm, weights, same_host=range(1, world), require_shm=True,
                               weights_version=100 + rnd, timeout_s=300)
        comm.barrier(timeout_s=60)
    results.put((idx, times, memory))
    comm.close()


def run(size: int, receivers: int, args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.transfer import gather
    from ftstate.transport import StoreServer, nodecopy

    server = StoreServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cell = {**args, "size": size, "receivers": receivers}
    procs = [ctx.Process(target=_worker, args=(i, str(server.address), cell, os.getpid(), results), daemon=True)
             for i in range(receivers + 1)]
    try:
        got = gather(procs, results, join_s=30)
    finally:
        nodecopy.unlink_names(nodecopy.copies_of(os.getpid()))
        server.close()
    if got is None:
        raise SystemExit(1)
    times = got[0][0]
    mem = [got[i][1] for i in range(1, receivers + 1)]
    return {"times": times, "memory": mem, "at_rest": got[0][1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="weights size in MiB")
    parser.add_argument("--receivers", default="1,2,4", help="receiver counts, comma separated")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MiB (config bucket_size_mb)")
    parser.add_argument("--reps", type=int, default=3, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted rounds")
    ns = parser.parse_args(argv)
    args = {"bucket_mb": ns.bucket_mb, "reps": ns.reps, "warmup": ns.warmup}
    print(f"{ns.size} MiB of weights, {ns.bucket_mb:g} MiB buckets, {ns.reps} rounds (medians), "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'recv':>4} | {'raw s':>6} {'slots s':>7} {'node s':>6} {'spare s':>7} | {'node/slots':>10} "
          f"{'spare/slots':>11} {'spare/raw':>9} | {'slots priv':>10} {'node priv':>9} {'node pss':>8} | "
          f"{'rest node':>9} {'rest spare':>10} | x weights")
    for receivers in [int(r) for r in ns.receivers.split(",") if r]:
        out = run(ns.size, receivers, args)
        t = out["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = statistics.median(s / n for s, n in zip(t["slots"], t["node"], strict=True))
        spare = statistics.median(s / n for s, n in zip(t["slots"], t["spare"], strict=True))
        w = ns.size * MiB
        worst = {k: max(m[k] for m in out["memory"]) / w for k in out["memory"][0]}
        node_total = (sum(m["node_pss"] for m in out["memory"]) + 0) / w
        print(f"{receivers:>4} | {med['raw']:>6.3f} {med['slots']:>7.3f} {med['node']:>6.3f} {med['spare']:>7.3f} | "
              f"{ratio:>10.2f} {spare:>11.2f} {med['raw'] / med['spare']:>9.2f} | {worst['slots_private']:>10.2f} "
              f"{worst['node_private']:>9.2f} {worst['node_pss']:>8.2f} | {out['at_rest']['node_rest'] / w:>9.2f} "
              f"{out['at_rest']['spare_rest'] / w:>10.2f} | "
              f"node Pss of all receivers {node_total:.2f}")
    print("node: staging node, a new copy per sync; spare: node_copy_spare, the previous copy rewritten. "
          "x/slots: slots time / x time per round (>= 1: no slower than private staging); spare/raw: raw gloo "
          "broadcast / spare. priv / pss: a receiver's growth holding the committed version (slots: committed "
          "buffer + spare buffer; node: views into the node copy), worst receiver; rest node / rest spare: what "
          "each node-copy route keeps in /dev/shm between syncs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
