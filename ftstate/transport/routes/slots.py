"""The slot route: buckets written once into shared-memory (or device) slots and read by every receiver on the host."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ftstate.core.errors import (
    ManifestError,
    PeerLost,
    SharedMemoryUnavailable,
    StaleGroupVersion,
    TransportError,
)
from ftstate.transport.base import Communicator, Pending
from ftstate.transport.buckets import Bucket
from ftstate.transport.checksum import StreamHasher
from ftstate.transport.cudaipc import DeviceMemory, device_memory_for
from ftstate.transport.manifest import Manifest
from ftstate.transport.offer import Offer
from ftstate.transport.routes.base import HashedReceive, Plan, Transfer
from ftstate.transport.routes.collective import CollectiveSend
from ftstate.transport.routes.copying import (
    announcer,
    both,
    copy_hash,
    device_copy_hash,
    in_bucket,
    in_tensors,
)
from ftstate.transport.routes.signalling import Follower
from ftstate.transport.shm import SHM_DIR, Segment, pid_alive, segment_name, unlink_names
from ftstate.transport.signals import Channel
from ftstate.transport.stream import Stream

_generations = itertools.count(1)


@dataclass
class Slots:
    """The sender's two slots for one group version, and the readers that mapped them."""

    group: str
    version: int
    capacity: int
    segments: list[Segment]
    attached: set[int] = field(default_factory=set)
    #: Where the slots' data is when not in their segments (see :class:`Device`).
    device: Device | None = None

    def data(self, slot: int) -> torch.Tensor:
        return self.segments[slot].data if self.device is None else self.device.data[slot]


@dataclass
class Mapped:
    """A reader's mappings of the sender's current slots."""

    group: str
    version: int
    names: tuple[str, ...]
    segments: list[Segment]
    device: Device | None = None

    def data(self, slot: int) -> torch.Tensor:
        return self.segments[slot].data if self.device is None else self.device.data[slot]


@dataclass
class Device:
    """The data of a set of slots in device memory: one tensor per slot (allocated by the writer,
    opened by a reader), and the handles the writer offers for them."""

    memory: DeviceMemory
    data: list[torch.Tensor]
    handles: tuple[bytes, ...] = ()

    def release(self) -> None:
        data, self.data = self.data, []
        for t in data:
            self.memory.release(t)


#: This process's mappings, by group, writer pid and whether that writer relays (a new Receiver
#: in the same process keeps using them; one per writer and kind, so a member that reads the
#: sender's slots in one transfer and its node relay's in another keeps both, and so does one
#: whose relay sent it a newcomer's weights point to point in between).
MAPPED: dict[tuple[str, int, bool], Mapped] = {}

#: The slots this process writes as its node's relay, by group (kept between transfers, like
#: a sender's, so its peers keep their mappings).
RELAYING: dict[str, Slots] = {}


def drop(slots: Slots | None) -> None:
    if slots is not None:
        unlink_names([s.name for s in slots.segments])
        for s in slots.segments:
            s.close()
        if slots.device is not None:
            slots.device.release()


def drop_slots(sender: Any) -> None:
    """Unlink (if still named) and unmap the sender's slots."""
    slots, sender.shm_slots = sender.shm_slots, None
    drop(slots)


def unmap(group: str | None, writer: int | None = None, relayed: bool | None = None) -> None:
    for key in [k for k in MAPPED if (group is None or k[0] == group) and (writer is None or k[1] == writer)
                and (relayed is None or k[2] == relayed)]:
        m = MAPPED.pop(key)
        for s in m.segments:
            s.close()
        if m.device is not None:
            m.device.release()


def drop_relay_slots(group: str | None) -> None:
    for key in [k for k in RELAYING if group is None or k == group]:
        drop(RELAYING.pop(key))


def drop_mappings(group: str | None = None) -> None:
    """Everything of the route this process holds as a receiver (of ``group``, or all): unmap
    the segments it mapped, and unlink and unmap the slots it wrote as a relay."""
    unmap(group)
    drop_relay_slots(group)


