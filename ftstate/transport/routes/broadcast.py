"""The broadcast route: every bucket is one collective operation on the transfer's stream."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ftstate.transport import hostmem
from ftstate.transport.base import Pending
from ftstate.transport.buckets import Bucket
from ftstate.transport.hashing import Hashing
from ftstate.transport.manifest import Manifest, Seal
from ftstate.transport.routes.base import Buffer, Plan, ReceiveRoute, SendRoute, Transfer
from ftstate.transport.stream import Stream
from ftstate.transport.weights import WINDOW


class BroadcastSend(SendRoute):
    """The sender's side: pack (or slice), post, hash while on the wire."""

    interrupted = "interrupted"

    def __init__(self, stream: Stream, plan: Plan, buffer: Buffer, on_failure: Callable[[], None]) -> None:
        self.stream = stream
        self.plan = plan
        self.buffer = buffer
        self.on_failure = on_failure
        self.routes = {}
        c = plan.committed
        # the receiver's staging layout is the stream: a committed state resent goes as slices of it
        self.flat = c.staged_as(plan.entries) if c is not None else None
        self.known: Seal | None = plan.known_seal() if self.flat is not None else None
        self.hashing = Hashing(plan.manifest) if self.known is None else None
        # the bucket last packed into each packing buffer, and its operation
        self.slots: list[tuple[int, Pending] | None] = [None, None]
        self.packed = 0
        self.inflight: deque[Pending] = deque()  # at most WINDOW buckets on the wire

    def pack(self, b: Bucket) -> tuple[torch.Tensor, int | None]:
        """The bucket's bytes on the communicator's device, and the packing slot used: a slice
        of the tensor (or of a committed staging buffer) when it is one, else the small tensors
        copied into the packing buffer whose last send completed."""
        device = self.stream.comm.device
        sources = self.plan.sources
        one = b.single
        if self.flat is not None and self.flat.device == device:
            return self.flat[b.start : b.stop], None
        if one is not None and sources[one.tensor].device == device:
            return sources[one.tensor][one.start : one.start + one.length], None
        slot, self.packed = self.packed % 2, self.packed + 1
        previous, self.slots[slot] = self.slots[slot], None
        if previous is not None:  # double buffering: never overwrite bytes still on the wire
            index, pending = previous  # or not yet hashed
            pending.wait()
            if self.hashing is not None:
                self.hashing.wait_for(index)
        data = self.buffer(slot, b.nbytes, device)
        cursor = 0
        for s in b.segments:
            if s.bucket_offset > cursor:
                data[cursor : s.bucket_offset].zero_()
            hostmem.copy_bytes(data[s.bucket_offset : s.bucket_offset + s.length],
                               sources[s.tensor][s.start : s.start + s.length])
            cursor = s.bucket_offset + s.length
        return data, slot

    def write(self, b: Bucket, at: Transfer) -> None:
        data, slot = self.pack(b)  # the buckets already on the wire overlap this packing
        pending = self.stream.post(data, at.stage)
        self.inflight.append(pending)
        if slot is not None:
            self.slots[slot] = (b.index, pending)
        if self.hashing is not None:
            self.hashing.submit(b, data)  # hashed while on the wire: the checksums only go out in the seal
        while len(self.inflight) >= WINDOW:
            self.inflight.popleft().wait()
            at.bucket_done()

    def drain(self, at: Transfer) -> None:
        while self.inflight:
            at.stage = f"bucket {at.done + 1}/{at.buckets}"
            self.inflight.popleft().wait()
            at.bucket_done()

    def checksums(self, at: Transfer) -> tuple[list[int], list[int]]:
        if self.hashing is not None:
            at.stage = "checksums"
            return self.hashing.finish(), self.hashing.hasher.tensor_digests()
        assert self.known is not None
        return list(self.known.bucket_checksums), list(self.known.tensor_checksums)

    def failed(self, at: Transfer, exc: BaseException) -> None:
        self.on_failure()
        if self.hashing is not None:
            self.hashing.cancel()


class BroadcastReceive(ReceiveRoute):
    """A receiver's side: every bucket received straight into the staging buffer, up to
    :data:`WINDOW` posted ahead, each hashed in the helper thread while the next arrive."""

    interrupted = "interrupted"

    def __init__(self, stream: Stream, damage: Callable[[bool], bool]) -> None:
        self.stream = stream
        self.damage = damage
        self.buckets: list[Bucket] = []
        self.hashing: Hashing | None = None
        self.posted: deque[Pending] = deque()

    def begin(self, manifest: Manifest, buckets: list[Bucket], at: Transfer) -> None:
        self.buckets = buckets
        self.hashing = Hashing(manifest, receiving=True)

    def open(self, flat: torch.Tensor, at: Transfer) -> None:
        n = len(self.buckets)
        for first in self.buckets[:WINDOW]:
            self.posted.append(self.stream.post(flat[first.start : first.stop], f"bucket {first.index + 1}/{n}"))

    def read(self, b: Bucket, flat: torch.Tensor, at: Transfer) -> None:
        buckets, n = self.buckets, len(self.buckets)
        self.posted.popleft().wait()
        if b.index + WINDOW < n:
            following = buckets[b.index + WINDOW]
            self.posted.append(self.stream.post(flat[following.start : following.stop], at.stage))
        data = flat[b.start : b.stop]
        if self.damage(bool(b.segments)):  # chaos: one flipped byte, after it arrived and before it is hashed
            at_byte = b.segments[0].bucket_offset
            data[at_byte : at_byte + 1].bitwise_xor_(0xFF)
        assert self.hashing is not None
        self.hashing.submit(b, data)  # hashed while the next buckets are on the wire
        at.bucket_done()

    def digests(self, at: Transfer) -> list[int]:
        assert self.hashing is not None
        return self.hashing.finish()

    def tensor_sums(self, seal: Seal) -> list[int]:
        assert self.hashing is not None
        return self.hashing.hasher.tensor_digests(seal.tensor_checksums)

    def failed(self, at: Transfer, exc: BaseException) -> None:
        if self.hashing is not None:
            self.hashing.cancel()


__all__ = ["BroadcastReceive", "BroadcastSend"]
