"""Weight-sync throughput: ftstate's bucketed, checksummed, atomically committed broadcast
against a raw ``ProcessGroupGloo.broadcast`` of the same bytes between the same processes.

    python benchmarks/transfer.py [--sizes 64,256,1024] [--receivers 1,2] [--bucket-mb 256] [--reps 3]
    python benchmarks/transfer.py --senders 1,2,4 [--sizes 256] [--receivers 2] [--reps 3]
    python benchmarks/transfer.py --security [--sizes 256] [--receivers 2] [--reps 5]

``--security``: the cost of ``security.authenticate`` and ``security.integrity: keyed``
(:mod:`ftstate.transport.auth`): every process switches together, round by round, between no
key (``open``), the run's key with xxh3 bucket digests (``auth``) and keyed BLAKE3 bucket
digests (``keyed``), on the same-host route (``shm``) and on the cross-node leg (``xnode``:
every receiver over gloo); ratios are per-round medians of time / the ``open`` round's time.
Beside them, the CPU seconds of one sync (every process together, all threads), whose ratio is
what the time's ratio tends to where the processes outnumber the free cores, and the CPU cost
of one copy, one xxh3 pass and one keyed BLAKE3 pass of the same bytes on one core, measured
first in the driver.

``--senders``: several trainer ranks (``trainer_workers``), each sending the part it owns
straight to every rollout at once (:mod:`ftstate.transport.shards`), the same total bytes
split evenly (whole tensors, dealt by size: pipeline style, no assembly copy); the ratio is
the single sender's time over the N-sender time, rounds interleaved in the same run.

Four kinds of round per cell, interleaved: ``raw`` (the gloo broadcast), ``ftstate`` (the
broadcast route, every byte over gloo), ``shm`` (the same-host route of
:mod:`ftstate.transport.samehost`: every receiver reads the buckets from /dev/shm, same
manifest, checksums, vote and commit) and ``xnode`` (that route with every receiver planned on
another node: the buckets go to each point to point over gloo, the cross-node leg of a mixed
transfer; between processes of one host here, so loopback stands in for the NIC) and, with 2
or more receivers, ``relay`` (every receiver planned on one other node: rank 1 is that node's
relay, gets the buckets point to point over gloo and writes them into its shared memory,
where the others read them; one copy crosses the "network" instead of one per receiver). The ceiling is measured in the same run on the
sender: ``memcpy``, one copy of the same bytes into a preallocated buffer (the least any
transfer that lands the bytes in another buffer costs), and ``xxh3``, one checksum pass.

One run spawns 1 + max(receivers) processes once (a trainer and its rollouts), forms one
gloo group version per receiver count and, for each size, alternates raw and ftstate
rounds. Each round is timed on the sender from a barrier before to a barrier after, so
both include delivery to every receiver; ftstate's time includes the manifest, packing,
hashing on both sides, the seal, the commit vote and the commit. Two warm-up rounds
(ftstate alternates two staging buffers) are not counted; the table shows the median of
the measured rounds, and the ratio is the median of the per-round ratios (each raw round
runs right before its ftstate round, so drift of a shared machine largely cancels). The weights are float32 tensors shaped like transformer layers
(two 2048-wide matrices and two norms per layer) filling the requested size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MiB = 1024 * 1024


def make_weights(size_mb: int) -> dict[str, Any]:
    """float32 tensors totalling ``size_mb`` MiB, shaped like transformer layers."""
    import torch

    gen = torch.Generator().manual_seed(size_mb)
    target = size_mb * MiB // 4  # elements
    shapes = [(2048, 2048), (5632, 2048), (2048,), (2048,)]
    out: dict[str, torch.Tensor] = {}
    used = 0
    layer = 0
    while used < target:
        for j, shape in enumerate(shapes):
            n = 1
            for d in shape:
                n *= d
            if used + n > target:
                shape, n = (target - used,), target - used
            if n == 0:
                break
            out[f"layers.{layer}.w{j}"] = torch.randn(shape, generator=gen)
            used += n
        layer += 1
    return out


def _opt(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _cpu_seconds() -> float:
    """CPU time (user + system) this process used so far, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(idx: int, store_addr: str, args: dict[str, Any], results: Any) -> None:
    import torch

    from ftstate.transport import Receiver, Sender, create_communicator, samehost
    from ftstate.transport.checksum import byte_view, tensor_checksum

    torch.set_num_threads(1)
    sender = Sender(bucket_size=int(args["bucket_mb"] * MiB))
    receiver = Receiver()
    for version, receivers in enumerate(args["receivers"], start=1):
        world = receivers + 1
        if idx >= world:
            continue
        comm = create_communicator(
            "gloo", store_addr=store_addr, group=f"bench{receivers}", version=version, rank=idx, world_size=world,
            timeout_s=60,
        )
        pg = comm._pg  # the raw baseline runs on the very same process group
        for size in args["sizes"]:
            weights = make_weights(size) if idx == 0 else None
            nbytes = size * MiB
            raw = torch.zeros(nbytes, dtype=torch.uint8)
            if idx == 0:
                raw.fill_(1)
            kinds = ("raw", "ftstate", "shm", "xnode", *(("relay",) if receivers >= 2 else ()))
            times: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[float]] = {k: [] for k in kinds}
            checks = []
            for rnd in range(args["warmup"] + args["reps"]):
                for kind in kinds:
                    comm.barrier(timeout_s=60)
                    c0 = _cpu_seconds()
                    t0 = time.perf_counter()
                    if kind == "raw":
                        pg.broadcast(raw, 0).wait()
                    elif kind == "xnode" and idx == 0:  # as if every receiver were on another node
                        report = samehost.broadcast(sender, comm, weights, same_host=(), weights_version=rnd,
                                                    timeout_s=120)
                        assert report.ok and set(report.routes.values()) == {"collective"}, report
                        checks.append(report.state_checksum)
                    elif kind == "xnode":
                        got = samehost.receive(receiver, comm, 0, timeout_s=120)
                        checks.append(got.state_checksum)
                    elif kind == "relay" and idx == 0:  # as if every receiver were on one other node
                        report = samehost.broadcast(sender, comm, weights, same_host=(),
                                                    relays={1: list(range(2, world))}, require_shm=True,
                                                    weights_version=rnd, timeout_s=120)
                        assert report.ok and report.routes == {
                            1: "collective", **{r: "relay" for r in range(2, world)}}, report
                        checks.append(report.state_checksum)
                    elif kind == "relay":
                        got = samehost.receive(receiver, comm, 0, timeout_s=120)
                        checks.append(got.state_checksum)
                    elif kind == "shm" and idx == 0:
                        report = samehost.broadcast(sender, comm, weights, same_host=range(1, world),
                                                    require_shm=True, weights_version=rnd, timeout_s=120)
                        assert report.ok and set(report.routes.values()) == {"shm"}, report
                        checks.append(report.state_checksum)
                    elif kind == "shm":
                        got = samehost.receive(receiver, comm, 0, timeout_s=120)
                        checks.append(got.state_checksum)
                    elif idx == 0:
                        report = sender.broadcast(comm, weights, weights_version=rnd, timeout_s=120)
                        assert report.ok, report
                        checks.append(report.state_checksum)
                    else:
                        got = receiver.receive_broadcast(comm, timeout_s=120)
                        checks.append(got.state_checksum)
                    comm.barrier(timeout_s=60)
                    if rnd >= args["warmup"]:
                        times[kind].append(time.perf_counter() - t0)
                        cpu[kind].append(_cpu_seconds() - c0)
            together = _together(comm, nbytes)
            hashing, memcpy = [], []
            if idx == 0:  # the ceiling: one copy of the same bytes, and one xxh3 pass, one core each
                for _ in range(3):
                    t0 = time.perf_counter()
                    for t in weights.values():
                        tensor_checksum(t)
                    hashing.append(time.perf_counter() - t0)
                flat = torch.empty(sum(t.numel() * t.element_size() for t in weights.values()), dtype=torch.uint8)
                flat.fill_(0)  # touched once: the timed copies pay no page faults, like a warm staging buffer
                for _ in range(3):
                    t0 = time.perf_counter()
                    at = 0
                    for t in weights.values():
                        b = byte_view(t)
                        flat[at : at + b.numel()].copy_(b)
                        at += b.numel()
                    memcpy.append(time.perf_counter() - t0)
                del flat
            results.put((idx, receivers, size, {"times": times, "cpu": cpu, "hash": hashing, "memcpy": memcpy,
                                                   "together": together},
                         checks))
            del weights, raw
        comm.close()
    results.put((idx, None, None, None, None))


