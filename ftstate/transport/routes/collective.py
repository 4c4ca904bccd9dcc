"""The collective route of a same-host transfer: buckets point to point, chunk by chunk."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ftstate.core.errors import ManifestError, SharedMemoryUnavailable, TransportError
from ftstate.transport.base import Pending
from ftstate.transport.buckets import Bucket
from ftstate.transport.checksum import StreamHasher
from ftstate.transport.hashing import feed_bucket, hasher_for
from ftstate.transport.manifest import Seal
from ftstate.transport.offer import NET_TAG, Offer, decode_offer, encode_offer
from ftstate.transport.routes.base import Buffer, HashedReceive, Plan, SendRoute, Transfer
from ftstate.transport.routes.copying import copy_hash, hash_bucket, in_tensors
from ftstate.transport.routes.signalling import Waiter
from ftstate.transport.shm import SHM_DIR
from ftstate.transport.signals import Channel
from ftstate.transport.stream import Stream, side_stream
from ftstate.transport.weights import WINDOW


def chunks(buckets: Sequence[Bucket], chunk: int) -> list[tuple[Bucket, int, int]]:
    """Every bucket cut into ``(bucket, lo, hi)`` messages of ``chunk`` bytes, in transfer order
    (the n-th is tagged ``NET_TAG + n`` by both sides)."""
    return [(b, lo, min(lo + chunk, b.nbytes)) for b in buckets for lo in range(0, b.nbytes, chunk)]


class NetSends:
    """The sender's messages to its collective ranks: each chunk is posted once it is filled."""

    def __init__(self, stream: Stream, net: Sequence[int], buckets: Sequence[Bucket], chunk: int) -> None:
        self.stream = stream
        self.net = net
        self.first: dict[int, int] = {}  # bucket index -> tag offset of its first chunk
        n = 0
        for b in buckets:
            self.first[b.index] = n
            n += -(-b.nbytes // chunk)
        self.chunk = chunk

    def filler(self, b: Bucket, data: torch.Tensor, pending: list[Pending], stage: str) -> Callable[[int], None]:
        """What to call as ``data`` (the bucket's bytes) fills up: posts every whole chunk so far."""
        sent = 0
        comm = self.stream.comm

        def filled(upto: int) -> None:
            nonlocal sent
            while sent < b.nbytes and (upto == b.nbytes or sent + self.chunk <= upto):
                hi = min(sent + self.chunk, b.nbytes)
                tag = NET_TAG + self.first[b.index] + sent // self.chunk
                pending.extend(comm.send(data[sent:hi], r, tag=tag, timeout_s=self.stream.remaining(stage))
                               for r in self.net)
                sent = hi
        return filled

def relay_unavailable(relay: int, reason: str, capacity: int) -> SharedMemoryUnavailable:
    return SharedMemoryUnavailable(path=f"{SHM_DIR} (the segments of relay rank {relay})", nbytes=2 * capacity,
                                   problem=reason)


class CollectiveSend(SendRoute):
    """The sender of a same-host transfer whose same-host readers (if any) are served by a
    subclass: this class sends the offer, hears the relays' answers, and sends every bucket
    to the collective ranks in chunks. On its own (no readers): a bucket that is one tensor
    goes from its memory, others are packed into the sender's two buffers."""

    def __init__(self, stream: Stream, plan: Plan, *, readers: Sequence[int], net: Sequence[int],
                 relays: Mapping[int, tuple[int, ...]], require: bool, chunk: int, buffer: Buffer,
                 on_failure: Callable[[], None], fallback: str | None = None) -> None:
        self.stream = stream
        self.plan = plan
        self.readers = list(readers)
        self.net = list(net)
        self.relays = dict(relays)
        relayed = {p: r for r, peers in self.relays.items() for p in peers}
        self.require = require
        self.chunk = chunk
        self.buffer = buffer
        self.on_failure = on_failure
        self.fallback = fallback
        self.routes = {**{r: "shm" for r in self.readers}, **{r: "collective" for r in self.net},
                       **{p: "relay" for p in relayed}}
        comm = stream.comm
        self.chan = Channel.bind(group=comm.group, version=comm.version, rank=comm.rank) if self.readers else None
        self.waiter = Waiter(stream, self.chan, {}, self.slot_count())
        self.known: Seal | None = plan.known_seal()
        self.hasher: StreamHasher | None = hasher_for(plan.manifest) if self.known is None else None
        self.digests: list[int] = []
        self.sends: NetSends | None = None
        self.offer: Offer | None = None  # sent by open()

    # -- what a subclass changes -------------------------------------------------------------

    def slot_count(self) -> int:
        return 2  # the packing buffers

    def offer_fields(self) -> dict[str, Any]:
        """The offer's fields that name what the same-host readers read."""
        return {"segments": (), "fresh": False}

    def attach(self, at: Transfer) -> None:
        """After the offer: wait until every same-host reader is ready."""

    def put(self, b: Bucket, slot: int, pending: list[Pending], at: Transfer) -> None:
        """Move bucket ``b`` (hashing it): here to the collective ranks only."""
        assert self.sends is not None
        one = b.single
        if one is not None:  # a bucket that is one tensor goes from its memory
            data = self.plan.sources[one.tensor][one.start : one.start + one.length]
            self.sends.filler(b, data, pending, at.stage)(b.nbytes)  # sent while it is hashed here
            hash_bucket(b, data, self.hasher)
        else:
            data = self.buffer(slot, b.nbytes, self.stream.comm.device)
            copy_hash(b, data, in_tensors(self.plan.sources), self.hasher,
                      filled=self.sends.filler(b, data, pending, at.stage))

    def hold(self, b: Bucket, slot: int, pending: list[Pending]) -> None:
        """Bucket ``b`` is out: its slot is free again once these readers released it and
        ``pending`` completed."""
        self.waiter.busy[slot] = (b.index, set(self.readers), pending)

    def net_filler(self, b: Bucket, data: torch.Tensor, pending: list[Pending], at: Transfer,
                   ) -> Callable[[int], None] | None:
        """What posts the chunks of ``data`` to the collective ranks as it fills (None: none)."""
        assert self.sends is not None
        return self.sends.filler(b, data, pending, at.stage) if self.net else None

    # -- the route ---------------------------------------------------------------------------

    def open(self, at: Transfer) -> None:
        comm = self.stream.comm
        at.stage = "offer"
        offer = Offer(comm.group, comm.version, os.getpid(), self.chan.endpoint if self.chan else "",
                      shm=tuple(self.readers), collective=tuple(self.net), fallback=self.fallback,
                      relays=tuple(sorted(self.relays.items())), require=self.require, chunk=self.chunk,
                      **self.offer_fields())
        self.offer = offer
        self.stream.send_message(encode_offer(offer), at.stage)
        if self.relays:
            at.stage = "relay offers"
            for r, peers in sorted(self.relays.items()):
                theirs = decode_offer(side_stream(self.stream, r, sending=False).recv_message(at.stage),
                                      group=comm.group, group_version=comm.version)
                if theirs.fallback is not None:
                    if self.require:
                        raise relay_unavailable(r, theirs.fallback, self.plan.capacity)
                    # the relay could not make its segments: its peers get the buckets from here
                    self.net = sorted(self.net + list(peers))
                    self.routes.update({p: "collective" for p in peers})
                    self.fallback = "; ".join(filter(None, [self.fallback, f"relay rank {r}: {theirs.fallback}"]))
        self.attach(at)
        self.sends = NetSends(self.stream, self.net, self.plan.buckets, self.chunk)

    def write(self, b: Bucket, at: Transfer) -> None:
        slot = b.index % self.waiter.nslots
        self.waiter.free(slot, at.stage)
        pending: list[Pending] = []
        self.put(b, slot, pending, at)
        self.digests.append(self.hasher.bucket_digest(b) if self.hasher is not None
                            else self.known.bucket_checksums[b.index])  # type: ignore[union-attr]
        self.hold(b, slot, pending)
        at.bucket_done()

    def drain(self, at: Transfer) -> None:
        at.stage = "last buckets"
        self.waiter.free(0, at.stage)
        self.waiter.free(1, at.stage)

    def checksums(self, at: Transfer) -> tuple[list[int], list[int]]:
        if self.hasher is not None:
            return self.digests, self.hasher.tensor_digests()
        assert self.known is not None
        return self.digests, list(self.known.tensor_checksums)

    def failed(self, at: Transfer, exc: BaseException) -> None:
        if self.chan is not None:
            for r in self.readers:
                # a reader that is gone or never said hello: its pid check or deadline ends it
                with contextlib.suppress(TransportError):
                    self.chan.send({"kind": "failed", "reason": f"{type(exc).__name__} during {at.stage}"}, to=r)
        self.on_failure()

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()


class HandsOn(Protocol):
    """A node's relay, as the collective receiver drives it (:mod:`ftstate.transport.routes.relay`)."""

    def attach(self, at: Transfer) -> None: ...
    def begin(self, b: Bucket, stage: str) -> None: ...
    def hand_on(self, b: Bucket, data: torch.Tensor, hasher: StreamHasher, lo: int, hi: int) -> None: ...
    def end(self, b: Bucket) -> None: ...
    def finish(self, stage: str) -> None: ...


class CollectiveReceive(HashedReceive):
    """Receive every bucket from ``src`` over the communicator, chunk by chunk, hashing each
    chunk as it lands (and, as a node's relay, handing each on to its peers)."""

    def __init__(self, stream: Stream, src: int, buckets: Sequence[Bucket], hasher: StreamHasher, chunk: int,
                 damage: Callable[[bool], bool], relay: HandsOn | None = None) -> None:
        comm = stream.comm
        if chunk <= 0:
            raise ManifestError(f"malformed offer: field 'chunk': {chunk}, expected a positive number of bytes for "
                                f"rank {comm.rank}, which gets the buckets over the collective", field="chunk")
        super().__init__(hasher)
        self.stream = stream
        self.src = src
        self.damage = damage
        self.relay = relay
        self.chunks = chunks(buckets, chunk)
        self.posted: deque[Pending] = deque()
        self.nposted = 0
        self.done = 0

    def post_until(self, flat: torch.Tensor, bucket: int, stage: str) -> None:
        """Post the receives of every chunk of the buckets before ``bucket``."""
        comm = self.stream.comm
        while self.nposted < len(self.chunks) and self.chunks[self.nposted][0].index < bucket:
            b, lo, hi = self.chunks[self.nposted]
            self.posted.append(comm.recv(flat[b.start + lo : b.start + hi], self.src, tag=NET_TAG + self.nposted,
                                         timeout_s=self.stream.remaining(stage)))
            self.nposted += 1

    def open(self, flat: torch.Tensor, at: Transfer) -> None:
        self.post_until(flat, WINDOW, f"bucket 1/{at.buckets}")
        if self.relay is not None:
            self.relay.attach(at)  # while the first buckets arrive

    def read(self, b: Bucket, flat: torch.Tensor, at: Transfer) -> None:
        data = flat[b.start : b.stop]
        if self.relay is not None:
            self.relay.begin(b, at.stage)
        while self.done < len(self.chunks) and self.chunks[self.done][0] is b:
            _, lo, hi = self.chunks[self.done]
            self.posted.popleft().wait()
            self.done += 1
            self.post_until(flat, b.index + WINDOW, at.stage)
            if self.damage(bool(b.segments) and lo <= b.segments[0].bucket_offset < hi):
                data[b.segments[0].bucket_offset : b.segments[0].bucket_offset + 1].bitwise_xor_(0xFF)
            if self.relay is not None:
                self.relay.hand_on(b, data, self.hasher, lo, hi)
            else:
                feed_bucket(self.hasher, b, data, lo, hi)
        if self.relay is not None:
            self.relay.end(b)
        self.digested(b, at)

    def drain(self, at: Transfer) -> None:
        if self.relay is not None:
            at.stage = "last buckets"
            self.relay.finish(at.stage)


__all__ = ["CollectiveReceive", "CollectiveSend", "HandsOn", "NetSends", "chunks", "relay_unavailable"]
