"""A weight sync between two processes on one GPU, proved with nh64 on the device (issue 45).

Two processes share ``cuda:0`` (a trainer and a rollout; NCCL refuses two ranks on one GPU, CUDA
IPC does not). The trainer's weights are bf16 tensors shaped like a 7B model's layers (views into
one flat allocation), 1, 4 and 16 GiB. Measured in the same run, rounds interleaved:

* ``raw``: the raw device-to-device copy of the same bytes between the same two processes: the
  rollout opens the trainer's weights through CUDA IPC and copies them into its staging at once
  (one ``copy_``, one synchronize). The least any sync that lands the bytes costs.
* ``slots``: the same-host route's data path without a checksum: every bucket copied by the
  trainer into one of two CUDA IPC slots, announced, copied out by the rollout, released
  (:func:`ftstate.transport.routes.copying.device_copy_hash` with no hasher, the pipe standing in for
  the route's zmq signals).
* ``ftstate``: the same with the proof: the trainer hashes each bucket's source with nh64, the
  rollout hashes what it copied, and at the end the rollout's bucket and per-tensor digests and
  whole-state checksum are compared with the trainer's (a mismatch fails the run); the count of
  weight bytes either process copied to the host is read from
  :func:`ftstate.transport.checksum.host_copied_bytes` (goal 0).

The control plane (manifest, seal, vote on the communicator) is a few KiB and is left out: gloo
cannot carry a GPU's buffers between two processes of one GPU here and Ray is not installed on
the GPU machine. Beside them: nh64's throughput alone (the fused kernel, and the torch form)
against the device's copy bandwidth, and the held-weights proof of an engine on the GPU
(``state_checksum(engine, "nh64")``) against its update (a ``copy_`` of every tensor).

    python benchmarks/device_sync.py [--gib 1 4 16] [--bucket-mb 256] [--reps 3] [--json out.json]
        [--budget-s 240] [--device cuda:0]

``--device cpu`` rehearses the script where there is no GPU: the "device" is host memory shared
through the tests' stand-in (tests/integration/_device_standin.py) and counted as a device by the
checksum's choice of function; use small ``--gib``. Every figure is a ratio to a baseline of the
same run. Exit status 1 when a proof disagrees or a round fails: it never skips silently.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.device_buckets import model_shapes
from ftstate.transport import checksum, digest
from ftstate.transport.buckets import bucket_segments, plan_layout

MiB = 1 << 20
GiB = 1 << 30


def _memory(device: torch.device) -> Any:
    if device.type == "cuda":
        from ftstate.transport.cudaipc import CudaIpc

        return CudaIpc()
    from tests.integration._device_standin import HostStandIn

    checksum.DIGEST_DEVICES.add("cpu")  # the rehearsal's "device" memory is hashed as a GPU's would be
    return HostStandIn()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan(shapes: dict[str, tuple[int, ...]], bucket: int):
    entries, windows, total = plan_layout(((n, "bfloat16", s) for n, s in shapes.items()), bucket)
    return entries, bucket_segments(entries, windows), total


# -- the rollout process -----------------------------------------------------------------------


def _rollout(conn, device_name: str) -> None:
    """Answers the trainer's requests; every reply is small (times, digests, counts)."""
    from ftstate.transport.checksum import StreamHasher, combine
    from ftstate.transport.routes.copying import device_copy_hash, in_bucket

    device = torch.device(device_name)
    memory = _memory(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state: dict[str, Any] = {}
    try:
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "stop":
                break
            if kind == "setup":
                _, shapes, bucket, weights_handle, slot_handles = msg
                state.clear()
                _sync(device)
                entries, buckets, total = _plan(shapes, bucket)
                state.update(entries=entries, buckets=buckets, total=total,
                             weights=memory.open(weights_handle, device),
                             slots=[memory.open(h, device) for h in slot_handles],
                             staging=torch.empty(max(total, 1), dtype=torch.uint8, device=device))
                state["staging"].zero_()
                _sync(device)
                conn.send("ready")
            elif kind == "raw":
                state["staging"][: state["total"]].copy_(state["weights"][: state["total"]])
                _sync(device)
                conn.send("done")
            elif kind == "route":  # follow the trainer bucket by bucket
                prove = msg[1]
                entries, staging = state["entries"], state["staging"]
                hasher = StreamHasher(len(entries), receiving=True, function=digest.NAME,
                                      sizes=[e.nbytes for e in entries]) if prove else None
                copied0 = checksum.host_copied_bytes()
                digests = []
                for b in state["buckets"]:
                    k, slot = conn.recv()
                    assert k == b.index, (k, b.index)
                    device_copy_hash(b, staging[b.start : b.stop], in_bucket(state["slots"][slot]), hasher, memory)
                    if hasher is not None:
                        digests.append(hasher.bucket_digest(b))
                    conn.send(("released", k))
                own = None
                if hasher is not None:
                    sums = hasher.tensor_digests()
                    own = (digests, sums, combine((e.name, e.dtype, e.shape, h) for e, h in zip(entries, sums, strict=True)))
                conn.send(("end", own, checksum.host_copied_bytes() - copied0))
    except EOFError:
        pass
    finally:
        for t in state.get("slots", []) + ([state["weights"]] if "weights" in state else []):
            memory.release(t)


# -- the trainer (this process) ------------------------------------------------------------------


class Trainer:
    def __init__(self, device: torch.device, conn, memory) -> None:
        self.device, self.conn, self.memory = device, conn, memory
        self.flat: torch.Tensor | None = None
        self.slots: list[torch.Tensor] = []

    def setup(self, nbytes: int, bucket: int) -> dict[str, torch.Tensor]:
        self.teardown()
        self.shapes = model_shapes(nbytes, 4096, 11008)
        self.entries, self.buckets, self.total = _plan(self.shapes, bucket)
        self.flat = self.memory.alloc(self.total, self.device)
        g = torch.Generator(device=self.device).manual_seed(1)
        tensors = {}
        for e in self.entries:
            view = self.flat[e.offset : e.offset + e.nbytes].view(torch.bfloat16).view(e.shape)
            view.copy_(torch.randn(e.shape, generator=g, device=self.device, dtype=torch.bfloat16))
            tensors[e.name] = view
        self.tensors = tensors
        self.sources = [self.flat[e.offset : e.offset + e.nbytes] for e in self.entries]
        cap = max(b.nbytes for b in self.buckets)
        self.slots = [self.memory.alloc(cap, self.device) for _ in range(min(2, len(self.buckets)))]
        _sync(self.device)
        self.conn.send(("setup", self.shapes, bucket, self.memory.export(self.flat),
                        [self.memory.export(s) for s in self.slots]))
        assert self.conn.recv() == "ready"
        return tensors

    def teardown(self) -> None:
        for t in self.slots + ([self.flat] if self.flat is not None else []):
            self.memory.release(t)
        self.slots, self.flat = [], None

    def raw(self) -> float:
        t0 = time.perf_counter()
        self.conn.send(("raw",))
        assert self.conn.recv() == "done"
        return time.perf_counter() - t0

    def route(self, prove: bool) -> tuple[float, int, int]:
        """One sync through the slots; returns (seconds, host bytes here, host bytes there)."""
        from ftstate.transport.checksum import StreamHasher, combine
        from ftstate.transport.routes.copying import device_copy_hash, in_tensors

        hasher = StreamHasher(len(self.entries), function=digest.NAME,
                              sizes=[e.nbytes for e in self.entries]) if prove else None
        copied0 = checksum.host_copied_bytes()
        digests: list[int] = []
        busy: dict[int, int] = {}  # slot -> bucket not yet released
        t0 = time.perf_counter()
        self.conn.send(("route", prove))
        for b in self.buckets:
            slot = b.index % len(self.slots)
            if slot in busy:  # double buffering: the rollout released bucket k-2 before k reuses its slot
                kind, k = self.conn.recv()
                assert kind == "released" and k == busy.pop(slot), (kind, k)
            busy[slot] = b.index
            device_copy_hash(b, self.slots[slot][: b.nbytes], in_tensors(self.sources), hasher, self.memory,
                              hash_source=True, filled=lambda _n, k=b.index, s=slot: self.conn.send((k, s)))
            if hasher is not None:
                digests.append(hasher.bucket_digest(b))
        while busy:
            kind, k = self.conn.recv()
            assert kind == "released", kind
            busy = {s: i for s, i in busy.items() if i != k}
        kind, theirs, their_host = self.conn.recv()
        seconds = time.perf_counter() - t0
        assert kind == "end", kind
        if hasher is not None:
            sums = hasher.tensor_digests()
            mine = (digests, sums, combine((e.name, e.dtype, e.shape, h) for e, h in zip(self.entries, sums, strict=True)))
            if list(theirs[0]) != mine[0] or list(theirs[1]) != mine[1] or theirs[2] != mine[2]:
                raise SystemExit("FAILED: the rollout's nh64 proof differs from the trainer's")
            if checksum.format_checksum(mine[2], digest.NAME) != checksum.state_checksum(self.tensors, digest.NAME):
                raise SystemExit("FAILED: the sync's whole-state checksum differs from the state's own nh64")
        return seconds, checksum.host_copied_bytes() - copied0, their_host


def digest_throughput(device: torch.device, nbytes: int, reps: int) -> dict[str, Any]:
    """nh64 alone (fused kernel where there is one, and the torch form) against one device copy."""
    src = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, device=device).view(torch.uint8)
    dst = torch.empty_like(src)
    key = digest.public_key()
    k1, k2 = key.tables(device, nbytes // digest.CHUNK_BYTES + 1)

    def timed(fn) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    copy_s = timed(lambda: dst.copy_(src))
    fused_s = timed(lambda: digest.bytes_digest(src, key))
    torch_s = timed(lambda: digest._full_torch(src, 0, k1, k2))
    xxh3_s = None
    if device.type == "cpu":
        import xxhash

        xxh3_s = timed(lambda: xxhash.xxh3_64_intdigest(memoryview(src.numpy())))
    return {
        "bytes": nbytes,
        "copy_s": copy_s, "copy_GBps_moved": 2 * nbytes / copy_s / 1e9,
        "nh64_s": fused_s, "nh64_GBps": nbytes / fused_s / 1e9,
        "nh64_torch_s": torch_s, "nh64_torch_GBps": nbytes / torch_s / 1e9,
        "nh64_over_copy": copy_s / fused_s,  # > 1: hashing the bytes costs less than copying them once
        **({"xxh3_s": xxh3_s, "xxh3_GBps": nbytes / xxh3_s / 1e9} if xxh3_s else {}),
    }


def held_proof(trainer: Trainer, reps: int) -> dict[str, Any]:
    """A GPU engine's update (copy_ of every tensor from the trainer's) against its held-weights proof."""
    engine = {n: torch.empty_like(t) for n, t in trainer.tensors.items()}

    def update() -> None:
        for n, t in trainer.tensors.items():
            engine[n].copy_(t)

    update()
    _sync(trainer.device)
    ups, proofs = [], []
    want = checksum.state_checksum(trainer.tensors, digest.NAME)
    for _ in range(reps):
        t0 = time.perf_counter()
        update()
        _sync(trainer.device)
        t1 = time.perf_counter()
        got = checksum.state_checksum_like(engine, want)
        t2 = time.perf_counter()
        if got != want:
            raise SystemExit("FAILED: the engine's held-weights proof differs from the trainer's")
        ups.append(t1 - t0)
        proofs.append(t2 - t1)
    up, proof = statistics.median(ups), statistics.median(proofs)
    return {"update_s": up, "proof_s": proof, "proof_over_update": proof / up}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--digest-mb", type=float, default=1024, help="bytes hashed for the throughput alone")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no size after this many seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("FAILED: --device cuda but torch sees no GPU")
        torch.cuda.set_device(device)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "bucket_mb": args.bucket_mb, "reps": args.reps, "sizes": [], "skipped": [],
    }

    def write() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    result["digest"] = digest_throughput(device, int(args.digest_mb * MiB), args.reps)
    d = result["digest"]
    print(f"nh64 alone: {d['nh64_GBps']:.3g} GB/s (torch form "
          f"{d['nh64_torch_GBps']:.3g} GB/s); one device copy moves {d['copy_GBps_moved']:.3g} GB/s "
          f"(read + write); hashing / copying the same bytes: {1 / d['nh64_over_copy']:.2f}x the time", flush=True)
    write()
    memory = _memory(device)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_rollout, args=(child, args.device), daemon=True)
    proc.start()
    trainer = Trainer(device, conn, memory)
    try:
        for gib in args.gib:
            if time.perf_counter() - started > args.budget_s:
                result["skipped"].append(f"{gib:g} GiB: over the {args.budget_s:g} s budget")
                continue
            trainer.setup(int(gib * GiB), int(args.bucket_mb * MiB))
            trainer.raw()
            trainer.route(False)
            trainer.route(True)  # warm-up, and the first proof checked
            rounds: dict[str, list[float]] = {"raw": [], "slots": [], "ftstate": []}
            host = [0, 0]
            for _ in range(args.reps):
                rounds["raw"].append(trainer.raw())
                rounds["slots"].append(trainer.route(False)[0])
                s, mine, theirs = trainer.route(True)
                rounds["ftstate"].append(s)
                host = [max(host[0], mine), max(host[1], theirs)]
            med = {k: statistics.median(v) for k, v in rounds.items()}
            row = {
                "gib": gib, "bytes": trainer.total, "tensors": len(trainer.entries), "buckets": len(trainer.buckets),
                **{f"{k}_s": v for k, v in med.items()},
                "ftstate_over_raw": statistics.median(r / f for r, f in zip(rounds["raw"], rounds["ftstate"], strict=True)),
                "ftstate_over_slots": statistics.median(
                    s / f for s, f in zip(rounds["slots"], rounds["ftstate"], strict=True)),
                "raw_GBps": trainer.total / med["raw"] / 1e9, "ftstate_GBps": trainer.total / med["ftstate"] / 1e9,
                "host_bytes_trainer": host[0], "host_bytes_rollout": host[1],
                "held": held_proof(trainer, args.reps),
            }
            result["sizes"].append(row)
            print(f"{gib:g} GiB ({row['buckets']} buckets): raw {med['raw'] * 1e3:.1f} ms, slots "
                  f"{med['slots'] * 1e3:.1f} ms, ftstate {med['ftstate'] * 1e3:.1f} ms -> ftstate/raw "
                  f"{row['ftstate_over_raw']:.2f}x speed, vs slots {row['ftstate_over_slots']:.2f}x; host bytes "
                  f"{host}; held proof {row['held']['proof_over_update'] * 100:.1f} % of the update", flush=True)
            write()
            if host != [0, 0]:
                raise SystemExit(f"FAILED: weight bytes went to the host on a device sync: {host}")
    finally:
        trainer.teardown()
        conn.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    write()
    return 0 if proc.exitcode in (0, None) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
