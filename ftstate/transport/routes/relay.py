"""The relay route: one copy per remote node."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

import torch

from ftstate.core.errors import SharedMemoryUnavailable, TransportError
from ftstate.transport.buckets import Bucket
from ftstate.transport.checksum import StreamHasher
from ftstate.transport.hashing import feed_bucket
from ftstate.transport.hostmem import copy_bytes
from ftstate.transport.manifest import Manifest, encode_manifest
from ftstate.transport.nodecopy import NodeCopy
from ftstate.transport.offer import Offer, encode_offer
from ftstate.transport.routes.base import Transfer
from ftstate.transport.routes.copying import PIECE, announcer
from ftstate.transport.routes.signalling import Waiter
from ftstate.transport.routes.slots import Slots, drop_relay_slots, relay_slots, require_host_memory
from ftstate.transport.shm import unlink_names
from ftstate.transport.signals import Channel
from ftstate.transport.stream import Stream, peer_of, side_stream


class Relay:
    """This receiver's duty as its node's relay: every bucket it receives over the collective
    is written once into its own slots, chunk by chunk as it lands (:meth:`hand_on`: each
    piece hashed as received, then copied while in cache), and read from there by its node
    peers, exactly as same-host readers read the sender's, following it as it fills.
    """

    def __init__(self, stream: Stream, peers: tuple[int, ...], slots: Slots | None, chan: Channel, fresh: bool,
                 weights_version: int, node: NodeCopy | None = None, last: int = -1) -> None:
        self.stream = stream
        self.peers = peers
        self.slots = slots
        self.chan = chan
        self.fresh = fresh
        self.weights_version = weights_version
        #: ``node_copy_owner``: it receives straight into this node copy, which its peers
        #: verify in place (nothing is copied, nothing recycled; ``last``: the last bucket)
        self.node = node
        self.last = last
        self.nslots = len(slots.segments) if slots is not None else 1
        self.waiter = Waiter(stream, chan, {}, self.nslots)
        #: the bucket being handed on: its slot, the slot's bytes, and how to tell the peers
        self.filling: tuple[int, torch.Tensor, Callable[[int], None]] | None = None

    @classmethod
    def start(cls, stream: Stream, at: Transfer, manifest: Manifest, buckets: Sequence[Bucket],
              peers: tuple[int, ...], *, require: bool, owner: int | None = None) -> Relay | None:
        """Make (or reuse) the slots, or with ``owner`` a node copy owned by that process (one
        that cannot be made: the slots, said in the offer's ``fallback``), and offer them to the
        peers, and tell the sender whether it could (its peers otherwise take the collective,
        or with ``require`` the transfer fails). None when it relays nothing this time."""
        comm = stream.comm
        at.stage = "relay segments"
        capacity = max([b.nbytes for b in buckets] + [1])
        slots: Slots | None = None
        node: NodeCopy | None = None
        fresh = False
        unavailable: SharedMemoryUnavailable | None = None
        if owner is not None:
            try:
                require_host_memory(comm, manifest.total_bytes)
                node = NodeCopy.create(comm.group, group_version=comm.version, owner=owner,
                                       weights_version=manifest.weights_version, manifest=encode_manifest(manifest),
                                       data_bytes=manifest.total_bytes)
            except SharedMemoryUnavailable:  # its peers read the slots instead, and stage privately
                node = None
        if node is None:
            try:
                require_host_memory(comm, capacity)
                slots, fresh = relay_slots(comm, capacity, min(2, len(buckets)) or 1, set(peers))
            except SharedMemoryUnavailable as exc:
                unavailable = exc
        made = slots is not None or node is not None
        chan = Channel.bind(group=comm.group, version=comm.version, rank=comm.rank) if made else None
        try:
            offer = Offer(comm.group, comm.version, os.getpid(), chan.endpoint if chan else "",
                          tuple(s.name for s in slots.segments) if slots else (), fresh,
                          peers if made else (), () if made else peers,
                          str(unavailable) if unavailable else None,
                          node_copy=node.name if node is not None else "", owner=owner if node is not None and owner else 0)
            payload = encode_offer(offer)
            at.stage = "relay offer"
            for rank in (peer_of(stream), *peers):  # the sender first: it waits for the answer
                side_stream(stream, rank, sending=True).send_message(payload, at.stage)
        except BaseException:
            if chan is not None:
                chan.close()
            if node is not None:
                node.unlink()
                node.close()
            raise
        if unavailable is not None:
            if require:
                comm.abort(f"shared memory unavailable: {unavailable.problem}")
                raise unavailable
            return None
        assert chan is not None
        return cls(stream, peers, slots, chan, fresh, manifest.weights_version, node,
                   buckets[-1].index if buckets else -1)

    def attach(self, at: Transfer) -> None:
        at.stage = "relay attach"
        self.waiter.hellos(self.peers, at.stage)
        if self.slots is None:  # a node copy keeps its name: a newcomer on the node maps it later
            return
        if self.fresh:  # every peer mapped them: the names go, the memory stays with the mappings
            unlink_names([s.name for s in self.slots.segments])
        self.slots.attached |= set(self.peers)

    def begin(self, b: Bucket, stage: str) -> None:
        """Bucket ``b`` is arriving: take its slot once the peers released the bucket before
        in it, and mark the slot (before the peers hear of it). In a node copy: where it lands."""
        if self.node is not None:
            self.filling = (0, self.node.data[b.start : b.start + b.nbytes],
                            announcer(self.chan, self.peers, b.index, 0))
            return
        assert self.slots is not None
        slot = b.index % self.nslots
        self.waiter.free(slot, stage)
        self.slots.segments[slot].mark(b.index, self.weights_version, b.nbytes)
        self.filling = (slot, self.slots.data(slot)[: b.nbytes], announcer(self.chan, self.peers, b.index, slot))

    def hand_on(self, b: Bucket, data: torch.Tensor, hasher: StreamHasher, lo: int, hi: int) -> None:
        """The bucket's bytes ``[lo, hi)`` have landed in ``data``: hash them and copy them into
        the slot a :data:`PIECE` at a time (hashed while in cache), then tell the peers."""
        assert self.filling is not None, "hand_on before begin"
        _, out, filled = self.filling
        if self.node is not None:  # it landed in the node copy itself: hashed, then announced
            feed_bucket(hasher, b, data, lo, hi)
            filled(hi)
            return
        for p in range(lo, hi, PIECE):
            q = min(p + PIECE, hi)
            copy_bytes(out[p:q], data[p:q])
            feed_bucket(hasher, b, data, p, q)
        filled(hi)

    def end(self, b: Bucket) -> None:
        assert self.filling is not None, "end before begin"
        slot, _, _ = self.filling
        if self.node is None or b.index == self.last:  # a node copy's readers say when they are through
            self.waiter.busy[slot] = (b.index, set(self.peers), [])

    def finish(self, stage: str) -> None:
        """Wait until every peer released the last buckets (before the seal: a peer that dies
        reading them is named here, not as a broken vote)."""
        self.waiter.free(0, stage)
        self.waiter.free(1, stage)

    def failed(self, stage: str, exc: BaseException) -> None:
        for p in self.peers:
            with contextlib.suppress(TransportError):  # a peer gone: its own pid check ends it
                self.chan.send({"kind": "failed", "reason": f"{type(exc).__name__} during {stage}"}, to=p)
        drop_relay_slots(self.stream.comm.group)
        if self.node is not None:  # a failed version's node copy never stays
            self.node.unlink()

    def close(self) -> None:
        self.chan.close()


__all__ = ["Relay"]
