"""What a rollout's staging copy costs on this host, against a buffer kept between syncs.

Two questions behind ``staging_spare`` and :func:`ftstate.transport.hostmem.copy_bytes`, each
answered as a ratio against a baseline measured in the same run:

* **fresh memory after a pause.** A rollout that lets go of its staging buffer after each load
  stages the next sync into fresh memory (``hostmem.empty_host``), seconds later. On a virtual
  machine with free page reporting the host takes freed pages back and backs them again at
  first touch. Rows: a buffer kept and rewritten (the baseline, what ``staging_spare: true``
  does); a fresh one right after the last was freed; a fresh one after ``--pause`` seconds.
* **torch's copy beside a busy core.** The same bytes copied in the transport's 2 MiB pieces
  with ``Tensor.copy_`` (torch's intra-op threads) and with ``copy_bytes`` (one ``memmove`` a
  piece, this thread), while one other process spins on a core (the trainer packing the next
  bucket, on a 2-core host).

    python benchmarks/host_copy.py [--mb 311] [--reps 7] [--pause 1.5]

Medians of ``--reps``, milliseconds; each ratio is against the row's baseline.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ftstate.transport.hostmem import copy_bytes, empty_host
from ftstate.transport.samehost import PIECE


def pieces(dst: torch.Tensor, src: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
    t0 = time.perf_counter()
    for lo in range(0, src.numel(), PIECE):
        hi = min(lo + PIECE, src.numel())
        copy(dst[lo:hi], src[lo:hi])
    return time.perf_counter() - t0


def fresh_rows(src: torch.Tensor, reps: int, pause: float) -> dict[str, float]:
    kept = empty_host(src.numel())
    pieces(kept, src, copy_bytes)  # its pages touched once, as after a first sync
    out: dict[str, list[float]] = {"kept buffer": [], "fresh, at once": [], f"fresh, after {pause:g} s": []}
    for _ in range(reps):
        time.sleep(pause)
        out["kept buffer"].append(pieces(kept, src, copy_bytes))
        buf = empty_host(src.numel())
        out["fresh, at once"].append(pieces(buf, src, copy_bytes))
        del buf
        time.sleep(pause)
        buf = empty_host(src.numel())
        out[f"fresh, after {pause:g} s"].append(pieces(buf, src, copy_bytes))
        del buf
    return {k: statistics.median(v) for k, v in out.items()}


def copy_rows(src: torch.Tensor, reps: int) -> dict[str, float]:
    dst = empty_host(src.numel())
    pieces(dst, src, copy_bytes)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        rows: dict[str, list[float]] = {"copy_bytes (memmove)": [], f"Tensor.copy_ ({torch.get_num_threads()} threads)": []}
        for _ in range(reps):
            rows["copy_bytes (memmove)"].append(pieces(dst, src, copy_bytes))
            rows[f"Tensor.copy_ ({torch.get_num_threads()} threads)"].append(
                pieces(dst, src, lambda d, s: d.copy_(s)))
    finally:
        spin.kill()
        spin.wait()
    return {k: statistics.median(v) for k, v in rows.items()}


def table(title: str, rows: dict[str, float]) -> None:
    base = next(iter(rows.values()))
    print(f"\n| {title} | ms | ratio |\n| --- | ---: | ---: |")
    for name, s in rows.items():
        print(f"| {name} | {s * 1e3:.0f} | {s / base:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--mb", type=float, default=311.0, help="bytes copied, in MB (the 300 MB Qwen2: 311)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pause", type=float, default=1.5, help="seconds between freeing a buffer and the next")
    args = ap.parse_args()
    src = torch.ones(int(args.mb * 1e6), dtype=torch.uint8)
    print(f"{src.numel() / 1e6:.0f} MB in {PIECE >> 20} MiB pieces, median of {args.reps}")
    table("staging buffer", fresh_rows(src, args.reps, args.pause))
    table("copy beside a busy core", copy_rows(src, args.reps))


if __name__ == "__main__":
    main()
