"""The node-copy route (``staging: node``): one full-size copy per node, verified in place by its readers."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ftstate.transport.base import Communicator, Pending
from ftstate.transport.buckets import Bucket
from ftstate.transport.checksum import StreamHasher
from ftstate.transport.hashing import feed_bucket
from ftstate.transport.manifest import Manifest, encode_manifest
from ftstate.transport.nodecopy import NodeCopy, forget_mappings
from ftstate.transport.offer import Offer
from ftstate.transport.routes.base import HashedReceive, Plan, Transfer
from ftstate.transport.routes.collective import CollectiveSend
from ftstate.transport.routes.copying import PIECE, announcer, both, copy_hash, in_tensors
from ftstate.transport.routes.signalling import Follower
from ftstate.transport.routes.slots import tell_writer
from ftstate.transport.shm import unlink_names
from ftstate.transport.signals import Channel
from ftstate.transport.stream import Stream
from ftstate.transport.weights import TransferReport


@dataclass
class Written:
    """The node copies a sender keeps: the committed one's, and (``node_copy_spare``) the one
    before it, kept named and mapped to be rewritten as the next."""

    committed: NodeCopy | None = None
    spare: NodeCopy | None = None


def next_node_copy(sender: Any, comm: Communicator, manifest: Manifest, owner: int, keep_spare: bool) -> NodeCopy:
    """The node copy this transfer writes: the sender's spare rewritten when it keeps one and
    it fits, else a new one (a spare that does not fit goes)."""
    written = sender.node_copies = sender.node_copies or Written()
    spare, written.spare = written.spare, None
    payload = encode_manifest(manifest)
    if spare is not None and keep_spare and spare.owner == owner and spare.reuse(
            comm.group, group_version=comm.version, weights_version=manifest.weights_version, manifest=payload,
            data_bytes=manifest.total_bytes):
        return spare
    if spare is not None:
        spare.unlink()
        spare.close()
    return NodeCopy.create(comm.group, group_version=comm.version, owner=owner,
                           weights_version=manifest.weights_version, manifest=payload,
                           data_bytes=manifest.total_bytes)


def settle_node_copy(sender: Any, node: NodeCopy, *, committed: bool, keep_spare: bool) -> Written:
    """After the vote: a version every rank committed keeps its node copy (the source of
    newcomers on the node) and the one this sender wrote before goes, or with ``keep_spare``
    stays, named and mapped, as the next one's; any other outcome unlinks the new one (the
    ranks that committed it keep their mappings). Without a spare the writer's own mapping
    goes: it never reads the copy again."""
    written = sender.node_copies = sender.node_copies or Written()
    if committed:
        old, written.committed = written.committed, node
        if old is not None and old is not node:
            if keep_spare and old.mapped:
                written.spare = old
            else:
                old.unlink()
                old.close()
        if not keep_spare:
            node.close()
    else:
        node.unlink()
        node.close()
    return written


#: The node copy this process last wrote as its node's relay and committed, by group.
RELAY_COPIES: dict[str, str] = {}


def relayed(group: str, node: NodeCopy, *, committed: bool) -> None:
    """After the vote, as its node's relay: a copy it verified itself stays (the node's source
    for newcomers; the previous one goes), one it rejected goes. Whether its peers committed
    too is the controller's to settle (the node agent keeps only the committed copy)."""
    if committed:
        previous = RELAY_COPIES.get(group)
        if previous not in (None, node.name):
            unlink_names([previous])
        RELAY_COPIES[group] = node.name
    else:
        node.unlink()
    node.close()


def map_node_copy(offer: Offer, comm: Communicator, manifest: Manifest, writer: int) -> NodeCopy:
    forget_mappings()  # of copies unlinked since (failed, replaced): their memory goes now
    node = NodeCopy.attach(offer.node_copy, group=comm.group, owner=offer.owner, group_version=comm.version,
                           writer=offer.pid, cache=offer.recycled)
    try:
        node.check_holds(manifest)
    except BaseException:
        node.close()
        raise
    return node