def _together(comm: Any, nbytes: int, reps: int = 3) -> list[float]:
    """The same-host route's floor on this host: every process of the run copies and hashes
    ``nbytes`` of its own at the same moment (in the route's cache-sized pieces), as the
    sender and each reader do once per sync; this process's time for each of ``reps`` rounds."""
    import torch
    import xxhash

    from ftstate.transport.samehost import PIECE

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults in the timed copies
    view = memoryview(dst.numpy()).cast("B")
    out = []
    for _ in range(reps):
        comm.barrier(timeout_s=60)
        t0 = time.perf_counter()
        h = xxhash.xxh3_64()
        for lo in range(0, nbytes, PIECE):
            dst[lo : lo + PIECE].copy_(src[lo : lo + PIECE])
            h.update(view[lo : lo + PIECE])
        out.append(time.perf_counter() - t0)
    comm.barrier(timeout_s=60)
    return out


def _senders_worker(idx: int, store_addr: str, args: dict[str, Any], results: Any) -> None:
    """Ranks 0..max(senders)-1 are trainer ranks, the last ``receivers`` ranks the rollouts."""
    import torch

    from ftstate.core.ownership import Piece, plan_ownership
    from ftstate.transport import create_communicator
    from ftstate.transport.checksum import dtype_name
    from ftstate.transport.shards import receive_parts, send_part

    torch.set_num_threads(1)
    top, receivers = max(args["senders"]), args["receivers"][0]
    world = top + receivers
    peers = list(range(top, world))
    comm = create_communicator("gloo", store_addr=store_addr, group="senders", version=1, rank=idx,
                               world_size=world, timeout_s=120)
    # barriers on a group of their own: a gloo collective's tag counter and point-to-point
    # tags share one namespace, so a barrier beside the sends could match a send's message
    fence = create_communicator("gloo", store_addr=store_addr, group="senders-fence", version=1, rank=idx,
                                world_size=world, timeout_s=120)
    size = args["sizes"][0]
    weights = make_weights(size)  # every process builds the same tensors (each sends only its own)
    senders_cache: dict[int, Any] = {}
    receivers_cache: dict[int, Any] = {}
    times: dict[int, list[float]] = {n: [] for n in args["senders"]}
    checks: list[str] = []
    for rnd in range(args["warmup"] + args["reps"]):
        for n in args["senders"]:
            # deal the tensors over n ranks, largest first onto the least loaded
            load, owner = [0] * n, {}
            for name, t in sorted(weights.items(), key=lambda kv: -kv[1].numel()):
                r = load.index(min(load))
                owner[name] = r
                load[r] += t.numel() * t.element_size()
            ownership = plan_ownership([Piece(k, owner[k], dtype_name(t.dtype), tuple(t.shape))
                                        for k, t in weights.items()], ranks=n)
            fence.barrier(timeout_s=120)
            t0 = time.perf_counter()
            part = {k: t for k, t in weights.items() if owner.get(k) == idx} if idx < n else {}
            if part:  # a rank that owns nothing sends nothing (as in the runtime)
                send_part(senders_cache.setdefault(n, {}), comm, peers, part, weights_version=rnd,
                          timeout_s=300, bucket_size=int(args["bucket_mb"] * MiB))
            elif idx >= top:
                got = receive_parts(receivers_cache.setdefault(n, {}), comm, ownership, timeout_s=300)
                checks.append(got.state_checksum)
                del got
            fence.barrier(timeout_s=120)
            if rnd >= args["warmup"]:
                times[n].append(time.perf_counter() - t0)
    results.put((idx, times, checks))
    comm.close()
    fence.close()


