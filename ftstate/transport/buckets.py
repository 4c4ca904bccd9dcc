"""Bucket planning: where every tensor's bytes sit in the byte stream of one transfer."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Byte alignment of every tensor's offset in the stream (covers every dtype's itemsize
#: and a cache line).
ALIGNMENT = 64

#: Smallest bucket accepted (the tests use 64 KiB; production uses ``bucket_size_mb``).
MIN_BUCKET_SIZE = 1024

#: Tensors at least this large travel in buckets of their own, without packing.
DIRECT_MIN = 8 * 1024 * 1024

#: Size in bytes of one element of each dtype that can travel, by torch's name for it.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor in the stream: ``nbytes`` bytes at ``offset``, viewed as ``dtype``/``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes ``[start, start + length)`` of entry ``tensor``, at ``bucket_offset`` in the bucket."""

    tensor: int
    start: int
    length: int
    bucket_offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """Bytes ``[start, stop)`` of the stream and the tensor segments they carry."""

    index: int
    start: int
    stop: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    @property
    def single(self) -> Segment | None:
        """The one segment when the bucket is exactly one tensor's (or chunk's) bytes."""
        if len(self.segments) == 1 and self.segments[0].length == self.nbytes:
            return self.segments[0]
        return None


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense tensor of ``dtype`` and ``shape``; ``KeyError`` for an unknown dtype."""
    return DTYPE_ITEMSIZE[dtype] * math.prod(shape)


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def plan_layout(
    specs: Iterable[tuple[str, str, Sequence[int]]], bucket_size: int, *, direct_min: int | None = None
) -> tuple[tuple[TensorEntry, ...], tuple[tuple[int, int], ...], int]:
    """Offsets of ``(name, dtype, shape)`` tensors in the stream and the bucket windows.

    Returns ``(entries, buckets, total_bytes)``, windows at most ``bucket_size`` bytes (rules:
    docs/concepts.md). Raises ValueError for a bucket size below :data:`MIN_BUCKET_SIZE`, an
    unknown dtype, an empty or repeated name.
    """
    if bucket_size < MIN_BUCKET_SIZE:
        raise ValueError(f"bucket_size must be >= {MIN_BUCKET_SIZE} bytes, got {bucket_size}")
    direct = min(DIRECT_MIN, bucket_size) if direct_min is None else max(1, min(direct_min, bucket_size))
    rows: list[tuple[str, str, tuple[int, ...], int]] = []
    seen: set[str] = set()
    for name, dtype, shape in specs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} cannot travel (known: {sorted(DTYPE_ITEMSIZE)})")
        shape = tuple(int(d) for d in shape)
        rows.append((name, dtype, shape, nbytes_of(dtype, shape)))

    offsets = [0] * len(rows)  # empty tensors carry no bytes; offset 0 is valid for any dtype
    windows: list[tuple[int, int]] = []
    cursor = 0  # next free byte of the stream
    # large tensors first, each in buckets of its own
    for i, (_, _, _, size) in enumerate(rows):
        if size >= direct:
            offsets[i] = offset = align(cursor)
            windows.extend((s, min(s + bucket_size, offset + size)) for s in range(offset, offset + size, bucket_size))
            cursor = offset + size
    # then the small ones packed together, so they cost a few operations rather than one each
    open_start: int | None = None  # start of the open packed bucket
    for i, (_, _, _, size) in enumerate(rows):
        if 0 < size < direct:
            offset = align(cursor)
            if open_start is None or offset + size - open_start > bucket_size:
                if open_start is not None:
                    windows.append((open_start, cursor))
                open_start = offset
            offsets[i] = offset
            cursor = offset + size
    if open_start is not None:
        windows.append((open_start, cursor))
    entries = tuple(TensorEntry(name, dtype, shape, off, size) for (name, dtype, shape, size), off in zip(rows, offsets, strict=True))
    return entries, tuple(windows), cursor


def bucket_segments(entries: Sequence[TensorEntry], windows: Sequence[tuple[int, int]]) -> list[Bucket]:
    """For each window, the tensor segments it carries (entries and windows in stream order)."""
    buckets: list[Bucket] = []
    order = sorted((e.offset, i) for i, e in enumerate(entries) if e.nbytes)
    j = 0
    for k, (start, stop) in enumerate(windows):
        segments = []
        while j < len(order) and entries[order[j][1]].end <= start:
            j += 1
        i = j
        while i < len(order) and order[i][0] < stop:
            e = entries[order[i][1]]
            lo, hi = max(e.offset, start), min(e.end, stop)
            if hi > lo:
                segments.append(Segment(order[i][1], lo - e.offset, hi - lo, lo - start))
            i += 1
        buckets.append(Bucket(k, start, stop, tuple(segments)))
    return buckets


def bucket_bytes(bucket_size_mb: float) -> int:
    """``bucket_size_mb`` (the config's MiB) in bytes."""
    return int(bucket_size_mb * 1024 * 1024)


__all__ = [
    "ALIGNMENT",
    "DIRECT_MIN",
    "DTYPE_ITEMSIZE",
    "MIN_BUCKET_SIZE",
    "Bucket",
    "Segment",
    "TensorEntry",
    "align",
    "bucket_bytes",
    "bucket_segments",
    "nbytes_of",
    "plan_layout",
]
