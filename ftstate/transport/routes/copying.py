"""Copying a bucket into or out of a shared slot, hashing each piece while it is in cache.

Used by every route whose bytes pass through memory other processes map (shared-memory
slots, device slots, a node's relay): a writer copies a bucket in from its tensors and
tells its readers how far it got every :data:`STREAM` bytes; a reader copies each piece out
as soon as it is there. Hashing a :data:`PIECE` right after copying it reads it back from
cache, so verification costs no extra trip through memory.
"""

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
    """Copy bucket ``b``'s segments into ``dst`` (a view of the bucket's bytes) from ``src(s)``
    (segment ``s``'s bytes), in :data:`PIECE`-sized pieces, hashing each piece while it is in
    cache: a reader right after copying it, a writer right after telling its readers of it
    (below). No hasher: copy only.

    What is hashed: a reader hashes ``dst``, its own private copy (what it will commit). A
    writer into a shared slot passes ``hash_source``: it hashes the piece of *its source* it
    just read, never the slot, because the slot is writable by every process that mapped it
    (same uid) and anything written there after the copy would otherwise be hashed into the
    seal and so blessed; hashing the source makes every reader of such bytes see a mismatch.

    A writer streams: ``filled(n)`` is called once the first ``n`` bytes are in place, every
    :data:`STREAM` bytes and at the end (``n == b.nbytes``). A reader follows it:
    ``awaiting(n)`` returns once the writer has filled the first ``n`` bytes. ``damage``
    (chaos) flips the first byte copied before it is hashed, as a damaged segment would."""
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
            # A writer tells first and hashes after, so the readers copy (or gloo sends) these
            # bytes while it hashes them: its hashing (a keyed pass above all) is then off their
            # path. It hashes what it hashed before (its source, or its private buffer, which
            # nobody else writes), so the order changes no digest. A reader (no ``filled``)
            # hashes each piece right after copying it, while it is in cache.
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

    The copies are queued on the device and only :meth:`~DeviceMemory.synchronize` says they
    are done, so the whole bucket is copied, synchronized, and only then announced: a writer
    calls ``filled(b.nbytes)`` once per bucket, not every :data:`STREAM` bytes (a streamed
    announcement would need a synchronize per piece, which stalls the device's queue between
    pieces, and a device copies a bucket in less time than a reader takes to wake up to a
    signal). A reader waits for that one ``ready`` (``awaiting(b.nbytes)``), copies,
    synchronizes, and hashes; its caller releases the slot only after that.

    Hashing happens after the announcement (while the readers copy), on the device with nh64
    (the transfer's function when the sender's weights are on a GPU: no byte goes to the host),
    through the host with xxh3: a writer hashes its source (``hash_source``), so a slot damaged
    after the copy is caught by every reader; a reader hashes what it holds. ``damage`` as in
    :func:`copy_hash`."""
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
