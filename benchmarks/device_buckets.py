"""A GPU engine's load from the host copy through two buckets: device memory and time (issue 24, item 3).

``ftstate.transport.devicebuckets.load_by_buckets`` moves a committed version from host
memory (the node copy, or a private buffer) into an engine's weights on the device in parts of
at most ``bucket_size_mb``, through two device buffers; the promise is at most two buckets of
device memory beyond the engine's weights (two of the larger of the bucket and the largest
tensor), and nothing after the load. This measures both sides of that trade-off on a real
device, for each weights size, host memory kind (pageable, as a ``/dev/shm`` node copy is, and
pinned) and bucket size:

* **memory**: the peak of ``torch.cuda.max_memory_allocated`` beyond the engine's weights during
  the load, as a multiple of the bucket and against the bound; what torch's caching allocator
  still holds reserved after the load (it keeps freed blocks for reuse unless
  ``torch.cuda.empty_cache()`` is called);
* **time**: against a baseline measured in the same run, on the same host tensors and the same
  engine weights: a plain ``weights[n].copy_(host[n])`` per tensor (no bucket, nothing staged on
  the device).

The weights are bf16 tensors shaped like a 7B model's layers (``--hidden`` 4096, ``--mlp``
11008: attention matrices of 32 MiB, MLP matrices of 86 MiB, norms of 8 KiB), as many as fit in
each size. Every configuration is timed ``--reps`` times, interleaved (median reported), after
one untimed warm-up load whose result is checked bit for bit against the host tensors.

    python benchmarks/device_buckets.py [--gib 1 4] [--bucket-mb 64 256 1024] [--reps 3]
        [--device cuda:0] [--json out.json] [--budget-s 80]

``--device cpu`` rehearses the script where there is no GPU: the "device" is host memory, the
peak is counted by a stand-in bucket memory (what ``load_by_buckets`` allocated), and pinned
memory is skipped. Configurations that would start after ``--budget-s`` seconds are skipped and
listed as such.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ftstate.transport.devicebuckets import load_by_buckets

MiB = 1 << 20
GiB = 1 << 30


def layer_shapes(hidden: int, mlp: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (hidden, hidden)),
        ("self_attn.v_proj.weight", (hidden, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("post_attention_layernorm.weight", (hidden,)),
        ("mlp.gate_proj.weight", (mlp, hidden)),
        ("mlp.up_proj.weight", (mlp, hidden)),
        ("mlp.down_proj.weight", (hidden, mlp)),
    ]


def model_shapes(nbytes: int, hidden: int, mlp: int) -> dict[str, tuple[int, ...]]:
    """Layers' tensors in order, as many as fit in ``nbytes`` of bf16 (at least one)."""
    shapes: dict[str, tuple[int, ...]] = {}
    total = 0
    layer = 0
    while True:
        for name, shape in layer_shapes(hidden, mlp):
            n = 2 * int(torch.Size(shape).numel())
            if total + n > nbytes and shapes:
                return shapes
            shapes[f"model.layers.{layer}.{name}"] = shape
            total += n
        layer += 1


class _Block(bytearray):
    """A bytearray that takes a weakref (for the CPU stand-in's count of live bytes)."""


class CountingMemory:
    """The CPU rehearsal's stand-in device memory: the bytes of bucket buffers alive, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        block = _Block(nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(block, self._freed, nbytes)
        return torch.frombuffer(block, dtype=torch.uint8)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def synchronize(self, device: torch.device) -> None:
        pass


class Meter:
    """Device memory around one load: torch's allocator on CUDA, the counting stand-in on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.memory = None if self.cuda else CountingMemory()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # every load starts from the weights alone, nothing cached beside them
            self.alloc0 = torch.cuda.memory_allocated(self.device)
            self.reserved0 = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.memory.peak = self.memory.live = 0

    def stop(self) -> dict[str, int]:
        if not self.cuda:
            return {"peak_extra": self.memory.peak, "reserved_peak_extra": self.memory.peak,
                    "left_allocated": self.memory.live, "reserved_after_extra": self.memory.live}
        torch.cuda.synchronize(self.device)
        return {
            "peak_extra": torch.cuda.max_memory_allocated(self.device) - self.alloc0,
            "left_allocated": torch.cuda.memory_allocated(self.device) - self.alloc0,
            "reserved_peak_extra": torch.cuda.max_memory_reserved(self.device) - self.reserved0,
            "reserved_after_extra": torch.cuda.memory_reserved(self.device) - self.reserved0,
        }