def fits(s: Slots | None, comm: Communicator, capacity: int, count: int, readers: set[int],
          memory: DeviceMemory | None = None) -> bool:
    return s is not None and (s.group, s.version) == (comm.group, comm.version) and s.capacity >= capacity \
        and len(s.segments) >= count and readers <= s.attached \
        and (s.device.memory if s.device is not None else None) is memory


def slots_for(
    sender: Any, comm: Communicator, capacity: int, count: int, readers: set[int],
    memory: DeviceMemory | None = None,
) -> tuple[Slots, bool]:
    """The sender's ``count`` (1 or 2) slots for this group version (new ones when too few,
    too small, or when a reader has not mapped them), and whether they are new. One slot when
    the transfer is one bucket: each new slot costs a zeroed allocation of its size."""
    if fits(sender.shm_slots, comm, capacity, count, readers, memory):
        return sender.shm_slots, False
    drop_slots(sender)
    sender.shm_slots = new_slots(comm, capacity, count, memory)
    return sender.shm_slots, True


def relay_slots(comm: Communicator, capacity: int, count: int, peers: set[int]) -> tuple[Slots, bool]:
    """:func:`slots_for`, for this process as its node's relay."""
    if fits(RELAYING.get(comm.group), comm, capacity, count, peers):
        return RELAYING[comm.group], False
    drop_relay_slots(comm.group)
    RELAYING[comm.group] = new_slots(comm, capacity, count)
    return RELAYING[comm.group], True


def require_host_memory(comm: Communicator, capacity: int) -> None:
    if comm.device.type != "cpu":
        raise SharedMemoryUnavailable(
            path=str(SHM_DIR), nbytes=2 * capacity,
            problem=f"the weights are on {comm.device}: these slots hold host memory (a relay's always do)")


def slot_memory(comm: Communicator, capacity: int) -> DeviceMemory | None:
    """The device memory the sender's slots take (:func:`~ftstate.transport.cudaipc.device_memory_for`
    the communicator's device), or None for slots in ``/dev/shm``; a device with no memory other
    processes can map: :class:`SharedMemoryUnavailable`."""
    memory = device_memory_for(comm.device)
    if memory is None and comm.device.type != "cpu":
        raise SharedMemoryUnavailable(
            path=f"{comm.device} memory", nbytes=2 * capacity,
            problem=f"the weights are on {comm.device} and no device memory other processes can map is known "
                    f"for {comm.device.type!r} (ftstate.transport.cudaipc.device_memory_for)")
    if memory is None:
        require_host_memory(comm, capacity)
    return memory


def new_slots(comm: Communicator, capacity: int, count: int, memory: DeviceMemory | None = None) -> Slots:
    """``count`` new slots; with ``memory`` their segments are headers only and their data is
    allocated (and exported) there (a failure there: :class:`SharedMemoryUnavailable`)."""
    generation = next(_generations)
    made: list[Segment] = []
    device = Device(memory, []) if memory is not None else None
    try:
        for slot in range(count):
            name = segment_name(comm.group, comm.version, os.getpid(), generation, slot)
            made.append(Segment.create(name, group_version=comm.version, slot=slot,
                                       capacity=capacity if device is None else 0))
        if device is not None:
            try:
                for _ in range(count):
                    device.data.append(device.memory.alloc(capacity, comm.device))
                device.handles = tuple(device.memory.export(t) for t in device.data)
            except (RuntimeError, OSError) as exc:  # out of device memory, or it cannot be exported
                raise SharedMemoryUnavailable(path=f"{comm.device} memory ({type(device.memory).__name__})",
                                              nbytes=count * capacity, problem=str(exc)[:300]) from exc
    except BaseException:
        unlink_names([m.name for m in made])
        for m in made:
            m.close()
        if device is not None:
            device.release()
        raise
    return Slots(comm.group, comm.version, capacity, made, device=device)


