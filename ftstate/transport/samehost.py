"""The same-host transfer: buckets through shared memory for the receivers on the sender's host."""

from __future__ import annotations

import functools
import time
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ftstate.core.errors import ManifestError, SharedMemoryUnavailable
from ftstate.transport.base import Communicator
from ftstate.transport.buckets import Bucket
from ftstate.transport.hashing import hasher_for
from ftstate.transport.manifest import Manifest, Seal
from ftstate.transport.nodecopy import NodeCopy, forget_mappings
from ftstate.transport.offer import NET_TAG, Offer, decode_offer, encode_offer
from ftstate.transport.routes.base import POLL_S, Plan, ReceiveRoute, SendRoute, Transfer
from ftstate.transport.routes.collective import CollectiveReceive, CollectiveSend, relay_unavailable
from ftstate.transport.routes.copying import PIECE
from ftstate.transport.routes.nodecopy import (
    InPlaceReceive,
    NodeCopySend,
    map_node_copy,
    next_node_copy,
    relayed,
)
from ftstate.transport.routes.relay import Relay
from ftstate.transport.routes.slots import (
    SlotsReceive,
    SlotsSend,
    drop_mappings,
    drop_slots,
    require_host_memory,
    slot_memory,
    slots_for,
)
from ftstate.transport.shm import pid_alive
from ftstate.transport.stream import SIDE_TAG, BroadcastStream, PeerStream, Stream, peer_of, side_stream
from ftstate.transport.sync import Receiver, Sender
from ftstate.transport.weights import CommittedWeights, OnProgress, TransferReport

#: A bucket goes to a collective rank in messages of this many bytes, each sent as soon as the
#: sender has it (copied and hashed) and hashed by the receiver as soon as it lands, so
#: sending, the network and the receiver's hash overlap even for a transfer of one bucket.
NET_CHUNK = 8 * 1024 * 1024

#: First tag of a relay's offer to the sender and to each of its peers (header, then body).
RELAY_TAG = SIDE_TAG


def broadcast(
    sender: Sender,
    comm: Communicator,
    weights: Mapping[str, torch.Tensor] | CommittedWeights,
    *,
    same_host: Collection[int],
    relays: Mapping[int, Collection[int]] | None = None,
    require_shm: bool = False,
    weights_version: int | None = None,
    timeout_s: float,
    progress: OnProgress | None = None,
    node_copy_owner: int | None = None,
    node_copy_spare: bool = False,
) -> TransferReport:
    """:meth:`Sender.broadcast` on this route: ``same_host`` ranks read shared memory, each
    rank of ``relays`` writes its node's copy for its peers, the others use the communicator.
    With ``require_shm`` a segment that cannot be made raises SharedMemoryUnavailable (else
    the collective, in :attr:`TransferReport.shm_fallback`). ``node_copy_owner``: same-host ranks
    verify one node copy in place; ``node_copy_spare`` keeps the previous one to rewrite."""
    stream = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=comm.rank, sending=True)
    return _send(sender, stream, weights, weights_version, progress, same_host=frozenset(same_host),
                 require_shm=require_shm, relays={r: tuple(sorted(p)) for r, p in (relays or {}).items() if p},
                 node_copy_owner=node_copy_owner, node_copy_spare=node_copy_spare)


def send_to(
    sender: Sender,
    comm: Communicator,
    peer: int,
    weights: Mapping[str, torch.Tensor] | CommittedWeights,
    *,
    require_shm: bool = False,
    weights_version: int | None = None,
    timeout_s: float,
    progress: OnProgress | None = None,
) -> TransferReport:
    """:meth:`Sender.send_to` a ``peer`` on this member's host, through shared memory (the
    peer calls :func:`receive` with ``point_to_point=True``)."""
    stream = PeerStream(comm, time.monotonic() + timeout_s, timeout_s, peer=peer, sending=True)
    return _send(sender, stream, weights, weights_version, progress, same_host=frozenset([peer]),
                 require_shm=require_shm)