def make_host(shapes: dict[str, tuple[int, ...]], device: torch.device, pinned: bool,
              like: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """bf16 host tensors: random (made on the device when there is one, which is fast), or a
    pinned copy of ``like``."""
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator(device=device).manual_seed(0)
    for i, (name, shape) in enumerate(shapes.items()):
        t = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pinned)
        if like is not None:
            t.copy_(like[name])
        elif device.type == "cuda":
            t.copy_(torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(generator=g))
        else:
            t.copy_((torch.arange(t.numel(), dtype=torch.int32).remainder(251) + i % 7).to(torch.bfloat16).view(shape))
        out[name] = t
    return out


def verify(weights: dict[str, torch.Tensor], host: dict[str, torch.Tensor], scratch: torch.Tensor | None) -> bool:
    """The engine's weights equal the host tensors, bit for bit (read back through a reused
    pinned buffer on CUDA: fresh pageable memory per check would cost more than the loads)."""
    for n, t in host.items():
        w = weights[n].reshape(-1)
        if scratch is None:
            got = w.cpu()
        else:
            got = scratch[: w.numel()]
            got.copy_(w)
        if not torch.equal(got.view(torch.int16), t.reshape(-1).view(torch.int16)):
            return False
    return True


def load_once(path: int | None, host: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], meter: Meter,
              device: torch.device) -> tuple[float, dict[str, int], dict[str, Any]]:
    """One load (``path``: a bucket in bytes, or None for the per-tensor baseline): seconds,
    memory figures, and load_by_buckets' own report."""
    for w in weights.values():
        w.zero_()
    meter.start()
    t0 = time.perf_counter()
    got: dict[str, Any] = {}
    if path is None:
        for n, t in host.items():
            weights[n].copy_(t)
    else:
        def load(part: dict[str, torch.Tensor], first: bool, last: bool) -> None:
            for n, t in part.items():
                weights[n].copy_(t)

        got = load_by_buckets(host, device=device, bucket_bytes=path, load=load, memory=meter.memory)
    meter.sync()
    seconds = time.perf_counter() - t0
    return seconds, meter.stop(), got