def _next_result(results: Any, procs: list[Any]) -> tuple[Any, ...] | None:
    """The next result a worker process put on ``results``; None (said on stderr) once one of
    them exited with an error, instead of waiting for a result that will never come."""
    while True:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                print(f"benchmark failed: process(es) {dead} exited with an error", file=sys.stderr)
                return None


def gather(procs: list[Any], results: Any, *, join_s: float = 10.0) -> dict[int, tuple[Any, ...]] | None:
    """Start the worker processes ``procs`` and collect one result from each (keyed by its
    first item, the worker's index; the rest of the item as the value); None when one exited
    with an error. Every process is joined, or killed after ``join_s``, either way."""
    for p in procs:
        p.start()
    got: dict[int, tuple[Any, ...]] = {}
    try:
        while len(got) < len(procs):
            item = _next_result(results, procs)
            if item is None:
                return None
            got[item[0]] = tuple(item[1:])
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
    return got


def senders_main(args: dict[str, Any]) -> int:
    """``--senders``: see the module docstring."""
    from ftstate.transport import StoreServer

    server = StoreServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    nproc = max(args["senders"]) + args["receivers"][0]
    procs = [ctx.Process(target=_senders_worker, args=(i, str(server.address), args, results), daemon=True)
             for i in range(nproc)]
    try:
        got = gather(procs, results)
    finally:
        server.close()
    if got is None:
        return 1
    times = got[0][0]
    rollout_checks = [got[i][1] for i in range(max(args["senders"]), nproc)]
    agree = all(c == rollout_checks[0] for c in rollout_checks) and len(set(rollout_checks[0])) == 1
    size, base = args["sizes"][0], args["senders"][0]
    print(f"{size} MiB to {args['receivers'][0]} rollouts, bucket {args['bucket_mb']:g} MiB, {args['reps']} "
          f"measured rounds ({args['warmup']} warm-up), {os.cpu_count()} cores; seconds are medians on rank 0; "
          f"ratio = median over rounds of ({base} sender(s) time / N senders time)")
    print(f"{'senders':>7} | {'seconds':>8} {'GB/s out':>8} | {'ratio':>5}")
    for n in args["senders"]:
        sec = statistics.median(times[n])
        ratio = statistics.median(b / t for b, t in zip(times[base], times[n], strict=True))
        gb = size * MiB * args["receivers"][0] / 1e9
        print(f"{n:>7} | {sec:>8.3f} {gb / sec:>8.2f} | {ratio:>5.2f}")
    print(f"full-state checksums on every rollout, every round: {'match' if agree else 'MISMATCH'}")
    return 0 if agree else 1