def receive(
    receiver: Receiver, comm: Communicator, src: int, *, point_to_point: bool = False, timeout_s: float,
    progress: OnProgress | None = None, node_copy_owner: int | None = None,
) -> CommittedWeights:
    """Receive what ``src`` sends with :func:`broadcast` or :func:`send_to`, the way its offer
    says; errors and guarantee as :meth:`Receiver.receive_broadcast`. ``node_copy_owner``: as
    its node's relay, receive into a node copy owned by that process."""
    if point_to_point:
        stream: Stream = PeerStream(comm, time.monotonic() + timeout_s, timeout_s, peer=src, sending=False)
    else:
        stream = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=src, sending=False)
    return receiver.transfer(stream, progress, SameHostReceive(stream, receiver, node_copy_owner))


def _send(
    sender: Sender,
    stream: Stream,
    weights: Mapping[str, torch.Tensor] | CommittedWeights,
    weights_version: int | None,
    progress: OnProgress | None,
    *,
    same_host: frozenset[int],
    require_shm: bool,
    relays: Mapping[int, tuple[int, ...]] | None = None,
    node_copy_owner: int | None = None,
    node_copy_spare: bool = False,
) -> TransferReport:
    """One transfer whose route the sender picks once it knows the plan (:func:`_route`)."""
    return sender.transfer(stream, weights, weights_version, progress, functools.partial(
        _route, sender, same_host=same_host, require_shm=require_shm, relays=relays or {},
        node_copy_owner=node_copy_owner, node_copy_spare=node_copy_spare))


def _route(sender: Sender, stream: Stream, plan: Plan, *, same_host: frozenset[int], require_shm: bool,
           relays: Mapping[int, tuple[int, ...]], node_copy_owner: int | None, node_copy_spare: bool) -> SendRoute:
    """The sender's route: a node copy for its same-host readers (``node_copy_owner``), else
    slots, else (none can be made, and not ``require_shm``) the collective for them too; the
    other receivers always get chunks over the collective, or a node's relay does."""
    comm = stream.comm
    receivers = [r for r in range(comm.world_size) if r != comm.rank] if isinstance(stream, BroadcastStream) \
        else [peer_of(stream)]
    relays = {r: p for r, p in relays.items() if r in receivers}
    relayed_ranks = {p for peers in relays.values() for p in peers}
    readers = [r for r in receivers if r in same_host]
    net = [r for r in receivers if r not in same_host and r not in relayed_ranks]
    fallback: str | None = None
    common: dict[str, Any] = {"relays": relays, "require": require_shm, "chunk": NET_CHUNK, "buffer": sender.buffer,
              "on_failure": functools.partial(drop_slots, sender)}
    if readers and node_copy_owner is not None:
        try:
            require_host_memory(comm, plan.manifest.total_bytes)
            node = next_node_copy(sender, comm, plan.manifest, node_copy_owner, node_copy_spare)
            return NodeCopySend(stream, plan, node=node, owner=node_copy_owner, keep_spare=node_copy_spare,
                                holder=sender, readers=readers, net=net, **common)
        except SharedMemoryUnavailable as exc:
            if require_shm:
                comm.abort(f"shared memory unavailable: {exc.problem}")
                raise
            fallback = f"node copy: {exc}; the slots instead"  # the readers stage privately
    if readers:
        try:
            memory = slot_memory(comm, plan.capacity)
            slots, fresh = slots_for(sender, comm, plan.capacity, min(2, len(plan.buckets)) or 1, set(readers),
                                     memory)
            return SlotsSend(stream, plan, slots=slots, fresh=fresh, readers=readers, net=net, fallback=fallback,
                             **common)
        except SharedMemoryUnavailable as exc:
            if require_shm:
                comm.abort(f"shared memory unavailable: {exc.problem}")
                raise
            fallback = str(exc)
            net, readers = sorted(net + readers), []
    return CollectiveSend(stream, plan, readers=readers, net=net, fallback=fallback, **common)