def mappings(offer: Offer, comm: Communicator, *, relayed: bool) -> Mapped:
    """The writer's slots that ``offer`` names, mapped (kept from its last transfer when they
    are the same). ``relayed``: the writer is this node's relay, not the transfer's sender. One
    process can write both kinds (a rollout that sent a newcomer its weights point to point,
    then relays the next sync), and each kind keeps its own slots, so each gets its own entry."""
    key = (comm.group, offer.pid, relayed)
    m = MAPPED.get(key)
    if m is not None and m.names == offer.segments and m.version == comm.version \
            and (m.device.handles if m.device is not None else ()) == offer.handles:
        return m
    unmap(comm.group, offer.pid, relayed)
    if not offer.fresh:
        raise ManifestError(f"rank {comm.rank}: the offer names segments {list(offer.segments)} this member "
                            "never mapped and that are gone", field="segments")
    if len(offer.segments) not in (1, 2):
        raise ManifestError(f"malformed offer: field 'segments': expected 1 or 2 slots, got {len(offer.segments)}",
                            field="segments")
    segs: list[Segment] = []
    device: Device | None = None
    try:
        for name in offer.segments:
            segs.append(Segment.attach(name, group=comm.group, group_version=comm.version, creator_pid=offer.pid))
        if offer.handles:  # the headers checked out: now the data, in device memory
            memory = device_memory_for(comm.device)
            if memory is None:
                raise SharedMemoryUnavailable(
                    path=f"{comm.device} memory", nbytes=0,
                    problem=f"rank {comm.rank}: the sender's slots are in device memory and this member has "
                            f"none it can map on {comm.device}")
            device = Device(memory, [], offer.handles)
            for h in offer.handles:
                device.data.append(memory.open(h, comm.device))
    except BaseException:
        for s in segs:
            s.close()
        if device is not None:
            device.release()
        raise
    m = MAPPED[key] = Mapped(comm.group, comm.version, offer.segments, segs, device)
    return m


class SlotsSend(CollectiveSend):
    """The sender's side: every bucket into its slot, its readers told as it fills (and the
    collective ranks sent each chunk from the slot as it fills)."""

    def __init__(self, stream: Stream, plan: Plan, *, slots: Slots, fresh: bool, **kw: Any) -> None:
        self.slots = slots
        self.fresh = fresh
        super().__init__(stream, plan, **kw)

    def slot_count(self) -> int:
        return len(self.slots.segments)

    def offer_fields(self) -> dict[str, Any]:
        return {"segments": tuple(s.name for s in self.slots.segments), "fresh": self.fresh,
                "handles": self.slots.device.handles if self.slots.device else ()}

    def attach(self, at: Transfer) -> None:
        at.stage = "attach"
        self.waiter.hellos(self.readers, at.stage)
        if self.fresh:  # every reader mapped them: the names go, the memory stays with the mappings
            unlink_names([s.name for s in self.slots.segments])
            if self.slots.device is not None:
                for t in self.slots.device.data:
                    self.slots.device.memory.unlink(t)
        self.slots.attached |= set(self.readers)

    def put(self, b: Bucket, slot: int, pending: list[Pending], at: Transfer) -> None:
        assert self.chan is not None
        seg = self.slots.segments[slot]
        data = self.slots.data(slot)[: b.nbytes]
        seg.mark(b.index, self.plan.manifest.weights_version, b.nbytes)  # before the readers hear of it
        # both hash the source, never the slot (see copy_hash)
        write_slot = functools.partial(copy_hash, hash_source=True) if self.slots.device is None \
            else functools.partial(device_copy_hash, memory=self.slots.device.memory, hash_source=True)
        write_slot(b, data, in_tensors(self.plan.sources), self.hasher, filled=both(
            announcer(self.chan, self.readers, b.index, slot), self.net_filler(b, data, pending, at)))