class NodeCopySend(CollectiveSend):
    """The sender's side: every bucket written once at its place in the node copy ``node``,
    its readers told as it fills (and the collective ranks sent each chunk from the copy)."""

    def __init__(self, stream: Stream, plan: Plan, *, node: NodeCopy, owner: int, keep_spare: bool,
                 holder: Any, **kw: Any) -> None:
        self.node = node
        self.owner = owner
        self.keep_spare = keep_spare
        self.holder = holder  # the Sender, which keeps the copies it wrote (``node_copies``)
        self.node_pending: list[Pending] = []  # the copy's sends, waited once after the last bucket
        super().__init__(stream, plan, **kw)

    def slot_count(self) -> int:
        return 1

    def offer_fields(self) -> dict[str, Any]:
        return {"segments": (), "fresh": False, "node_copy": self.node.name, "owner": self.owner,
                "recycled": self.keep_spare}

    def attach(self, at: Transfer) -> None:
        at.stage = "attach"
        self.waiter.hellos(self.readers, at.stage)  # the node copy keeps its name: a newcomer maps it later

    def put(self, b: Bucket, slot: int, pending: list[Pending], at: Transfer) -> None:
        assert self.chan is not None
        data = self.node.data[b.start : b.start + b.nbytes]  # written once at its place in the layout
        copy_hash(b, data, in_tensors(self.plan.sources), self.hasher, hash_source=True, filled=both(
            announcer(self.chan, self.readers, b.index, 0), self.net_filler(b, data, self.node_pending, at)))

    def hold(self, b: Bucket, slot: int, pending: list[Pending]) -> None:
        if b.index == len(self.plan.buckets) - 1:  # nothing is recycled: the readers only say when they are through
            self.waiter.busy[0] = (b.index, set(self.readers), self.node_pending)

    def failed(self, at: Transfer, exc: BaseException) -> None:
        super().failed(at, exc)
        self.node.unlink()  # a failed version's node copy never stays
        self.node.close()

    def settle(self, report: TransferReport) -> TransferReport:
        written = settle_node_copy(self.holder, self.node, committed=report.ok, keep_spare=self.keep_spare)
        if not report.ok:
            return report
        return dataclasses.replace(report, node_copy=self.node.name, node_copy_recycled=self.node.recycled,
                                   node_spare=written.spare.name if written.spare is not None else None)


class InPlaceReceive(HashedReceive):
    """A reader's side: hash every bucket where the writer puts it in the node copy (``flat``,
    this member's mapping of it), following the writer's ``ready`` signals a :data:`PIECE` at a
    time; nothing is copied. Says ``released`` once, after the last bucket."""

    def __init__(self, stream: Stream, offer: Offer, writer: int, buckets: list[Bucket], hasher: StreamHasher,
                 damage: Callable[[bool], bool]) -> None:
        super().__init__(hasher)
        self.stream = stream
        self.offer = offer
        self.writer = writer
        self.buckets = buckets
        self.damage = damage
        self.chan: Channel | None = None

    def open(self, flat: torch.Tensor, at: Transfer) -> None:
        comm = self.stream.comm
        at.stage = "attach"
        self.chan = Channel.connect(self.offer.endpoint, comm.rank, group=comm.group, version=comm.version,
                                    writer=self.writer)
        self.chan.send({"kind": "hello", "rank": comm.rank, "pid": os.getpid()})
        self.follow = Follower(self.chan, self.stream, {self.writer: self.offer.pid}, 1)

    def read(self, b: Bucket, flat: torch.Tensor, at: Transfer) -> None:
        self.follow.start(b.index, b.nbytes, at.stage)
        data = flat[b.start : b.start + b.nbytes]
        # chaos: this reader sees a damaged bucket. Damaged in what it hashes, never in the
        # node copy, which the other readers verify too.
        damaged = b.segments[0].bucket_offset if self.damage(bool(b.segments)) else -1
        for lo in range(0, b.nbytes, PIECE):
            hi = min(lo + PIECE, b.nbytes)
            self.follow.awaiting(hi)
            piece = data
            if lo <= damaged < hi:
                piece = data[:hi].clone()
                piece[damaged] ^= 0xFF
            feed_bucket(self.hasher, b, piece, lo, hi)
        self.follow.awaiting(b.nbytes)  # the writer's last word on this bucket, before the next one's
        self.digested(b, at)

    def drain(self, at: Transfer) -> None:
        if self.buckets:
            assert self.chan is not None
            self.chan.send({"kind": "released", "bucket": self.buckets[-1].index})

    def failed(self, at: Transfer, exc: BaseException) -> None:
        tell_writer(self.chan, at, exc)

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()


__all__ = ["RELAY_COPIES", "InPlaceReceive", "NodeCopySend", "Written", "map_node_copy", "next_node_copy",
           "relayed", "settle_node_copy"]
