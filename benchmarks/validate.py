"""Benchmark: what checking a trainer's ``state_dict()`` costs before a sync, per tensor.

``check_state_dict`` reads each tensor's metadata (type, device, layout, dtype, names) and no
data, so its cost grows with the number of tensors, not their size: microseconds each. Rows:
``--counts`` states of two-element tensors, then 100 tensors of 1 MiB (the same time per
tensor: no byte is read).

    python benchmarks/validate.py [--counts 1000,20000] [--reps 5]

Medians of ``--reps``, milliseconds in all and microseconds per tensor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ftstate.transport import check_state_dict


def median_s(state: dict[str, torch.Tensor], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        check_state_dict(state, device_type="cpu", member="trainer-0")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,20000", help="tensors per state, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{'tensors':>8} {'elements':>9} {'ms':>8} {'us/tensor':>10}")
    shapes = [(int(c), 2) for c in args.counts.split(",")] + [(100, 1 << 18)]  # 1 MiB of float32 each
    for count, numel in shapes:
        state = {f"layers.{i}.w": torch.zeros(numel) for i in range(count)}
        s = median_s(state, args.reps)
        print(f"{count:>8} {numel:>9} {s * 1e3:>8.2f} {s * 1e6 / count:>10.2f}")


if __name__ == "__main__":
    main()