class SlotsReceive(HashedReceive):
    """A reader's side: copy (and hash) every bucket out of the slots of ``writer`` (the
    sender, or this node's relay), following the writer's ``ready`` signals."""

    def __init__(self, stream: Stream, offer: Offer, writer: int, *, relayed: bool, manifest: Manifest,
                 hasher: StreamHasher, damage: Callable[[bool], bool]) -> None:
        super().__init__(hasher)
        self.stream = stream
        self.offer = offer
        self.writer = writer
        self.relayed = relayed
        self.manifest = manifest
        self.damage = damage
        self.chan: Channel | None = None
        self.opened = False

    def open(self, flat: torch.Tensor, at: Transfer) -> None:
        comm = self.stream.comm
        at.stage = "attach"
        self.opened = True
        try:
            self.mapped = mappings(self.offer, comm, relayed=self.relayed)
        finally:
            # hello even when the slots could not be mapped: the writer hears only ranks that said
            # hello, so the "failed" that follows ends its wait at once instead of at the deadline
            self.chan = Channel.connect(self.offer.endpoint, comm.rank, group=comm.group, version=comm.version,
                                        writer=self.writer)
            self.chan.send({"kind": "hello", "rank": comm.rank, "pid": os.getpid()})
        self.follow = Follower(self.chan, self.stream, {self.writer: self.offer.pid}, len(self.mapped.segments))

    def read(self, b: Bucket, flat: torch.Tensor, at: Transfer) -> None:
        comm = self.stream.comm
        assert self.chan is not None
        slot = self.follow.start(b.index, b.nbytes, at.stage)
        seg = self.mapped.segments[slot]
        if seg.group_version() != comm.version:
            raise StaleGroupVersion(comm.group, got=seg.group_version(), current=comm.version,
                                    peer=f"shared-memory segment {seg.name!r}")
        holds = seg.holds()
        wv = self.manifest.weights_version
        if holds != (b.index, wv, b.nbytes):
            raise ManifestError(
                f"shared-memory segment {seg.name!r} holds bucket {holds[0]} of weights version {holds[1]} "
                f"({holds[2]} bytes), expected bucket {b.index} of {wv} ({b.nbytes} bytes)", field="segment")
        # chaos: this reader sees a damaged segment. Damaged in its own copy, not in the segment:
        # the other readers must get the bytes as sent (two readers flipping the shared byte
        # would restore it, and neither would notice).
        damage = self.damage(bool(b.segments))
        if self.mapped.device is None:
            copy_hash(b, flat[b.start : b.stop], in_bucket(seg.data), self.hasher, awaiting=self.follow.awaiting,
                      damage=damage)
        else:
            data = self.mapped.data(slot)
            if data.numel() < b.nbytes:
                raise ManifestError(f"the device memory of slot {slot} ({seg.name!r}) holds {data.numel()} bytes, "
                                    f"fewer than bucket {b.index}'s {b.nbytes}", field="handles")
            device_copy_hash(b, flat[b.start : b.stop], in_bucket(data), self.hasher, self.mapped.device.memory,
                             awaiting=self.follow.awaiting, damage=damage)
        self.follow.awaiting(b.nbytes)  # the writer's last word on this bucket, before the next one's
        self.bucket_digests.append(self.hasher.bucket_digest(b))
        self.chan.send({"kind": "released", "bucket": b.index})
        at.bucket_done()

    def failed(self, at: Transfer, exc: BaseException) -> None:
        tell_writer(self.chan, at, exc)
        if self.opened and self.offer.segments and not pid_alive(self.offer.pid):
            unlink_names(self.offer.segments)  # a writer SIGKILLed before it could unlink its own

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()


def tell_writer(chan: Channel | None, at: Transfer, exc: BaseException) -> None:
    """A reader's failure, told to the writer it follows (one that is gone: nothing to tell)."""
    if chan is not None and not isinstance(exc, PeerLost):
        with contextlib.suppress(TransportError):
            chan.send({"kind": "failed", "reason": f"{type(exc).__name__} during {at.stage}: {exc}"[:500]})


__all__ = ["MAPPED", "RELAYING", "Device", "Mapped", "Slots", "SlotsReceive", "SlotsSend", "drop", "drop_mappings",
           "drop_relay_slots", "drop_slots", "mappings", "new_slots", "relay_slots", "require_host_memory",
           "slot_memory", "slots_for", "tell_writer", "unmap"]