SECURITY_MODES = ("open", "auth", "keyed")
SECURITY_ROUTES = ("shm", "xnode")


def _security_worker(idx: int, store_addr: str, args: dict[str, Any], results: Any) -> None:
    import torch

    from ftstate.transport import Receiver, Sender, auth, checksum, create_communicator, samehost, store

    torch.set_num_threads(1)
    sender = Sender(bucket_size=int(args["bucket_mb"] * MiB))
    receiver = Receiver()
    world = args["receivers"] + 1
    comm = create_communicator("gloo", store_addr=store_addr, group="benchsec", version=1, rank=idx,
                               world_size=world, timeout_s=60)
    size = args["sizes"][0]
    weights = make_weights(size) if idx == 0 else None
    kinds = [(route, mode) for route in SECURITY_ROUTES for mode in SECURITY_MODES]
    times: dict[str, list[float]] = {f"{r}-{m}": [] for r, m in kinds}
    cpu: dict[str, list[float]] = {f"{r}-{m}": [] for r, m in kinds}  # this process's CPU seconds, all threads
    checks = []
    for rnd in range(args["warmup"] + args["reps"]):
        for route, mode in kinds:
            # every process switches at the same point of the loop; a transfer reads the group's
            # current_version from the store (fencing), so rank 0 rewrites it as this mode writes it
            if mode == "open":
                auth.uninstall()
                checksum.use_integrity("xxh3")
            else:
                auth.install("bench", args["secret"])
                checksum.use_integrity("keyed" if mode == "keyed" else "xxh3")
            if idx == 0:
                comm._store.set("benchsec/current_version", store._signed("benchsec/current_version", b"1"))
            same_host = range(1, world) if route == "shm" else ()
            comm.barrier(timeout_s=60)
            t0, c0 = time.perf_counter(), time.process_time()
            if idx == 0:
                report = samehost.broadcast(sender, comm, weights, same_host=same_host, require_shm=route == "shm",
                                            weights_version=rnd, timeout_s=120)
                assert report.ok, report
                checks.append(report.state_checksum)
            else:
                checks.append(samehost.receive(receiver, comm, 0, timeout_s=120).state_checksum)
            spent = time.process_time() - c0
            comm.barrier(timeout_s=60)
            if rnd >= args["warmup"]:
                times[f"{route}-{mode}"].append(time.perf_counter() - t0)
                cpu[f"{route}-{mode}"].append(spent)
    forged = auth.drain_forged()
    assert not forged, forged  # every round's messages verified: the figures are of the happy path
    results.put((idx, times, checks, cpu))
    comm.close()