def run_size(gib: float, args: argparse.Namespace, device: torch.device, started: float,
             rows: list[dict[str, Any]], skipped: list[str], dump: Callable[[], None]) -> None:
    shapes = model_shapes(int(gib * GiB), args.hidden, args.mlp)
    nbytes = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    largest = max(2 * int(torch.Size(s).numel()) for s in shapes.values())
    t0 = time.perf_counter()
    pageable = make_host(shapes, device, pinned=False, like=None)
    kinds: dict[str, dict[str, torch.Tensor]] = {"pageable": pageable}
    if device.type == "cuda":
        kinds["pinned"] = make_host(shapes, device, pinned=True, like=pageable)
    else:
        skipped.append(f"{gib:g} GiB pinned: no CUDA device (pinned host memory needs one)")
    weights = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    print(f"\n{gib:g} GiB asked: {len(shapes)} bf16 tensors, {nbytes / GiB:.3f} GiB, largest "
          f"{largest / MiB:.1f} MiB; host copies and engine weights made in {time.perf_counter() - t0:.1f} s",
          flush=True)
    paths: list[int | None] = [None, *(int(mb * MiB) for mb in args.bucket_mb)]
    meter = Meter(device)
    scratch = None
    if device.type == "cuda":
        scratch = torch.empty(largest // 2, dtype=torch.bfloat16, pin_memory=True)
    for kind, host in kinds.items():
        if time.perf_counter() - started > args.budget_s:
            skipped.append(f"{gib:g} GiB {kind}: over the {args.budget_s:g} s budget")
            continue
        times: dict[int | None, list[float]] = {p: [] for p in paths}
        mem: dict[int | None, dict[str, int]] = {}
        report: dict[int | None, dict[str, Any]] = {}
        ok: dict[int | None, bool] = {}
        for p in paths:  # warm-up, checked bit for bit
            _, mem[p], report[p] = load_once(p, host, weights, meter, device)
            ok[p] = verify(weights, host, scratch)
        for _ in range(args.reps):  # interleaved, so drift touches every path alike
            for p in paths:
                s, m, _ = load_once(p, host, weights, meter, device)
                times[p].append(s)
                mem[p] = {k: max(v, m[k]) for k, v in mem[p].items()}
        base = statistics.median(times[None])
        for p in paths:
            med = statistics.median(times[p])
            bound = 0 if p is None else 2 * max(p, largest)
            rows.append({
                "gib_asked": gib, "bytes": nbytes, "tensors": len(shapes), "largest_tensor_bytes": largest,
                "host_memory": kind, "path": "per-tensor copy_ (baseline)" if p is None else "load_by_buckets",
                "bucket_bytes": p, "parts": report[p].get("buckets"), "buffer_bytes": report[p].get("bucket_bytes"),
                "reported_device_bytes": report[p].get("device_bytes"),
                "seconds_median": med, "seconds": times[p], "GBps": nbytes / med / 1e9, "ratio_to_baseline": med / base,
                "peak_extra_bytes": mem[p]["peak_extra"],
                "peak_extra_over_bucket": None if p is None else mem[p]["peak_extra"] / p,
                "bound_bytes": bound,
                "within_bound": None if p is None else mem[p]["peak_extra"] <= bound + 2 * 512,
                "left_allocated_bytes": mem[p]["left_allocated"],
                "reserved_peak_extra_bytes": mem[p]["reserved_peak_extra"],
                "reserved_after_extra_bytes": mem[p]["reserved_after_extra"],
                "bit_exact": ok[p],
            })
        dump()  # what is measured so far survives a run stopped at its time limit
        print(f"  {kind}: done at {time.perf_counter() - started:.1f} s", flush=True)
    del weights, kinds, pageable, scratch
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| weights | host memory | path | bucket | parts | ms (median) | GB/s | x baseline | peak beyond "
           "weights | x bucket | <= 2 x max(bucket, largest) | cached after | bit-exact |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in rows:
        b = r["bucket_bytes"]
        bucket = "-" if b is None else f"{b / MiB:g} MiB"
        times = "-" if b is None else f"{r['peak_extra_over_bucket']:.2f}"
        bound = "-" if b is None else ("yes" if r["within_bound"] else "NO")
        exact = "yes" if r["bit_exact"] else "NO"
        out.append(
            f"| {r['bytes'] / GiB:.2f} GiB | {r['host_memory']} | {r['path']} | {bucket} | {r['parts'] or '-'} | "
            f"{r['seconds_median'] * 1e3:.1f} | {r['GBps']:.1f} | {r['ratio_to_baseline']:.2f}x | "
            f"{r['peak_extra_bytes'] / MiB:.1f} MiB | {times} | {bound} | "
            f"{r['reserved_after_extra_bytes'] / MiB:.0f} MiB | {exact} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0], help="weights sizes, GiB of bf16")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 256.0, 1024.0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=11008)
    ap.add_argument("--budget-s", type=float, default=80.0, help="start no configuration after this many seconds")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    device = torch.device(args.device)
    result: dict[str, Any] = {"benchmark": "device_buckets", "args": vars(args), "rows": [], "skipped": [],
                              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "torch": torch.__version__, "python": platform.python_version()}

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if device.type == "cuda" and not torch.cuda.is_available():
        result["skipped"].append("no CUDA device here (torch.cuda.is_available() is false); --device cpu rehearses")
        print(f"skipped: {result['skipped'][0]}")
    else:
        if device.type == "cuda":
            result["device_name"] = torch.cuda.get_device_name(device)
            print(f"{result['device_name']}, torch {torch.__version__}")
        started = time.perf_counter()
        for gib in args.gib:
            if time.perf_counter() - started > args.budget_s:
                result["skipped"].append(f"{gib:g} GiB: over the {args.budget_s:g} s budget")
                continue
            run_size(gib, args, device, started, result["rows"], result["skipped"], dump)
        result["seconds"] = time.perf_counter() - started
        print("\n" + table(result["rows"]))
        for s in result["skipped"]:
            print(f"skipped: {s}")
        print(f"\n{result['seconds']:.1f} s in all")
    dump()
    bad = [r for r in result["rows"] if not r["bit_exact"] or r["within_bound"] is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