class SameHostReceive(ReceiveRoute):
    """A same-host receiver: reads the offers, relays when it is one, reads the buckets as
    offered; cleans up on failure."""

    def __init__(self, stream: Stream, receiver: Receiver, node_copy_owner: int | None) -> None:
        self.stream = stream
        self.receiver = receiver
        self.node_copy_owner = node_copy_owner
        self.way: ReceiveRoute | None = None
        self.relay: Relay | None = None
        #: the node copy it verifies in place, or writes as its node's relay (``staging: node``)
        self.node: NodeCopy | None = None

    def begin(self, manifest: Manifest, buckets: list[Bucket], at: Transfer) -> None:
        comm = self.stream.comm
        src = peer_of(self.stream)
        at.stage = "offer"
        offer = decode_offer(self.stream.recv_message(at.stage), group=comm.group, group_version=comm.version)
        hasher = hasher_for(manifest, receiving=True)
        damage = self.receiver.take_damage
        peers = dict(offer.relays).get(comm.rank, ())
        relay = next((r for r, ps in offer.relays if comm.rank in ps), None)
        theirs: Offer | None = None  # its node relay's offer, for one of its peers
        if relay is not None and comm.rank not in offer.shm:
            at.stage = "relay offer"
            theirs = decode_offer(side_stream(self.stream, relay, sending=False).recv_message(at.stage),
                                  group=comm.group, group_version=comm.version)
        if comm.rank in offer.collective and peers:
            self.relay = Relay.start(self.stream, at, manifest, buckets, peers, require=offer.require,
                                     owner=self.node_copy_owner)
        # where its staging is: a node copy it verifies in place (the sender's or its relay's),
        # the node copy it writes as its node's relay, or a private buffer
        reading = offer if comm.rank in offer.shm else theirs if theirs is not None and comm.rank in theirs.shm \
            else None
        writer = src if reading is offer else relay
        if reading is not None and reading.node_copy:
            assert writer is not None
            self.node = map_node_copy(reading, comm, manifest, writer)
            self.way = InPlaceReceive(self.stream, reading, writer, buckets, hasher, damage)
            return
        if self.relay is not None and self.relay.node is not None:
            self.node = self.relay.node
        if reading is not None:
            assert writer is not None
            self.way = SlotsReceive(self.stream, reading, writer, relayed=writer != src, manifest=manifest,
                                    hasher=hasher, damage=damage)
        elif theirs is not None and offer.require:
            assert relay is not None
            raise relay_unavailable(relay, theirs.fallback or "no segments offered", max(
                [b.nbytes for b in buckets] + [1]))
        elif theirs is not None or comm.rank in offer.collective:
            # (a relay that could not make its segments: the sender sends to this rank as well)
            self.way = CollectiveReceive(self.stream, src, buckets, hasher, offer.chunk, damage, self.relay)
        else:
            raise ManifestError(f"malformed offer: rank {comm.rank} is in neither 'shm', 'collective' nor "
                                "'relays'", field="shm")

    def staging(self, at: Transfer) -> tuple[torch.Tensor, int] | None:
        return (self.node.data, 0) if self.node is not None else None

    def open(self, flat: torch.Tensor, at: Transfer) -> None:
        assert self.way is not None
        self.way.open(flat, at)

    def read(self, b: Bucket, flat: torch.Tensor, at: Transfer) -> None:
        assert self.way is not None
        self.way.read(b, flat, at)

    def drain(self, at: Transfer) -> None:
        assert self.way is not None
        self.way.drain(at)

    def digests(self, at: Transfer) -> list[int]:
        assert self.way is not None
        return self.way.digests(at)

    def tensor_sums(self, seal: Seal) -> list[int]:
        assert self.way is not None
        return self.way.tensor_sums(seal)

    def failed(self, at: Transfer, exc: BaseException) -> None:
        comm = self.stream.comm
        if self.way is not None:
            self.way.failed(at, exc)
        if self.relay is not None:
            self.relay.failed(at.stage, exc)
        if self.node is not None:
            if not pid_alive(self.node.writer):
                self.node.unlink()  # a failed version's node copy never stays, whoever dies
            self.node.close()
            forget_mappings()
        drop_mappings(group=comm.group)

    def close(self) -> None:
        if self.way is not None:
            self.way.close()
        if self.relay is not None:
            self.relay.close()

    def settle(self, committed: bool) -> str | None:
        if self.relay is not None and self.relay.node is not None:  # the copy it wrote for its node's peers
            relayed(self.stream.comm.group, self.relay.node, committed=committed)
        return self.node.name if self.node is not None else None


__all__ = ["NET_CHUNK", "NET_TAG", "PIECE", "POLL_S", "RELAY_TAG", "Offer", "broadcast", "decode_offer",
           "drop_mappings", "drop_slots", "encode_offer", "receive", "send_to"]