def _passes(nbytes: int, reps: int = 5) -> dict[str, float]:
    """CPU seconds (median of ``reps``) of one pass over ``nbytes`` on one core, in the pieces the
    same-host route uses: a copy, xxh3 of the copy, keyed BLAKE3 of the copy (what a keyed sync
    does instead of, or beside, xxh3 on every side)."""
    import blake3
    import torch
    import xxhash

    from ftstate.transport.samehost import PIECE

    torch.set_num_threads(1)  # as in the workers: one core, no idle OpenMP threads counted as CPU
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.full((nbytes,), 1, dtype=torch.uint8)  # written: no page faults in the timed copies
    view = memoryview(dst.numpy()).cast("B")
    key = os.urandom(32)

    def copy() -> None:
        for lo in range(0, nbytes, PIECE):
            dst[lo : lo + PIECE].copy_(src[lo : lo + PIECE])

    def xxh3() -> None:
        h = xxhash.xxh3_64()
        for lo in range(0, nbytes, PIECE):
            h.update(view[lo : lo + PIECE])

    def keyed() -> None:
        h = blake3.blake3(key=key)
        for lo in range(0, nbytes, PIECE):
            h.update(view[lo : lo + PIECE])

    out = {}
    for name, f in (("copy", copy), ("xxh3", xxh3), ("keyed", keyed)):
        took = []
        for _ in range(reps):
            c0 = time.process_time()
            f()
            took.append(time.process_time() - c0)
        out[name] = statistics.median(took)
    return out


