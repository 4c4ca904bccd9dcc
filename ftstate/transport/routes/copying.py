"""Copying a bucket into or out of a shared slot, hashing each piece while it is in cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ftstate.transport.buckets import Bucket
from ftstate.transport.buckets import Segment as BucketSegment
from ftstate.transport.checksum import StreamHasher, host_bytes
from ftstate.transport.cudaipc import DeviceMemory
from ftstate.transport.hashing import feed_bucket
from ftstate.transport.hostmem import copy_bytes
from ftstate.transport.signals import Channel

#: Bytes copied then hashed at a time: small enough that the hash reads each piece back from
#: cache (the sizes measured: docs/benchmarks.md, "Piece size").
PIECE = 2 * 1024 * 1024

#: A writer tells its readers how far it has filled a slot every this many bytes, so they
#: copy a bucket out while it is still being written instead of after it (one bucket of
#: 256 MiB would otherwise be written, then read: nothing overlaps).
STREAM = 8 * 1024 * 1024


#: Test hook (the tamper test and the mutation check): called by a writer with each piece of a
#: slot right after copying it there, before it is hashed or announced -- the window in which a
#: stray or hostile write into the slot lands. None outside tests.
after_slot_copy: Callable[[torch.Tensor], None] | None = None


def copy_hash(b: Bucket, dst: torch.Tensor, src: Callable[[BucketSegment], torch.Tensor], hasher: StreamHasher | None,
               *, filled: Callable[[int], None] | None = None,
               awaiting: Callable[[int], None] | None = None, damage: bool = False,
               hash_source: bool = False) -> None:
    """Copy bucket ``b``'s segments into ``dst`` from ``src(s)`` in :data:`PIECE`-sized pieces,
    hashing each while it is in cache (no hasher: copy only)."""
    told = 0
    unhashed: list[tuple[int, memoryview]] = []  # a writer's pieces copied since it last told

    def hash_pieces() -> None:
        for tensor, piece in unhashed:
            hasher.feed(tensor, piece)  # type: ignore[union-attr]
        unhashed.clear()

    for s in b.segments:
        out = dst[s.bucket_offset : s.bucket_offset + s.length]
        into = src(s)
        mv = (host_bytes(into) if hash_source else host_bytes(out)) if hasher is not None else None
        for lo in range(0, s.length, PIECE):
            hi = min(lo + PIECE, s.length)
            if awaiting is not None:
                awaiting(s.bucket_offset + hi)
            copy_bytes(out[lo:hi], into[lo:hi])
            if after_slot_copy is not None:
                after_slot_copy(out[lo:hi])
            if damage:
                out[lo : lo + 1].bitwise_xor_(0xFF)
                damage = False
            if mv is not None:
                unhashed.append((s.tensor, mv[lo:hi]))
            if filled is not None and s.bucket_offset + hi - told >= STREAM:
                told = s.bucket_offset + hi
                filled(told)
            # A writer tells first and hashes after (its own unshared bytes, so no digest
            # changes), keeping its hashing off the readers' path; a reader hashes in cache.
            if filled is None or told == s.bucket_offset + hi:
                hash_pieces()
    if filled is not None and told < b.nbytes:
        filled(b.nbytes)
    hash_pieces()


def device_copy_hash(b: Bucket, dst: torch.Tensor, src: Callable[[BucketSegment], torch.Tensor],
                      hasher: StreamHasher | None, memory: DeviceMemory, *, hash_source: bool = False,
                      filled: Callable[[int], None] | None = None, awaiting: Callable[[int], None] | None = None,
                      damage: bool = False) -> None:
    """:func:`copy_hash` where the slot is in device memory (the writer's ``dst``, or the
    reader's ``src``), kept apart from it because nothing here can be hashed in cache.
    """
    if awaiting is not None:
        awaiting(b.nbytes)
    for s in b.segments:
        out = dst[s.bucket_offset : s.bucket_offset + s.length]
        out.copy_(src(s))
        if damage and s.length:
            out[:1].bitwise_xor_(0xFF)
            damage = False
    memory.synchronize(dst.device)
    if filled is not None:
        filled(b.nbytes)
    if hasher is not None and hash_source:
        for s in b.segments:
            hasher.feed_at(s.tensor, s.start, src(s))
    else:
        hash_bucket(b, dst, hasher)


def in_bucket(data: torch.Tensor) -> Callable[[BucketSegment], torch.Tensor]:
    """Segment ``s``'s bytes in ``data``, a view of the whole bucket's bytes."""
    return lambda s: data[s.bucket_offset : s.bucket_offset + s.length]


def in_tensors(sources: Sequence[torch.Tensor]) -> Callable[[BucketSegment], torch.Tensor]:
    """Segment ``s``'s bytes in the tensor it belongs to (each a flat uint8 view)."""
    return lambda s: sources[s.tensor][s.start : s.start + s.length]


def announcer(chan: Channel, readers: Sequence[int], bucket: int, slot: int) -> Callable[[int], None]:
    """What a writer calls as it fills ``slot`` with ``bucket``: tells every reader how far it got."""
    def filled(upto: int) -> None:
        for r in readers:
            chan.send({"kind": "ready", "bucket": bucket, "slot": slot, "upto": upto}, to=r)
    return filled


def hash_bucket(bucket: Bucket, data: torch.Tensor, hasher: StreamHasher | None) -> None:
    """Feed all of the bucket's bytes (``data``) to their tensors' hashers (none: nothing)."""
    if hasher is not None:
        feed_bucket(hasher, bucket, data)


def both(*calls: Callable[[int], None] | None) -> Callable[[int], None] | None:
    live = [c for c in calls if c is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def both(upto: int) -> None:
        for c in live:
            c(upto)
    return both


__all__ = ["PIECE", "STREAM", "after_slot_copy", "announcer", "both", "copy_hash", "device_copy_hash", "hash_bucket",
           "in_bucket", "in_tensors"]
