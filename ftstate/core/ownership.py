"""Ownership, checked in the controller: which trainer rank holds which tensor, or which slice, in one weights
version (a whole tensor or a :class:`Shard`, torch's ``chunk`` rule). Pure, so bad ownership fails the sync
before a byte is sent (docs/concepts.md, "Several trainer ranks")."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ftstate.core.errors import OwnershipError


@dataclasses.dataclass(frozen=True)
class Shard:
    """Slice ``index`` of ``count`` of a full tensor along ``dim``; ``tensor``: the slice this rank holds."""

    tensor: Any
    dim: int
    index: int
    count: int

    def __post_init__(self) -> None:
        for field in ("dim", "index", "count"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Shard.{field} must be an int, got {value!r}")
        if self.count < 1:
            raise ValueError(f"Shard.count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"Shard.index must be in [0, {self.count}), got {self.index}")
        ndim = getattr(self.tensor, "ndim", None)
        if ndim is not None and not 0 <= self.dim < max(int(ndim), 1):
            raise ValueError(f"Shard.dim must be in [0, {ndim}) for a {ndim}-d slice, got {self.dim}")


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one rank returned under one name, without the data: ``dim`` None for a whole tensor."""

    name: str
    rank: int
    dtype: str
    shape: tuple[int, ...]
    dim: int | None = None
    index: int = 0
    count: int = 1

    def record(self) -> list[Any]:
        """A msgpack-friendly form (what a trainer host reports to the controller)."""
        return [self.name, self.rank, self.dtype, list(self.shape), self.dim, self.index, self.count]

    @classmethod
    def from_record(cls, rec: Sequence[Any]) -> Piece:
        name, rank, dtype, shape, dim, index, count = rec
        return cls(name, int(rank), str(dtype), tuple(int(x) for x in shape),
                   None if dim is None else int(dim), int(index), int(count))


@dataclasses.dataclass(frozen=True)
class Part:
    """One rank's slice of one tensor: rows ``[start, start + length)`` along the tensor's dim."""

    rank: int
    index: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class TensorOwnership:
    """A full tensor: shape, dtype, the dim it is cut along (None: owned whole) and its parts in order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim: int | None
    parts: tuple[Part, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.parts)


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Every tensor of one weights version and who sends which part, in name order."""

    tensors: tuple[TensorOwnership, ...]

    def senders(self) -> tuple[int, ...]:
        """Ranks that own something (a rank that returned nothing sends nothing)."""
        return tuple(sorted({p.rank for t in self.tensors for p in t.parts}))

    def record(self) -> dict[str, list[Any]]:
        """name -> [dtype, shape, dim, [[rank, index, start, length], ...]] (msgpack-friendly)."""
        return {t.name: [t.dtype, list(t.shape), t.dim, [[p.rank, p.index, p.start, p.length] for p in t.parts]]
                for t in self.tensors}

    @classmethod
    def from_record(cls, rec: Mapping[str, Sequence[Any]]) -> Ownership:
        return cls(tuple(
            TensorOwnership(name, str(dtype), tuple(int(x) for x in shape), None if dim is None else int(dim),
                            tuple(Part(*(int(v) for v in p)) for p in parts))
            for name, (dtype, shape, dim, parts) in sorted(rec.items())))


def slice_length(full: int, index: int, count: int) -> int:
    """Length of slice ``index`` of ``count`` along a dim of size ``full`` (torch's chunk rule)."""
    size = -(-full // count)
    return max(0, min(size, full - index * size))


def piece_key(name: str, dim: int | None, index: int) -> str:
    """The name a piece travels under in its rank's part (unique per rank and slice)."""
    return name if dim is None else f"{name}#{index}"


def plan_ownership(pieces: Iterable[Piece], *, ranks: int) -> Ownership:
    """Check what ``ranks`` trainer ranks returned and say who sends what. Raises OwnershipError, naming the
    tensor and ranks, for a tensor or slice owned twice, a missing slice, slices that disagree or break the
    slicing rule, or nothing owned at all."""
    by_name: dict[str, list[Piece]] = {}
    for p in pieces:
        if not 0 <= p.rank < ranks:
            raise OwnershipError(p.name, [p.rank], f"rank {p.rank} is not a trainer rank (0..{ranks - 1})")
        by_name.setdefault(p.name, []).append(p)
    if not by_name:
        raise OwnershipError("", list(range(ranks)), "no trainer rank returned any tensor")
    return Ownership(tuple(_one(name, ps) for name, ps in sorted(by_name.items())))


def _one(name: str, ps: list[Piece]) -> TensorOwnership:
    ranks = sorted({p.rank for p in ps})
    whole = [p for p in ps if p.dim is None]
    if whole:
        if len(ps) > 1:
            how = "whole by ranks " + ", ".join(str(p.rank) for p in whole)
            sliced = [p for p in ps if p.dim is not None]
            if sliced:
                how += " and sliced by ranks " + ", ".join(str(p.rank) for p in sliced)
            raise OwnershipError(name, ranks, f"owned twice ({how})")
        p = whole[0]
        return TensorOwnership(name, p.dtype, p.shape, None, (Part(p.rank, 0, 0, p.shape[0] if p.shape else 1),))
    first = ps[0]
    for p in ps[1:]:
        for field in ("count", "dim", "dtype"):
            if getattr(p, field) != getattr(first, field):
                raise OwnershipError(name, [first.rank, p.rank],
                                     f"slices disagree on {field}: rank {first.rank} says {getattr(first, field)}, "
                                     f"rank {p.rank} says {getattr(p, field)}")
        if len(p.shape) != len(first.shape) or any(
                a != b for d, (a, b) in enumerate(zip(p.shape, first.shape, strict=True)) if d != first.dim):
            raise OwnershipError(name, [first.rank, p.rank],
                                 f"slices along dim {first.dim} disagree on the other dims: rank {first.rank} has "
                                 f"{list(first.shape)}, rank {p.rank} has {list(p.shape)}")
    dim, count = first.dim, first.count
    assert dim is not None
    if dim >= len(first.shape):
        raise OwnershipError(name, [first.rank], f"dim {dim} is out of range for a {len(first.shape)}-d slice")
    seen: dict[int, Piece] = {}
    for p in ps:
        if p.index in seen:
            raise OwnershipError(name, [seen[p.index].rank, p.rank],
                                 f"slice {p.index} of {count} along dim {dim} is owned twice "
                                 f"(ranks {seen[p.index].rank} and {p.rank}): overlap")
        seen[p.index] = p
    missing = [i for i in range(count) if i not in seen]
    if missing:
        raise OwnershipError(name, ranks, f"slices {missing} of {count} along dim {dim} are owned by no rank: gap")
    full = sum(seen[i].shape[dim] for i in range(count))
    parts, start = [], 0
    for i in range(count):
        p = seen[i]
        want = slice_length(full, i, count)
        if p.shape[dim] != want or want == 0:
            raise OwnershipError(name, [p.rank],
                                 f"slice {i} of {count} along dim {dim} has length {p.shape[dim]}, expected {want} "
                                 f"(full size {full}: slices of ceil({full}/{count}), the last ones shorter, none empty)")
        parts.append(Part(p.rank, i, start, want))
        start += want
    shape = tuple(full if d == dim else n for d, n in enumerate(first.shape))
    return TensorOwnership(name, first.dtype, shape, dim, tuple(parts))


__all__ = ["Ownership", "Part", "Piece", "Shard", "TensorOwnership", "piece_key", "plan_ownership", "slice_length"]