def security_main(args: dict[str, Any]) -> int:
    """The cost of authentication and keyed integrity, in the same run (see the module docstring)."""
    from ftstate.transport import StoreServer

    passes = _passes(args["sizes"][0] * MiB)  # before the workers start: one core, nothing of ours beside it

    server = StoreServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    nproc = 1 + args["receivers"]
    procs = [ctx.Process(target=_security_worker, args=(i, str(server.address), args, results), daemon=True)
             for i in range(nproc)]
    for p in procs:
        p.start()
    per_rank: dict[int, Any] = {}
    try:
        while len(per_rank) < nproc:
            item = _next_result(results, procs)
            if item is None:
                return 1
            per_rank[item[0]] = item[1:]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        server.close()
    times, sender_checks, _ = per_rank[0]
    agree = all(per_rank[r][1] == sender_checks for r in per_rank)
    # CPU seconds of one sync, every process together, round by round: on a host with fewer free
    # cores than busy processes the sync's time tends to this total over the cores, so its ratio
    # is what a loaded machine's noisy wall-clock ratio converges to
    cpu = {k: [sum(per_rank[r][2][k][i] for r in per_rank) for i in range(len(times[k]))] for k in times}
    size = args["sizes"][0]
    print(f"{size} MiB, {args['receivers']} receivers, bucket {args['bucket_mb']:g} MiB, {args['reps']} measured "
          f"rounds ({args['warmup']} warm-up), load average before {args['load']:.2f}; seconds are medians, "
          "ratios the per-round median of time / the open round's time")
    print(f"{'route':>6} | {'open s':>7} | {'auth s':>7} {'auth/open':>9} | {'keyed s':>7} {'keyed/open':>10} "
          f"{'keyed/auth':>10} | {'cpu s open':>10} {'auth':>5} {'keyed':>5} {'keyed/auth':>10} | checksums")
    for route in SECURITY_ROUTES:
        o, a, k = (times[f"{route}-{m}"] for m in SECURITY_MODES)
        ra = statistics.median(x / y for x, y in zip(a, o, strict=True))
        rk = statistics.median(x / y for x, y in zip(k, o, strict=True))
        rka = statistics.median(x / y for x, y in zip(k, a, strict=True))
        co, ca, ck = (cpu[f"{route}-{m}"] for m in SECURITY_MODES)
        cka = statistics.median(x / y for x, y in zip(ck, ca, strict=True))
        print(f"{route:>6} | {statistics.median(o):>7.3f} | {statistics.median(a):>7.3f} {ra:>9.3f} | "
              f"{statistics.median(k):>7.3f} {rk:>10.3f} {rka:>10.3f} | {statistics.median(co):>10.3f} "
              f"{statistics.median(ca):>5.3f} {statistics.median(ck):>5.3f} {cka:>10.3f} | "
              f"{'match' if agree else 'MISMATCH'}")
    r = args["receivers"]
    extra = (1 + r) * passes["keyed"] - r * passes["xxh3"]
    print(f"one pass of {size} MiB on one core, CPU s: copy {passes['copy']:.3f}, xxh3 {passes['xxh3']:.3f} "
          f"({size * MiB / passes['xxh3'] / 1e9:.1f} GB/s), keyed BLAKE3 {passes['keyed']:.3f} "
          f"({size * MiB / passes['keyed'] / 1e9:.1f} GB/s); a keyed sync hashes {1 + r} keyed passes for {r} xxh3 "
          f"passes: {extra:.3f} CPU s more")
    print("goal (issue 25): auth/open < 1.03, keyed/open < 1.15 at 256 MiB")
    return 0 if agree else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="weights sizes in MiB, comma separated")
    parser.add_argument("--receivers", default="1,2", help="receiver counts, comma separated")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size in MiB (config bucket_size_mb)")
    parser.add_argument("--reps", type=int, default=3, help="measured rounds per cell")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted rounds per cell")
    parser.add_argument("--senders", default="", help="trainer-rank counts, comma separated (multi-sender mode)")
    parser.add_argument("--security", action="store_true",
                        help="measure security.authenticate and integrity: keyed against no key, same run")
    ns = parser.parse_args(argv)
    if ns.security:
        return security_main({
            "sizes": [int(ns.sizes.split(",")[0]) if ns.sizes != "64,256,1024" else 256],
            "receivers": int(ns.receivers.split(",")[-1]),
            "bucket_mb": ns.bucket_mb, "reps": ns.reps, "warmup": ns.warmup,
            "secret": os.urandom(32), "load": os.getloadavg()[0],
        })
    if ns.senders:
        return senders_main({
            "senders": [int(n) for n in ns.senders.split(",") if n],
            "sizes": [int(ns.sizes.split(",")[0])],
            "receivers": [int(ns.receivers.split(",")[-1])],
            "bucket_mb": ns.bucket_mb, "reps": ns.reps, "warmup": ns.warmup,
        })
    args = {
        "sizes": [int(s) for s in ns.sizes.split(",") if s],
        "receivers": [int(r) for r in ns.receivers.split(",") if r],
        "bucket_mb": ns.bucket_mb,
        "reps": ns.reps,
        "warmup": ns.warmup,
    }
    from ftstate.transport import StoreServer

    load_before = os.getloadavg()[0]
    server = StoreServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    nproc = 1 + max(args["receivers"])
    procs = [ctx.Process(target=_worker, args=(i, str(server.address), args, results), daemon=True) for i in range(nproc)]
    for p in procs:
        p.start()
    cells: dict[tuple[int, int], dict[int, Any]] = {}
    done = 0
    try:
        while done < nproc:
            item = _next_result(results, procs)
            if item is None:
                return 1
            idx, receivers, size, times, checks = item
            if receivers is None:
                done += 1
                continue
            cells.setdefault((receivers, size), {})[idx] = (times, checks)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        server.close()

    cores = os.cpu_count() or 1
    print(
        f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}: anything else running "
        "on the machine shows up as noise in both columns"
    )
    print(
        f"bucket size {ns.bucket_mb:g} MiB, {ns.reps} measured rounds, {ns.warmup} warm-up, {cores} cores; "
        "seconds are medians; ratio = median over rounds of raw time / ftstate time "
        "(ftstate throughput / raw throughput)"
    )
    header = (
        f"{'size':>8} {'recv':>4} | {'raw s':>7} {'raw GB/s':>8} {'raw cpu':>7} | {'ftstate s':>9} {'ft GB/s':>7} "
        f"{'ft cpu':>6} | {'ratio':>5} | {'shm s':>6} {'shm GB/s':>8} {'shm cpu':>7} | {'shm/raw':>7} | "
        f"{'memcpy s':>8} {'xxh3 s':>6} {'shm/memcpy':>10} | {'together s':>10} {'shm/tog':>7} | {'xnode/raw':>9} | {'relay/raw':>9} "
        f"{'relay/xnode':>11} | checksums"
    )
    print(header)
    print("-" * len(header))
    worst = None
    worst_shm = None
    worst_xnode = None
    for (receivers, size), per_rank in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        data, sender_checks = per_rank[0]
        times = data["times"]
        agree = all(per_rank[r][1] == sender_checks for r in per_rank)
        raw = statistics.median(times["raw"])
        ft = statistics.median(times["ftstate"])
        # CPU busy across all processes of the round, as a share of the machine's cores
        load = {
            kind: statistics.median(
                sum(per_rank[r][0]["cpu"][kind][i] for r in per_rank) / (times[kind][i] * cores)
                for i in range(len(times[kind]))
            )
            for kind in times
        }
        gb = size * MiB / 1e9
        # ftstate throughput / raw throughput, paired round by round (a raw round and an
        # ftstate round run back to back) so that the machine's drift cancels out
        ratio = statistics.median(r / f for r, f in zip(times["raw"], times["ftstate"], strict=True))
        shm = statistics.median(times["shm"])
        shm_ratio = statistics.median(r / f for r, f in zip(times["raw"], times["shm"], strict=True))
        xnode_ratio = statistics.median(r / f for r, f in zip(times["raw"], times["xnode"], strict=True))
        relay_ratio = (statistics.median(r / f for r, f in zip(times["raw"], times["relay"], strict=True))
                       if times.get("relay") else None)
        relay_xnode = (statistics.median(x / f for x, f in zip(times["xnode"], times["relay"], strict=True))
                       if times.get("relay") else None)
        memcpy = statistics.median(data["memcpy"])
        # all processes at once: a round lasts as long as its slowest process
        together = statistics.median(max(per_rank[r][0]["together"][i] for r in per_rank)
                                     for i in range(len(data["together"])))
        if size >= 256:
            worst = ratio if worst is None else min(worst, ratio)
            worst_shm = shm_ratio if worst_shm is None else min(worst_shm, shm_ratio)
            worst_xnode = xnode_ratio if worst_xnode is None else min(worst_xnode, xnode_ratio)
        print(
            f"{size:>5} MiB {receivers:>4} | {raw:>7.3f} {gb / raw:>8.2f} {load['raw']:>7.0%} | {ft:>9.3f} "
            f"{gb / ft:>7.2f} {load['ftstate']:>6.0%} | {ratio:>5.2f} | {shm:>6.3f} {gb / shm:>8.2f} "
            f"{load['shm']:>7.0%} | {shm_ratio:>7.2f} | {memcpy:>8.3f} {statistics.median(data['hash']):>6.3f} "
            f"{memcpy / shm:>10.2f} | {together:>10.3f} {together / shm:>7.2f} | {xnode_ratio:>9.2f} | {_opt(relay_ratio):>9} {_opt(relay_xnode):>11} | "
            f"{'match' if agree else 'MISMATCH'}"
        )
    if worst is not None:
        print(f"worst ratio at >= 256 MiB: broadcast route {worst:.2f} (goal >= 0.85), same-host route "
              f"{worst_shm:.2f} (goal >= 2), cross-node leg {worst_xnode:.2f} (goal >= 0.85)")
    print(
        "raw cpu / ft cpu / shm cpu: CPU time of all processes over the round's wall time and all cores; "
        "shm/raw: raw time / same-host time per round; memcpy s / xxh3 s: one copy / one checksum pass of the "
        "same bytes on one core (the same-host route does one of each on every side); shm/memcpy: the share of "
        "that ceiling reached; together s: every process of the run (sender and receivers) copying and hashing "
        "the same bytes of its own at once, in the route's pieces: the same-host route's floor on this host, "
        "with its cores and memory bandwidth shared as in a sync; shm/tog: the share of that floor reached; "
        "xnode/raw: raw time / the same route with every receiver planned on another node "
        "(each gets the buckets point to point over gloo: the cross-node leg, on loopback here); relay/raw: "
        "raw time / the same with every receiver on one other node, rank 1 relaying through that node's "
        "shared memory (one copy over gloo); relay/xnode: xnode time / relay time (>1: relaying is faster "
        "than a copy per receiver; needs 2+ receivers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
