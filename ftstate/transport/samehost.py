"""The same-host route: buckets written once into shared memory and read by every receiver on the host.

On one host a TCP loopback broadcast copies every byte through the kernel twice per
receiver; here the sender copies each bucket once into a shared-memory slot
(:mod:`ftstate.transport.shm`) and every same-host receiver copies it once out of it, with
the checksum computed on the way (:data:`PIECE`-sized pieces: each piece is hashed right
after it is copied, while it is still in cache, so verification costs no extra trip
through memory). Receivers on other hosts get the same buckets over the communicator
(point to point from the same slot), so one transfer can mix both::

    sender (rank s)                               same-host reader r    collective rank c
    ---------------                               ------------------    -----------------
    manifest (collective)  ─────────────────────▶ validate              validate
    offer: segments, signal endpoint, routes ───▶ map the segments,     (nothing to map)
                                                  hello (zmq) ──────▶
    bucket k: wait slot k%2 released, mark it,
      copy + hash into it ────── ready k, upto ─▶ check the slot's header, copy + hash
        (every STREAM bytes)     (zmq)            out of it up to there, wait for more
                             ◀── released k ───── once all of it is out
                             ── each NET_CHUNK as it fills ───────────▶ receive, hash each
                                (collective, tag)                         chunk as it lands
    seal (collective)      ─────────────────────▶ compare every checksum
    vote (collective)      ◀───────────────────▶ the commit point, as on the broadcast route

**Relays: one copy per remote node.** When several receivers share a node other than the
sender's, the plan (:mod:`ftstate.core.plan`) makes one of them that node's *relay*: the
sender's offer names it and its peers (``relays``), and only the relay gets the buckets over
the collective. It answers the offer with an offer of its own (:class:`Offer`, sent point to
point to the sender and to each peer, tags from :data:`RELAY_TAG`) naming *its* segments,
and writes every bucket it receives into them for its peers, who read them exactly as they
would read the sender's (the same reader, slots, signals and checks)::

    sender (rank s)                 relay r (node B)                      peer p (node B)
    offer (relays: r → [p]) ──────▶ make its slots, bind its signals
                            ◀────── its offer (or why not) ─────────────▶ map r's slots, hello r
    bucket k, chunk by chunk ─────▶ receive (WINDOW posted); each chunk
      (send, tag)                   hashed and copied into its slot k%2
                                    as it lands ──────── ready k, upto ─▶ copy + hash out
                                                      ◀─ released k ────
    seal, vote (collective) ◀─────▶ compare, vote                ◀──────▶ compare with the
                                                                          *sender's* seal, vote

The relay verifies what it holds like any receiver, and its peers trust it with nothing: the
seal they compare against comes from the sender over the collective, so a relay that hands
on damaged bytes is rejected by every peer it damaged. While its peers copy bucket k out,
the next buckets keep arriving into the relay's own staging, so the network leg does not
wait for them. Its segments carry its pid and the group version like the sender's; a SIGKILLed
relay is seen by its peers within one slice of a wait (its pid), who then unlink whatever of
its segments is still named and unmap the rest; the sender sees its broken connection. A relay
that cannot make its segments says so in its offer: with ``require_shm`` every side raises
:class:`~ftstate.core.errors.SharedMemoryUnavailable`, else its peers get the buckets from the
sender over the collective and :attr:`SyncReport.shm_fallback` names the relay and why.

The manifest, seal and vote are exactly the broadcast route's (:mod:`ftstate.transport.sync`),
on the communicator: they stay ordered with the group version's membership and fencing, and
the receiver commits with the same code (``Receiver._conclude``). Only the buckets'
bytes take shared memory; the per-bucket ready / released signals take pyzmq
(:mod:`ftstate.transport.signals`), not Ray calls and not the collective (which would need
an operation per reader per bucket and cannot wait on "any reader").

**Streaming.** A bucket is read while it is written: the writer marks the slot's header
first, then says how far it has filled it every :data:`STREAM` bytes (``ready`` with
``upto``), and its readers copy each piece as soon as it is there. A reader releases the
slot after the writer's last word on it (``upto`` equal to the bucket's size). Without it a
transfer of one bucket would be written, then read, with nothing overlapping. Collective
ranks get each bucket the same way, in :data:`NET_CHUNK` messages sent as they are filled
and hashed as they land; a relay hands each one on to its peers as it lands.

**Double buffering.** Two slots (one when the transfer is a single bucket): bucket k is
written into slot k % 2 once every reader
released bucket k - 2 and its collective sends completed, so the sender fills one slot while
the readers copy out of the other.

**Fencing.** The offer is stamped with the group version (an older one raises
:class:`~ftstate.core.errors.StaleGroupVersion`); a segment's name and header carry the
group version it was made for and are checked before it is mapped, and each slot's header
says which bucket of which weights version it holds before a reader copies it.

**Failure.** Each wait is sliced (:data:`POLL_S`); between slices it looks at the
transfer's deadline (``sync_timeout_s`` / ``failover_timeout_s``: :class:`SyncTimeout`), at
abandonment by the controller (:class:`CommunicatorAborted`) and at whether the process on
the other end is still alive: the readers and the sender are on one host, so a pid tells
(:class:`PeerLost` naming the rank within one slice of a SIGKILL, with no call pending
anywhere). A side that fails tells the other side (``failed``), aborts its communicator and
unlinks: the sender its own segments, a reader the segments of a sender that died. Nothing
is committed by anyone before the vote.

**One node copy** (``node_copy_owner``, the runtime's ``staging: node``; see
:mod:`ftstate.transport.nodecopy`). Instead of two recycled slots, the sender writes every
bucket once at its place in one full-size segment holding the whole flat layout, and the
same-host readers hash it *in place* as the writer announces it (same ``ready``/``upto``
signals, one "slot"), copying nothing: their staging is that segment, and what they commit
are views into it (``Receiver._conclude(node=...)``, no spare buffer kept). Only after the
last bucket does a reader say ``released``, so a reader that dies is still named before the
seal. After a vote every rank passed the copy stays named (the source of newcomers on the
node); after any other outcome it is unlinked, by the writer, or by a reader that finds the
writer dead. Receivers on other nodes get their chunks sent from the same copy.

**Device memory.** When the communicator's device has memory other processes on the host
can map (:func:`~ftstate.transport.cudaipc.device_memory_for`: CUDA IPC for ``cuda``), the
slots' data lives there instead of in ``/dev/shm``: each slot keeps its segment as a header
only (so its name, group version, ``mark``/``holds``, unlinking and sweeping are exactly
the host slots'), the writer allocates and exports the data, the offer carries one handle
per slot (``handles``), and each reader opens them once, kept with its mapping of the
headers and dropped on the same paths. The bytes stay on the device: the writer copies a
bucket into the slot, synchronizes, and only then says ``ready`` (once per bucket, not
streamed: see :func:`_device_copy_hash`); a reader copies it into its staging on its own
device, synchronizes, hashes, and only then releases. Relays keep their slots in ``/dev/shm``.

**Shared memory unavailable** (no ``/dev/shm``, full, too small; device memory that cannot
be allocated or exported; weights on a device with no such memory, i.e. not ``cpu`` and not
``cuda``): with ``require_shm`` the sender raises
:class:`~ftstate.core.errors.SharedMemoryUnavailable`; otherwise those receivers take the
collective for this transfer and :attr:`SyncReport.shm_fallback` says why (the controller
records it in the audit trail). A relay on a GPU cannot make its slots (they are host
memory), which is the same case. A reader that is offered device slots and has no device
memory of its own raises it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import re
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ftstate.core.errors import (
    DeadlineExceeded,
    ManifestError,
    PeerLost,
    SharedMemoryUnavailable,
    StaleGroupVersion,
    TransportError,
)
from ftstate.transport import auth
from ftstate.transport.base import Communicator, Pending
from ftstate.transport.buckets import Bucket, bucket_segments, plan_layout
from ftstate.transport.buckets import Segment as BucketSegment
from ftstate.transport.checksum import (
    StreamHasher,
    byte_view,
    combine,
    dtype_name,
    function_for,
    function_of,
    host_bytes,
    host_copied_bytes,
)
from ftstate.transport.cudaipc import DeviceMemory, device_memory_for
from ftstate.transport.hashing import feed_bucket, hasher_for, own_state_checksum, verify
from ftstate.transport.hostmem import copy_bytes
from ftstate.transport.manifest import (
    MAX_BUCKET_SIZE,
    WIRE_FORMAT,
    Manifest,
    Seal,
    decode_manifest,
    decode_seal,
    encode_manifest,
    encode_seal,
    new_transfer_id,
    short,
)
from ftstate.transport.nodecopy import NodeCopy, forget_mappings, is_copy
from ftstate.transport.shm import SHM_DIR, Segment, pid_alive, segment_name, unlink_names
from ftstate.transport.signals import Channel
from ftstate.transport.stream import (
    SIDE_TAG,
    VOTE_CHECKSUM_MISMATCH,
    VOTE_COMMIT,
    BroadcastStream,
    PeerStream,
    Stream,
    peer_of,
    side_stream,
    with_stage,
)
from ftstate.transport.sync import Receiver, Sender, zero_padding
from ftstate.transport.weights import WINDOW, CommittedWeights, Progress, SyncReport

#: How often a wait on a signal looks at the deadline, at abandonment and at the peer's pid.
POLL_S = 0.02

#: Bytes copied then hashed at a time: the hash reads each piece back from cache (L2 is 2 MiB
#: here; measured at 256 MiB, 2 readers: 128 KiB pieces 141 ms, 512 KiB 128 ms, 2 MiB 110 ms).
PIECE = 2 * 1024 * 1024

#: A writer tells its readers how far it has filled a slot every this many bytes, so they
#: copy a bucket out while it is still being written instead of after it (one bucket of
#: 256 MiB would otherwise be written, then read: nothing overlaps).
STREAM = 8 * 1024 * 1024

#: Tags of the buckets sent point to point to collective ranks (the peer route's messages
#: use small sequence numbers, so the two never meet): the n-th chunk of the transfer is
#: tagged ``NET_TAG + n``.
NET_TAG = 1 << 20

#: A bucket goes to a collective rank in messages of this many bytes, each sent as soon as the
#: sender has it (copied and hashed) and hashed by the receiver as soon as it lands, so
#: sending, the network and the receiver's hash overlap even for a transfer of one bucket.
NET_CHUNK = 8 * 1024 * 1024

#: First tag of a relay's offer to the sender and to each of its peers (header, then body).
RELAY_TAG = SIDE_TAG

_generations = itertools.count(1)


# -- the offer -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    """What the sender tells every receiver after the manifest: how each one gets the buckets."""

    group: str
    group_version: int
    pid: int
    endpoint: str
    segments: tuple[str, ...]
    fresh: bool
    shm: tuple[int, ...]
    collective: tuple[int, ...]
    fallback: str | None = None
    #: ``(relay rank, its peers' ranks)``: the relay gets the buckets over the collective and
    #: writes them into its own node's shared memory for its peers (see :class:`_Relay`).
    relays: tuple[tuple[int, tuple[int, ...]], ...] = ()
    #: ``shared_memory: require``: a relay that cannot make its segments fails the transfer.
    require: bool = False
    #: The bytes of one point-to-point message to a collective rank: each bucket goes as
    #: ``ceil(nbytes / chunk)`` messages, tagged :data:`NET_TAG` + their index in the transfer.
    chunk: int = 0
    #: One handle per slot when the slots' data is in device memory (:mod:`~ftstate.transport.cudaipc`;
    #: ``segments`` are then their headers only); empty for slots in ``/dev/shm``.
    handles: tuple[bytes, ...] = ()
    #: ``staging: node``: the node copy the readers in ``shm`` verify in place (no slots, no
    #: private staging; :mod:`ftstate.transport.nodecopy`), and the pid of its owner.
    node_copy: str = ""
    owner: int = 0
    #: the writer keeps the previous copy as the next one's (``node_copy_spare``): a reader
    #: keeps its mapping of each file for the next time it is used
    recycled: bool = False


def encode_offer(o: Offer) -> bytes:
    return msgpack.packb(
        {"kind": "offer", "format": WIRE_FORMAT, "group": o.group, "group_version": o.group_version,
         "pid": o.pid, "endpoint": o.endpoint, "segments": list(o.segments), "fresh": o.fresh,
         "shm": list(o.shm), "collective": list(o.collective), "fallback": o.fallback,
         "relays": [[r, list(peers)] for r, peers in o.relays], "require": o.require, "chunk": o.chunk,
         "handles": list(o.handles), "node_copy": o.node_copy, "owner": o.owner,
         "recycled": o.recycled},
        use_bin_type=True,
    )


#: Caps on an offer's fields (a hostile or broken peer must not make its decoding the problem).
MAX_RANK = 1 << 16
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_HANDLE_BYTES = 4096
_ENDPOINT = re.compile(r"tcp://127\.0\.0\.1:([0-9]{1,5})")


def decode_offer(payload: bytes, *, group: str, group_version: int) -> Offer:
    """Validate an offer; :class:`ManifestError` naming the field, :class:`StaleGroupVersion`.

    Every field is checked for type and range before anything uses it (a pid goes to
    ``os.kill``, an endpoint to zmq, segment names to ``/dev/shm``): pids in [1, MAX_PID],
    ranks in [0, MAX_RANK), the endpoint on loopback with a valid port, at most two slots."""
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ManifestError(f"malformed offer: not msgpack: {short(str(exc))}") from exc
    if not isinstance(d, dict) or d.get("kind") != "offer":
        raise ManifestError("malformed offer: field 'kind': expected 'offer'", field="kind")

    def bad(name: str, value: Any, expected: str) -> ManifestError:
        return ManifestError(f"malformed offer: field {name!r}: expected {expected}, got {short(value)}", field=name)

    def need(name: str, kind: type | tuple[type, ...]) -> Any:
        value = d.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(name, value, getattr(kind, "__name__", str(kind)))
        return value

    def ranks(name: str, items: Any, cap: int = MAX_RANK) -> tuple[int, ...]:
        if not isinstance(items, list) or len(items) > cap \
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_RANK for x in items):
            raise bad(name, items, f"a list of at most {cap} ranks in [0, {MAX_RANK})")
        return tuple(items)

    if need("format", int) != WIRE_FORMAT:
        raise bad("format", d["format"], str(WIRE_FORMAT))
    if need("group", str) != group:
        raise bad("group", d["group"], repr(group))
    gv = need("group_version", int)
    if gv < group_version:
        raise StaleGroupVersion(group, got=gv, current=group_version, peer="the sender's offer")
    if gv > group_version:
        raise ManifestError(f"malformed offer: field 'group_version': {short(gv)} is newer than {group_version}",
                            field="group_version")
    pid = need("pid", int)
    if not 1 <= pid <= MAX_PID:
        raise bad("pid", pid, f"a pid in [1, {MAX_PID}]")
    endpoint = need("endpoint", str)
    match = _ENDPOINT.fullmatch(endpoint)
    if endpoint and (match is None or not 0 < int(match.group(1)) < 65536):
        raise bad("endpoint", endpoint, "'' or tcp://127.0.0.1:<port>")
    segments = need("segments", list)
    if len(segments) > 2 or not all(isinstance(x, str) and 0 < len(x) <= 255 for x in segments):
        raise bad("segments", segments, "at most two segment names")
    shm_ranks = ranks("shm", d.get("shm"))
    collective = ranks("collective", d.get("collective"))
    fallback = d.get("fallback")
    if fallback is not None and not (isinstance(fallback, str) and len(fallback) <= 4096):
        raise bad("fallback", fallback, "null or a reason")
    chunk = need("chunk", int)
    if not 0 <= chunk <= MAX_BUCKET_SIZE:
        raise bad("chunk", chunk, f"a number of bytes in [0, {MAX_BUCKET_SIZE}]")
    relays = []
    raw_relays = need("relays", list)
    if len(raw_relays) > MAX_RANK:
        raise bad("relays", raw_relays, f"at most {MAX_RANK} relays")
    for item in raw_relays:
        if not (isinstance(item, list) and len(item) == 2):
            raise bad("relays", item, "[relay rank, [peer ranks]]")
        relays.append((ranks("relays", [item[0]], 1)[0], ranks("relays", item[1])))
    handles = need("handles", list)
    if not all(isinstance(h, bytes) and len(h) <= MAX_HANDLE_BYTES for h in handles) \
            or len(handles) not in (0, len(segments)):
        raise ManifestError(f"malformed offer: field 'handles': expected none or one handle (bytes) per segment "
                            f"({len(segments)}), got {short(handles)}", field="handles")
    node_copy = need("node_copy", str)
    owner = need("owner", int)
    if node_copy and (not is_copy(node_copy) or not 1 <= owner <= MAX_PID or segments):
        raise bad("node_copy", node_copy, f"'' or a node copy's name, with its owner's pid in [1, {MAX_PID}] "
                                          "and no slots")
    return Offer(group, gv, pid, endpoint, tuple(segments), need("fresh", bool),
                 shm_ranks, collective, fallback, tuple(relays), need("require", bool), chunk,
                 tuple(handles), node_copy, owner, need("recycled", bool))


# -- the segments each side keeps ------------------------------------------------------------


@dataclass
class _Slots:
    """The sender's two slots for one group version, and the readers that mapped them."""

    group: str
    version: int
    capacity: int
    segments: list[Segment]
    attached: set[int] = field(default_factory=set)
    #: Where the slots' data is when not in their segments (see :class:`_Device`).
    device: _Device | None = None

    def data(self, slot: int) -> torch.Tensor:
        return self.segments[slot].data if self.device is None else self.device.data[slot]


@dataclass
class _Mapped:
    """A reader's mappings of the sender's current slots."""

    group: str
    version: int
    names: tuple[str, ...]
    segments: list[Segment]
    device: _Device | None = None

    def data(self, slot: int) -> torch.Tensor:
        return self.segments[slot].data if self.device is None else self.device.data[slot]


@dataclass
class _Device:
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
_MAPPED: dict[tuple[str, int, bool], _Mapped] = {}

#: The slots this process writes as its node's relay, by group (kept between transfers, like
#: a sender's, so its peers keep their mappings).
_RELAYING: dict[str, _Slots] = {}


def _drop(slots: _Slots | None) -> None:
    if slots is not None:
        unlink_names([s.name for s in slots.segments])
        for s in slots.segments:
            s.close()
        if slots.device is not None:
            slots.device.release()


def drop_slots(sender: Sender) -> None:
    """Unlink (if still named) and unmap the sender's slots."""
    slots, sender._samehost = sender._samehost, None
    _drop(slots)


def _unmap(group: str | None, writer: int | None = None, relayed: bool | None = None) -> None:
    for key in [k for k in _MAPPED if (group is None or k[0] == group) and (writer is None or k[1] == writer)
                and (relayed is None or k[2] == relayed)]:
        m = _MAPPED.pop(key)
        for s in m.segments:
            s.close()
        if m.device is not None:
            m.device.release()


def _drop_relay_slots(group: str | None) -> None:
    for key in [k for k in _RELAYING if group is None or k == group]:
        _drop(_RELAYING.pop(key))


def drop_mappings(group: str | None = None) -> None:
    """Everything of the route this process holds as a receiver (of ``group``, or all): unmap
    the segments it mapped, and unlink and unmap the slots it wrote as a relay."""
    _unmap(group)
    _drop_relay_slots(group)


def _fits(s: _Slots | None, comm: Communicator, capacity: int, count: int, readers: set[int],
          memory: DeviceMemory | None = None) -> bool:
    return s is not None and (s.group, s.version) == (comm.group, comm.version) and s.capacity >= capacity \
        and len(s.segments) >= count and readers <= s.attached \
        and (s.device.memory if s.device is not None else None) is memory


def _slots_for(
    sender: Sender, comm: Communicator, capacity: int, count: int, readers: set[int],
    memory: DeviceMemory | None = None,
) -> tuple[_Slots, bool]:
    """The sender's ``count`` (1 or 2) slots for this group version (new ones when too few,
    too small, or when a reader has not mapped them), and whether they are new. One slot when
    the transfer is one bucket: each new slot costs a zeroed allocation of its size."""
    if _fits(sender._samehost, comm, capacity, count, readers, memory):
        return sender._samehost, False
    drop_slots(sender)
    sender._samehost = _new_slots(comm, capacity, count, memory)
    return sender._samehost, True


def _relay_slots(comm: Communicator, capacity: int, count: int, peers: set[int]) -> tuple[_Slots, bool]:
    """:func:`_slots_for`, for this process as its node's relay."""
    if _fits(_RELAYING.get(comm.group), comm, capacity, count, peers):
        return _RELAYING[comm.group], False
    _drop_relay_slots(comm.group)
    _RELAYING[comm.group] = _new_slots(comm, capacity, count)
    return _RELAYING[comm.group], True


def _require_host_memory(comm: Communicator, capacity: int) -> None:
    if comm.device.type != "cpu":
        raise SharedMemoryUnavailable(
            path=str(SHM_DIR), nbytes=2 * capacity,
            problem=f"the weights are on {comm.device}: these slots hold host memory (a relay's always do)")


def _slot_memory(comm: Communicator, capacity: int) -> DeviceMemory | None:
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
        _require_host_memory(comm, capacity)
    return memory


def _new_slots(comm: Communicator, capacity: int, count: int, memory: DeviceMemory | None = None) -> _Slots:
    """``count`` new slots; with ``memory`` their segments are headers only and their data is
    allocated (and exported) there (a failure there: :class:`SharedMemoryUnavailable`)."""
    generation = next(_generations)
    made: list[Segment] = []
    device = _Device(memory, []) if memory is not None else None
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
    return _Slots(comm.group, comm.version, capacity, made, device=device)


def _mappings(offer: Offer, comm: Communicator, *, relayed: bool) -> _Mapped:
    """The writer's slots that ``offer`` names, mapped (kept from its last transfer when they
    are the same). ``relayed``: the writer is this node's relay, not the transfer's sender. One
    process can write both kinds (a rollout that sent a newcomer its weights point to point,
    then relays the next sync), and each kind keeps its own slots, so each gets its own entry."""
    key = (comm.group, offer.pid, relayed)
    m = _MAPPED.get(key)
    if m is not None and m.names == offer.segments and m.version == comm.version \
            and (m.device.handles if m.device is not None else ()) == offer.handles:
        return m
    _unmap(comm.group, offer.pid, relayed)
    if not offer.fresh:
        raise ManifestError(f"rank {comm.rank}: the offer names segments {list(offer.segments)} this member "
                            "never mapped and that are gone", field="segments")
    if len(offer.segments) not in (1, 2):
        raise ManifestError(f"malformed offer: field 'segments': expected 1 or 2 slots, got {len(offer.segments)}",
                            field="segments")
    segs: list[Segment] = []
    device: _Device | None = None
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
            device = _Device(memory, [], offer.handles)
            for h in offer.handles:
                device.data.append(memory.open(h, comm.device))
    except BaseException:
        for s in segs:
            s.close()
        if device is not None:
            device.release()
        raise
    m = _MAPPED[key] = _Mapped(comm.group, comm.version, offer.segments, segs, device)
    return m


# -- moving the bytes ----------------------------------------------------------------------


#: Test hook (the tamper test and the mutation check): called by a writer with each piece of a
#: slot right after copying it there, before it is hashed or announced -- the window in which a
#: stray or hostile write into the slot lands. None outside tests.
after_slot_copy: Callable[[torch.Tensor], None] | None = None


def _copy_hash(b: Bucket, dst: torch.Tensor, src: Callable[[BucketSegment], torch.Tensor], hasher: StreamHasher | None,
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


def _device_copy_hash(b: Bucket, dst: torch.Tensor, src: Callable[[BucketSegment], torch.Tensor],
                      hasher: StreamHasher | None, memory: DeviceMemory, *, hash_source: bool = False,
                      filled: Callable[[int], None] | None = None, awaiting: Callable[[int], None] | None = None,
                      damage: bool = False) -> None:
    """:func:`_copy_hash` where the slot is in device memory (the writer's ``dst``, or the
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
    :func:`_copy_hash`."""
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
        _hash(b, dst, hasher)


def _in_bucket(data: torch.Tensor) -> Callable[[BucketSegment], torch.Tensor]:
    """Segment ``s``'s bytes in ``data``, a view of the whole bucket's bytes."""
    return lambda s: data[s.bucket_offset : s.bucket_offset + s.length]


def _in_tensors(sources: Sequence[torch.Tensor]) -> Callable[[BucketSegment], torch.Tensor]:
    """Segment ``s``'s bytes in the tensor it belongs to (each a flat uint8 view)."""
    return lambda s: sources[s.tensor][s.start : s.start + s.length]


def _announcer(chan: Channel, readers: Sequence[int], bucket: int, slot: int) -> Callable[[int], None]:
    """What a writer calls as it fills ``slot`` with ``bucket``: tells every reader how far it got."""
    def filled(upto: int) -> None:
        for r in readers:
            chan.send({"kind": "ready", "bucket": bucket, "slot": slot, "upto": upto}, to=r)
    return filled


def _hash(bucket: Bucket, data: torch.Tensor, hasher: StreamHasher | None) -> None:
    """Feed all of the bucket's bytes (``data``) to their tensors' hashers (none: nothing)."""
    if hasher is not None:
        feed_bucket(hasher, bucket, data)


def _chunks(buckets: Sequence[Bucket], chunk: int) -> list[tuple[Bucket, int, int]]:
    """Every bucket cut into ``(bucket, lo, hi)`` messages of ``chunk`` bytes, in transfer order
    (the n-th is tagged ``NET_TAG + n`` by both sides)."""
    return [(b, lo, min(lo + chunk, b.nbytes)) for b in buckets for lo in range(0, b.nbytes, chunk)]


class _NetSends:
    """The sender's messages to its collective ranks: each chunk is posted once it is filled."""

    def __init__(self, route: Stream, net: Sequence[int], buckets: Sequence[Bucket], chunk: int) -> None:
        self.route = route
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
        comm = self.route.comm

        def filled(upto: int) -> None:
            nonlocal sent
            while sent < b.nbytes and (upto == b.nbytes or sent + self.chunk <= upto):
                hi = min(sent + self.chunk, b.nbytes)
                tag = NET_TAG + self.first[b.index] + sent // self.chunk
                pending.extend(comm.send(data[sent:hi], r, tag=tag, timeout_s=self.route.remaining(stage))
                               for r in self.net)
                sent = hi
        return filled


def _both(*calls: Callable[[int], None] | None) -> Callable[[int], None] | None:
    live = [c for c in calls if c is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def both(upto: int) -> None:
        for c in live:
            c(upto)
    return both


def _check(route: Stream, stage: str, pids: Mapping[int, int]) -> None:
    """Between two slices of a wait: the deadline, abandonment, and the other end's pids."""
    comm = route.comm
    route.remaining(stage)  # raises SyncTimeout past the deadline
    if comm.aborted:
        raise comm.aborted_error()
    for rank, pid in pids.items():
        if not pid_alive(pid):
            raise PeerLost(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: rank {rank} (pid {pid}, same host) "
                f"died during {stage}",
                group=comm.group, group_version=comm.version, rank=comm.rank, op=stage, peer=rank,
            )


# -- sender ----------------------------------------------------------------------------------


class _Waiter:
    """The sender's view of the two slots: which bucket each holds, who has not released it."""

    def __init__(self, route: Stream, chan: Channel | None, pids: dict[int, int], nslots: int) -> None:
        self.route = route
        self.chan = chan
        self.pids = pids
        self.nslots = nslots
        self.busy: list[tuple[int, set[int], list[Pending]] | None] = [None, None]
        self.expected: set[int] = set()

    def hellos(self, readers: Sequence[int], stage: str) -> None:
        assert self.chan is not None
        self.expected = set(readers)
        while not self.expected <= set(self.pids):
            msg = self.chan.recv(POLL_S)
            if msg is None:
                _check(self.route, stage, self.pids)
                continue
            self._handle(msg, stage)

    def free(self, slot: int, stage: str) -> None:
        entry = self.busy[slot]
        if entry is None:
            return
        _, waiting, pending = entry
        while waiting:
            assert self.chan is not None
            msg = self.chan.recv(POLL_S)
            if msg is None:
                _check(self.route, stage, {r: self.pids[r] for r in waiting if r in self.pids})
                continue
            self._handle(msg, stage)
        for p in pending:
            p.wait()
        self.busy[slot] = None

    def _handle(self, msg: dict[str, Any], stage: str) -> None:
        comm = self.route.comm
        kind, rank = msg["kind"], msg["from"]
        if kind == "hello" and rank not in self.expected:  # a reader outside the plan: never let in
            if auth.enabled():
                auth.record_forged("signal", rank, group=comm.group, version=comm.version,
                                   problem="hello from a rank that is not a reader of this transfer")
                return
            raise ManifestError(f"bucket signal: hello from rank {rank}, which is not a reader of this transfer",
                                field="rank", peer=f"rank {rank}")
        if kind == "hello":
            pid = msg.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or not 1 <= pid <= MAX_PID:
                raise ManifestError(f"malformed bucket signal: hello from rank {rank} without a pid in "
                                    f"[1, {MAX_PID}]: {short(pid)}", field="pid", peer=f"rank {rank}")
            self.pids[rank] = pid
        elif kind == "released":
            index = msg.get("bucket")
            entry = self.busy[index % self.nslots] if isinstance(index, int) else None
            if entry is None or entry[0] != index:
                raise ManifestError(f"bucket signal: rank {rank} released bucket {index}, which it was not reading",
                                    field="bucket")
            entry[1].discard(rank)
        elif kind == "failed":
            raise PeerLost(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: rank {rank} gave the transfer up "
                f"during {stage}: {short(msg.get('reason'))}",
                group=comm.group, group_version=comm.version, rank=comm.rank, op=stage, peer=rank,
            )
        else:
            raise ManifestError(f"bucket signal: unexpected {kind!r} from rank {rank}", field="kind")


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
    progress: Progress | None = None,
    node_copy_owner: int | None = None,
    node_copy_spare: bool = False,
) -> SyncReport:
    """:meth:`Sender.broadcast` on this route: the ranks in ``same_host`` (on this member's
    host) read every bucket from shared memory; each rank of ``relays`` (relay rank → its
    node peers' ranks) gets it over the communicator and writes it into its node's shared
    memory for its peers; the others get it over the communicator. Receivers call
    :func:`receive`. Same manifest, checksums, vote and errors; in addition
    :class:`~ftstate.core.errors.SharedMemoryUnavailable` with ``require_shm`` when a
    segment (here or at a relay) cannot be made (else those ranks take the collective, said
    in :attr:`SyncReport.shm_fallback`). ``timeout_s`` bounds the whole transfer.

    ``node_copy_owner`` (``staging: node``): the same-host ranks verify the version in place
    in one node copy owned by that process (:mod:`ftstate.transport.nodecopy`) instead of
    copying it out of two slots; one that cannot be made falls back to the slots (said in
    :attr:`SyncReport.shm_fallback`; with ``require_shm`` it raises). After a vote every rank
    passed, the node copy this sender wrote before is unlinked and this one kept
    (:attr:`SyncReport.node_copy` names it); after any other outcome this one is unlinked.
    ``node_copy_spare``: the one written before is kept instead (named, mapped; the
    report's ``node_spare``) and rewritten as the next one, so a sync allocates nothing."""
    route = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=comm.rank, sending=True)
    return _send(sender, route, weights, weights_version, progress, same_host=frozenset(same_host),
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
    progress: Progress | None = None,
) -> SyncReport:
    """:meth:`Sender.send_to` a ``peer`` on this member's host, through shared memory (the
    peer calls :func:`receive` with ``point_to_point=True``)."""
    route = PeerStream(comm, time.monotonic() + timeout_s, timeout_s, peer=peer, sending=True)
    return _send(sender, route, weights, weights_version, progress, same_host=frozenset([peer]),
                 require_shm=require_shm)


def receive(
    receiver: Receiver, comm: Communicator, src: int, *, point_to_point: bool = False, timeout_s: float,
    progress: Progress | None = None, node_copy_owner: int | None = None,
) -> CommittedWeights:
    """Receive what ``src`` sends with :func:`broadcast` (or, with ``point_to_point``,
    :func:`send_to`): from shared memory when the sender's offer says so, else over the
    communicator. Same errors and guarantee as :meth:`Receiver.receive_broadcast`: on any
    error the receiver's committed weights are what they were. ``node_copy_owner``: when
    this member is its node's relay, it receives into a node copy owned by that process
    (:mod:`ftstate.transport.nodecopy`) which its peers verify in place, instead of slots;
    the committed state's ``_node`` names it."""
    if point_to_point:
        route: Stream = PeerStream(comm, time.monotonic() + timeout_s, timeout_s, peer=src, sending=False)
    else:
        route = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=src, sending=False)
    return _receive(receiver, route, progress, node_copy_owner)


def _send(
    sender: Sender,
    route: Stream,
    weights: Mapping[str, torch.Tensor] | CommittedWeights,
    weights_version: int | None,
    progress: Progress | None,
    *,
    same_host: frozenset[int],
    require_shm: bool,
    relays: Mapping[int, tuple[int, ...]] | None = None,
    node_copy_owner: int | None = None,
    node_copy_spare: bool = False,
) -> SyncReport:
    """One transfer on the same-host route (see the module docstring)."""
    comm = route.comm
    started, host_from = time.monotonic(), host_copied_bytes()
    tensors, weights_version, committed = sender._state_to_send(comm, weights, weights_version)
    comm.check_usable()
    names = list(tensors)
    sources = [byte_view(tensors[n]) for n in names]
    entries, windows, total = plan_layout(
        ((n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names), sender.bucket_size
    )
    buckets = bucket_segments(entries, windows)
    function = function_for(sources)
    manifest = Manifest(comm.group, comm.version, weights_version, sender.bucket_size, total, entries, windows,
                        new_transfer_id(), function)
    # Resending a committed state cut into the same buckets (a failover's resync): its verified
    # checksums go out again instead of hashing here; the receiver hashes what it reads.
    known = committed._seal if committed is not None and committed._entries == entries \
        and committed._windows == windows and function_of(committed.state_checksum) == function else None
    receivers = [r for r in range(comm.world_size) if r != comm.rank] if isinstance(route, BroadcastStream) \
        else [peer_of(route)]
    relays = {r: p for r, p in (relays or {}).items() if r in receivers}
    relayed = {p: r for r, peers in relays.items() for p in peers}
    readers = [r for r in receivers if r in same_host]
    net = [r for r in receivers if r not in same_host and r not in relayed]
    capacity = max([b.nbytes for b in buckets] + [1])
    slots: _Slots | None = None
    fresh = False
    fallback: str | None = None
    node: NodeCopy | None = None
    if readers and node_copy_owner is not None:
        try:
            _require_host_memory(comm, manifest.total_bytes)
            node = _next_node_copy(sender, comm, manifest, node_copy_owner, node_copy_spare)
        except SharedMemoryUnavailable as exc:
            if require_shm:
                comm.abort(f"shared memory unavailable: {exc.problem}")
                raise
            fallback = f"node copy: {exc}; the slots instead"  # the readers stage privately
    if readers and node is None:
        try:
            memory = _slot_memory(comm, capacity)
            slots, fresh = _slots_for(sender, comm, capacity, min(2, len(buckets)) or 1, set(readers), memory)
        except SharedMemoryUnavailable as exc:
            if require_shm:
                comm.abort(f"shared memory unavailable: {exc.problem}")
                raise
            fallback = str(exc)
            net, readers = sorted(net + readers), []
    routes = {**{r: "shm" for r in readers}, **{r: "collective" for r in net}, **{p: "relay" for p in relayed}}
    chan = Channel.bind(group=comm.group, version=comm.version, rank=comm.rank) if readers else None
    nslots = 1 if node is not None else len(slots.segments) if slots is not None and readers else 2
    waiter = _Waiter(route, chan, {}, nslots)
    node_pending: list[Pending] = []  # the node copy's sends, waited once after the last bucket
    hasher = hasher_for(manifest) if known is None else None
    digests: list[int] = []
    stage = "manifest"
    try:
        route.send_message(encode_manifest(manifest), stage)
        route.transfer = manifest.transfer
        stage = "offer"
        offer = Offer(comm.group, comm.version, os.getpid(), chan.endpoint if chan else "",
                      tuple(s.name for s in slots.segments) if slots and readers else (), fresh,
                      tuple(readers), tuple(net), fallback, tuple(sorted(relays.items())), require_shm, NET_CHUNK,
                      handles=slots.device.handles if slots and slots.device and readers else (),
                      node_copy=node.name if node is not None else "", owner=node_copy_owner if node else 0,
                      recycled=node is not None and node_copy_spare)
        route.send_message(encode_offer(offer), stage)
        if relays:
            stage = "relay offers"
            for r, peers in sorted(relays.items()):
                theirs = decode_offer(side_stream(route, r, sending=False).recv_message(stage),
                                      group=comm.group, group_version=comm.version)
                if theirs.fallback is not None:
                    if require_shm:
                        raise _relay_unavailable(r, theirs.fallback, capacity)
                    # the relay could not make its segments: its peers get the buckets from here
                    net = sorted(net + list(peers))
                    routes.update({p: "collective" for p in peers})
                    fallback = "; ".join(filter(None, [fallback, f"relay rank {r}: {theirs.fallback}"]))
        if node is not None:
            stage = "attach"
            waiter.hellos(readers, stage)  # the node copy keeps its name: a newcomer maps it later
        elif slots is not None and readers:
            stage = "attach"
            waiter.hellos(readers, stage)
            if fresh:  # every reader mapped them: the names go, the memory stays with the mappings
                unlink_names(offer.segments)
                if slots.device is not None:
                    for t in slots.device.data:
                        slots.device.memory.unlink(t)
            slots.attached |= set(readers)
        n = len(buckets)
        sends = _NetSends(route, net, buckets, NET_CHUNK)
        for b in buckets:
            stage = f"bucket {b.index + 1}/{n}"
            slot = b.index % nslots
            waiter.free(slot, stage)
            one = b.single
            pending: list[Pending] = []
            if node is not None:  # written once at its place in the layout; read in place
                assert chan is not None
                data = node.data[b.start : b.start + b.nbytes]
                _copy_hash(b, data, _in_tensors(sources), hasher, hash_source=True, filled=_both(
                    _announcer(chan, readers, b.index, 0), sends.filler(b, data, node_pending, stage) if net else None))
            elif slots is not None and readers:
                assert chan is not None
                seg = slots.segments[slot]
                data = slots.data(slot)[: b.nbytes]
                seg.mark(b.index, weights_version, b.nbytes)  # before the readers hear of it
                # both hash the source, never the slot (see _copy_hash)
                write_slot = functools.partial(_copy_hash, hash_source=True) if slots.device is None \
                    else functools.partial(_device_copy_hash, memory=slots.device.memory, hash_source=True)
                write_slot(b, data, _in_tensors(sources), hasher, filled=_both(
                    _announcer(chan, readers, b.index, slot),
                    sends.filler(b, data, pending, stage) if net else None))
            elif one is not None:  # collective only: a bucket that is one tensor goes from its memory
                data = sources[one.tensor][one.start : one.start + one.length]
                sends.filler(b, data, pending, stage)(b.nbytes)  # sent while it is hashed here
                _hash(b, data, hasher)
            else:
                data = sender._buffer(slot, b.nbytes, comm.device)
                _copy_hash(b, data, _in_tensors(sources), hasher, filled=sends.filler(b, data, pending, stage))
            digests.append(hasher.bucket_digest(b) if hasher is not None else known.bucket_checksums[b.index])
            if node is None:
                waiter.busy[slot] = (b.index, set(readers), pending)
            elif b.index == n - 1:  # nothing is recycled: the readers only say when they are through
                waiter.busy[0] = (b.index, set(readers), node_pending)
            if progress is not None:
                progress(b.index + 1, n)
        stage = "last buckets"
        waiter.free(0, stage)
        waiter.free(1, stage)
        tensor_sums = hasher.tensor_digests() if hasher is not None else list(known.tensor_checksums)
        state = combine((e.name, e.dtype, e.shape, h) for e, h in zip(entries, tensor_sums, strict=True))
        stage = "seal"
        seal = Seal(comm.group, comm.version, weights_version, tuple(digests), tuple(tensor_sums), state,
                    manifest.transfer)
        route.send_message(encode_seal(seal), stage)
        stage = "commit vote"
        votes = route.vote(VOTE_COMMIT, stage)
    except SharedMemoryUnavailable as exc:
        _sender_failed(sender, comm, chan, readers, stage, exc, node)
        raise
    except (TransportError, DeadlineExceeded) as exc:
        _sender_failed(sender, comm, chan, readers, stage, exc, node)
        raise with_stage(exc, stage, weights_version, route) from exc
    except BaseException as exc:
        _sender_failed(sender, comm, chan, readers, stage, exc, node)
        raise
    finally:
        if chan is not None:
            chan.close()
    report = sender._report(comm, manifest, state, len(buckets), started, votes, routes, fallback, host_from)
    if node is not None:
        written = _settle_node_copy(sender, node, committed=report.ok, keep_spare=node_copy_spare)
        if report.ok:
            report = dataclasses.replace(report, node_copy=node.name, node_copy_recycled=node.recycled,
                                         node_spare=written.spare.name if written.spare is not None else None)
    return report


@dataclass
class _Written:
    """The node copies a sender keeps: the committed one's, and (``node_copy_spare``) the one
    before it, kept named and mapped to be rewritten as the next."""

    committed: NodeCopy | None = None
    spare: NodeCopy | None = None


def _next_node_copy(sender: Sender, comm: Communicator, manifest: Manifest, owner: int, keep_spare: bool) -> NodeCopy:
    """The node copy this transfer writes: the sender's spare rewritten when it keeps one and
    it fits, else a new one (a spare that does not fit goes)."""
    written = sender._node_copy = sender._node_copy or _Written()
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


def _settle_node_copy(sender: Sender, node: NodeCopy, *, committed: bool, keep_spare: bool) -> _Written:
    """After the vote: a version every rank committed keeps its node copy (the source of
    newcomers on the node) and the one this sender wrote before goes, or with ``keep_spare``
    stays, named and mapped, as the next one's; any other outcome unlinks the new one (the
    ranks that committed it keep their mappings). Without a spare the writer's own mapping
    goes: it never reads the copy again."""
    written = sender._node_copy = sender._node_copy or _Written()
    if committed:
        old, written.committed = written.committed, node
        if old is not None and old is not node:
            if keep_spare and old._mm is not None:
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

def _sender_failed(sender: Sender, comm: Communicator, chan: Channel | None, readers: Sequence[int],
                   stage: str, exc: BaseException, node: NodeCopy | None = None) -> None:
    if chan is not None:
        for r in readers:
            # a reader that is gone or never said hello: its pid check or deadline ends it
            with contextlib.suppress(TransportError):
                chan.send({"kind": "failed", "reason": f"{type(exc).__name__} during {stage}"}, to=r)
    if node is not None:  # a failed version's node copy never stays
        node.unlink()
        node.close()
    drop_slots(sender)
    comm.abort(f"weight transfer failed during {stage}")


# -- receiver --------------------------------------------------------------------------------


def _relay_unavailable(relay: int, reason: str, capacity: int) -> SharedMemoryUnavailable:
    return SharedMemoryUnavailable(path=f"{SHM_DIR} (the segments of relay rank {relay})", nbytes=2 * capacity,
                                   problem=reason)


@dataclass
class _Receiving:
    """One receiver's transfer in progress: where it is, and what a failure must clean up."""

    stage: str = "manifest"
    #: the offer naming the segments it reads (the sender's or its relay's) and their writer's signals
    read: Offer | None = None
    chan: Channel | None = None
    relay: _Relay | None = None
    #: the node copy it verifies in place (``staging: node``)
    node: NodeCopy | None = None

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
        if self.relay is not None:
            self.relay.close()


class _Follower:
    """A reader's view of the slot its writer (the sender, or this node's relay) is filling:
    which slot holds bucket ``index`` and how many of its bytes are in place, from the
    writer's ``ready`` signals (several per bucket: the writer streams, see :data:`STREAM`)."""

    def __init__(self, chan: Channel, route: Stream, writer: dict[int, int], nslots: int) -> None:
        self.chan = chan
        self.route = route
        self.writer = writer
        self.nslots = nslots
        self.index = -1
        self.slot = -1
        self.nbytes = 0
        self.upto = 0
        self.stage = ""

    def start(self, index: int, nbytes: int, stage: str) -> int:
        """The slot that holds (or is being filled with) bucket ``index``, once its writer says so."""
        self.index, self.slot, self.nbytes, self.upto, self.stage = index, -1, nbytes, 0, stage
        self._next()
        return self.slot

    def awaiting(self, n: int) -> None:
        """Return once the first ``n`` bytes of the bucket are in its slot."""
        while self.upto < n:
            self._next()

    def _next(self) -> None:
        comm = self.route.comm
        while True:
            msg = self.chan.recv(POLL_S)
            if msg is None:
                _check(self.route, self.stage, self.writer)
                continue
            break
        kind = msg["kind"]
        if kind == "failed":
            peer = next(iter(self.writer))
            raise PeerLost(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: rank {peer}, whose shared memory it "
                f"reads, gave the transfer up during {self.stage}: {short(msg.get('reason'))}",
                group=comm.group, group_version=comm.version, rank=comm.rank, op=self.stage, peer=peer,
            )
        slot, upto = msg.get("slot"), msg.get("upto")
        if kind != "ready" or msg.get("bucket") != self.index or slot not in (0, 1)[: self.nslots] \
                or (self.slot >= 0 and slot != self.slot):
            where = f"slot {self.slot}" if self.slot >= 0 else "a slot"
            raise ManifestError(f"bucket signal: expected 'ready' for bucket {self.index} in {where}, "
                                f"got {msg!r:.80}", field="bucket")
        if not isinstance(upto, int) or not self.upto < upto <= self.nbytes:
            raise ManifestError(f"bucket signal: bucket {self.index} filled up to {upto!r}, expected more than "
                                f"{self.upto} and at most its {self.nbytes} bytes", field="upto")
        self.slot, self.upto = slot, upto


def _receive(receiver: Receiver, route: Stream, progress: Progress | None,
             node_copy_owner: int | None = None) -> CommittedWeights:
    """One transfer on the same-host route, into ``receiver`` (see the module docstring)."""
    comm = route.comm
    src = peer_of(route)
    kept = receiver._committed
    at = _Receiving()
    manifest: Manifest | None = None
    receiver._host_from = host_copied_bytes()
    comm.check_usable()
    try:
        manifest = decode_manifest(route.recv_message(at.stage), group=comm.group, group_version=comm.version)
        route.transfer = manifest.transfer
        at.stage = "offer"
        offer = decode_offer(route.recv_message(at.stage), group=comm.group, group_version=comm.version)
        buckets = bucket_segments(manifest.tensors, manifest.buckets)
        hasher = hasher_for(manifest, receiving=True)
        digests: list[int] = []
        peers = dict(offer.relays).get(comm.rank, ())
        relay = next((r for r, ps in offer.relays if comm.rank in ps), None)
        theirs: Offer | None = None  # its node relay's offer, for one of its peers
        if relay is not None and comm.rank not in offer.shm:
            at.stage = "relay offer"
            theirs = decode_offer(side_stream(route, relay, sending=False).recv_message(at.stage),
                                  group=comm.group, group_version=comm.version)
        if comm.rank in offer.collective and peers:
            at.relay = _Relay.start(route, at, manifest, buckets, peers, require=offer.require, owner=node_copy_owner)
        # where its staging is: a node copy it verifies in place (the sender's or its relay's),
        # the node copy it writes as its node's relay, or a private buffer
        reading = offer if comm.rank in offer.shm else theirs if theirs is not None and comm.rank in theirs.shm \
            else None
        if reading is not None and reading.node_copy:
            at.node = _map_node_copy(reading, comm, manifest, src if reading is offer else relay)
            staging = (at.node.data, 0)
        elif at.relay is not None and at.relay.node is not None:
            at.node = at.relay.node
            staging = (at.node.data, 0)
        if at.node is not None:  # no staging of its own: its peak is what it already keeps
            receiver._peak = receiver.held_bytes
        else:
            staging = receiver._staging(manifest.total_bytes, comm.device, route.deadline - time.monotonic())
            zero_padding(staging[0], manifest)
        flat = staging[0]
        if reading is not None and reading.node_copy:
            _verify_in_place(receiver, route, at, reading, src if reading is offer else relay, buckets, flat,
                             hasher, digests, progress)
        elif comm.rank in offer.shm:
            _read(receiver, route, at, offer, src, manifest, buckets, flat, hasher, digests, progress)
        elif theirs is not None:
            assert relay is not None
            if comm.rank in theirs.shm:
                _read(receiver, route, at, theirs, relay, manifest, buckets, flat, hasher, digests, progress)
            elif offer.require:
                raise _relay_unavailable(relay, theirs.fallback or "no segments offered", max(
                    [b.nbytes for b in buckets] + [1]))
            else:  # the relay could not make its segments: the sender sends to this rank as well
                _net(receiver, route, at, src, buckets, flat, hasher, digests, progress, offer.chunk)
        elif comm.rank in offer.collective:
            _net(receiver, route, at, src, buckets, flat, hasher, digests, progress, offer.chunk)
        else:
            raise ManifestError(f"malformed offer: rank {comm.rank} is in neither 'shm', 'collective' nor "
                                "'relays'", field="shm")
        at.stage = "seal"
        seal = decode_seal(route.recv_message(at.stage), manifest)
        at.stage = "checksums"
        tensor_sums = hasher.tensor_digests(seal.tensor_checksums)
        own = own_state_checksum(manifest, tensor_sums)
        problem = verify(manifest, seal, digests, tensor_sums, own)
        at.stage = "commit vote"
        route.vote(VOTE_COMMIT if problem is None else VOTE_CHECKSUM_MISMATCH, at.stage)
    except SharedMemoryUnavailable as exc:
        _receiver_failed(comm, at, exc)
        raise
    except (TransportError, DeadlineExceeded) as exc:
        _receiver_failed(comm, at, exc)
        wv = manifest.weights_version if manifest is not None else None
        raise with_stage(exc, at.stage, wv, route) from exc
    except BaseException as exc:
        _receiver_failed(comm, at, exc)
        raise
    finally:
        at.close()
    if at.relay is not None and at.relay.node is not None:  # the copy it wrote for its node's peers
        _relayed(comm.group, at.relay.node, committed=problem is None)
    return receiver._conclude(comm, manifest, seal, staging, kept, problem, own,
                              node=at.node.name if at.node is not None else None)


#: The node copy this process last wrote as its node's relay and committed, by group.
_RELAY_COPIES: dict[str, str] = {}


def _relayed(group: str, node: NodeCopy, *, committed: bool) -> None:
    """After the vote, as its node's relay: a copy it verified itself stays (the node's source
    for newcomers; the previous one goes), one it rejected goes. Whether its peers committed
    too is the controller's to settle (the node agent keeps only the committed copy)."""
    if committed:
        previous = _RELAY_COPIES.get(group)
        if previous not in (None, node.name):
            unlink_names([previous])
        _RELAY_COPIES[group] = node.name
    else:
        node.unlink()
    node.close()


def _map_node_copy(offer: Offer, comm: Communicator, manifest: Manifest, writer: int) -> NodeCopy:
    forget_mappings()  # of copies unlinked since (failed, replaced): their memory goes now
    node = NodeCopy.attach(offer.node_copy, group=comm.group, owner=offer.owner, group_version=comm.version,
                           writer=offer.pid, cache=offer.recycled)
    try:
        node.check_holds(manifest)
    except BaseException:
        node.close()
        raise
    return node


def _verify_in_place(
    receiver: Receiver, route: Stream, at: _Receiving, offer: Offer, writer: int, buckets: Sequence[Bucket],
    flat: torch.Tensor, hasher: StreamHasher, digests: list[int], progress: Progress | None,
) -> None:
    """Hash every bucket where the sender writes it in the node copy (``flat``, this
    member's private mapping of it), following the writer's ``ready`` signals a
    :data:`PIECE` at a time; nothing is copied. Says ``released`` once, after the last bucket."""
    comm = route.comm
    n = len(buckets)
    at.stage = "attach"
    at.read = offer
    at.chan = chan = Channel.connect(offer.endpoint, comm.rank, group=comm.group, version=comm.version,
                                     writer=writer)
    chan.send({"kind": "hello", "rank": comm.rank, "pid": os.getpid()})
    follow = _Follower(chan, route, {writer: offer.pid}, 1)
    for b in buckets:
        at.stage = f"bucket {b.index + 1}/{n}"
        follow.start(b.index, b.nbytes, at.stage)
        data = flat[b.start : b.start + b.nbytes]
        # chaos: this reader sees a damaged bucket. Damaged in what it hashes, never in the
        # node copy, which the other readers verify too.
        damaged = b.segments[0].bucket_offset if receiver._corrupt_next and b.segments else -1
        receiver._corrupt_next = receiver._corrupt_next and damaged < 0
        for lo in range(0, b.nbytes, PIECE):
            hi = min(lo + PIECE, b.nbytes)
            follow.awaiting(hi)
            piece = data
            if lo <= damaged < hi:
                piece = data[:hi].clone()
                piece[damaged] ^= 0xFF
            feed_bucket(hasher, b, piece, lo, hi)
        follow.awaiting(b.nbytes)  # the writer's last word on this bucket, before the next one's
        digests.append(hasher.bucket_digest(b))
        if progress is not None:
            progress(b.index + 1, n)
    if buckets:
        chan.send({"kind": "released", "bucket": buckets[-1].index})


def _read(
    receiver: Receiver, route: Stream, at: _Receiving, offer: Offer, writer: int, manifest: Manifest,
    buckets: Sequence[Bucket], flat: torch.Tensor, hasher: StreamHasher, digests: list[int],
    progress: Progress | None,
) -> None:
    """Copy (and hash) every bucket out of the slots of ``writer`` (the sender, or this node's relay)."""
    comm = route.comm
    n = len(buckets)
    at.stage = "attach"
    at.read = offer
    try:
        mapped = _mappings(offer, comm, relayed=writer != peer_of(route))
    finally:
        # hello even when the slots could not be mapped: the writer hears only ranks that said
        # hello, so the "failed" that follows (_receiver_failed) ends its wait at once instead
        # of at the sync deadline
        at.chan = chan = Channel.connect(offer.endpoint, comm.rank, group=comm.group, version=comm.version,
                                         writer=writer)
        chan.send({"kind": "hello", "rank": comm.rank, "pid": os.getpid()})
    segs = mapped.segments
    pids = {writer: offer.pid}
    follow = _Follower(chan, route, pids, len(segs))
    for b in buckets:
        at.stage = f"bucket {b.index + 1}/{n}"
        slot = follow.start(b.index, b.nbytes, at.stage)
        seg = segs[slot]
        if seg.group_version() != comm.version:
            raise StaleGroupVersion(comm.group, got=seg.group_version(), current=comm.version,
                                    peer=f"shared-memory segment {seg.name!r}")
        holds = seg.holds()
        if holds != (b.index, manifest.weights_version, b.nbytes):
            raise ManifestError(
                f"shared-memory segment {seg.name!r} holds bucket {holds[0]} of weights version {holds[1]} "
                f"({holds[2]} bytes), expected bucket {b.index} of {manifest.weights_version} "
                f"({b.nbytes} bytes)", field="segment")
        # chaos: this reader sees a damaged segment. Damaged in its own copy, not in the
        # segment: the other readers must get the bytes as sent (two readers both flipping
        # the shared byte would restore it, and neither would notice).
        damage = receiver._corrupt_next and bool(b.segments)
        receiver._corrupt_next = receiver._corrupt_next and not damage
        if mapped.device is None:
            _copy_hash(b, flat[b.start : b.stop], _in_bucket(seg.data), hasher, awaiting=follow.awaiting,
                       damage=damage)
        else:
            data = mapped.data(slot)
            if data.numel() < b.nbytes:
                raise ManifestError(f"the device memory of slot {slot} ({seg.name!r}) holds {data.numel()} bytes, "
                                    f"fewer than bucket {b.index}'s {b.nbytes}", field="handles")
            _device_copy_hash(b, flat[b.start : b.stop], _in_bucket(data), hasher, mapped.device.memory,
                              awaiting=follow.awaiting, damage=damage)
        follow.awaiting(b.nbytes)  # the writer's last word on this bucket, before the next one's
        digests.append(hasher.bucket_digest(b))
        chan.send({"kind": "released", "bucket": b.index})
        if progress is not None:
            progress(b.index + 1, n)


def _net(
    receiver: Receiver, route: Stream, at: _Receiving, src: int, buckets: Sequence[Bucket], flat: torch.Tensor,
    hasher: StreamHasher, digests: list[int], progress: Progress | None, chunk: int,
) -> None:
    """Receive every bucket from ``src`` over the communicator, chunk by chunk (see
    :data:`NET_CHUNK`), hashing each chunk as it lands (and, as a relay, hand each bucket on)."""
    comm = route.comm
    if chunk <= 0:
        raise ManifestError(f"malformed offer: field 'chunk': {chunk}, expected a positive number of bytes for "
                            f"rank {comm.rank}, which gets the buckets over the collective", field="chunk")
    n = len(buckets)
    chunks = _chunks(buckets, chunk)
    posted: deque[Pending] = deque()
    nposted = 0

    def post_until(bucket: int, stage: str) -> None:
        """Post the receives of every chunk of the buckets before ``bucket``."""
        nonlocal nposted
        while nposted < len(chunks) and chunks[nposted][0].index < bucket:
            b, lo, hi = chunks[nposted]
            posted.append(comm.recv(flat[b.start + lo : b.start + hi], src, tag=NET_TAG + nposted,
                                    timeout_s=route.remaining(stage)))
            nposted += 1

    post_until(WINDOW, f"bucket 1/{n}")
    if at.relay is not None:
        at.relay.attach(at)  # while the first buckets arrive
    done = 0
    for b in buckets:
        at.stage = f"bucket {b.index + 1}/{n}"
        data = flat[b.start : b.stop]
        if at.relay is not None:
            at.relay.begin(b, at.stage)
        while done < len(chunks) and chunks[done][0] is b:
            _, lo, hi = chunks[done]
            posted.popleft().wait()
            done += 1
            post_until(b.index + WINDOW, at.stage)
            if receiver._corrupt_next and b.segments and lo <= b.segments[0].bucket_offset < hi:
                receiver._corrupt_next = False
                data[b.segments[0].bucket_offset : b.segments[0].bucket_offset + 1].bitwise_xor_(0xFF)
            if at.relay is not None:
                at.relay.hand_on(b, data, hasher, lo, hi)
            else:
                feed_bucket(hasher, b, data, lo, hi)
        if at.relay is not None:
            at.relay.end(b)
        digests.append(hasher.bucket_digest(b))
        if progress is not None:
            progress(b.index + 1, n)
    if at.relay is not None:
        at.stage = "last buckets"
        at.relay.finish(at.stage)


class _Relay:
    """This receiver's duty as its node's relay: every bucket it receives over the collective
    is written once into its own slots, chunk by chunk as it lands (:meth:`hand_on`: each
    piece hashed as received, then copied while in cache), and read from there by its node
    peers, exactly as same-host readers read the sender's, following it as it fills.

    The relay writes what it received and is trusted with nothing else: its peers verify
    against the sender's seal, which reaches them over the collective, and vote on their own.
    Its slots are double-buffered like the sender's (bucket k goes into slot k % 2 once every
    peer released bucket k - 2), while the next buckets keep arriving into its own staging
    (:data:`WINDOW` receives posted), so the network leg does not wait for the peers."""

    def __init__(self, route: Stream, peers: tuple[int, ...], slots: _Slots | None, chan: Channel, fresh: bool,
                 weights_version: int, node: NodeCopy | None = None, last: int = -1) -> None:
        self.route = route
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
        self.waiter = _Waiter(route, chan, {}, self.nslots)
        #: the bucket being handed on: its slot, the slot's bytes, and how to tell the peers
        self.filling: tuple[int, torch.Tensor, Callable[[int], None]] | None = None

    @classmethod
    def start(cls, route: Stream, at: _Receiving, manifest: Manifest, buckets: Sequence[Bucket],
              peers: tuple[int, ...], *, require: bool, owner: int | None = None) -> _Relay | None:
        """Make (or reuse) the slots, or with ``owner`` a node copy owned by that process (one
        that cannot be made: the slots, said in the offer's ``fallback``), and offer them to the
        peers, and tell the sender whether it could (its peers otherwise take the collective,
        or with ``require`` the transfer fails). None when it relays nothing this time."""
        comm = route.comm
        at.stage = "relay segments"
        capacity = max([b.nbytes for b in buckets] + [1])
        slots: _Slots | None = None
        node: NodeCopy | None = None
        fresh = False
        unavailable: SharedMemoryUnavailable | None = None
        if owner is not None:
            try:
                _require_host_memory(comm, manifest.total_bytes)
                node = NodeCopy.create(comm.group, group_version=comm.version, owner=owner,
                                       weights_version=manifest.weights_version, manifest=encode_manifest(manifest),
                                       data_bytes=manifest.total_bytes)
            except SharedMemoryUnavailable:  # its peers read the slots instead, and stage privately
                node = None
        if node is None:
            try:
                _require_host_memory(comm, capacity)
                slots, fresh = _relay_slots(comm, capacity, min(2, len(buckets)) or 1, set(peers))
            except SharedMemoryUnavailable as exc:
                unavailable = exc
        made = slots is not None or node is not None
        chan = Channel.bind(group=comm.group, version=comm.version, rank=comm.rank) if made else None
        try:
            offer = Offer(comm.group, comm.version, os.getpid(), chan.endpoint if chan else "",
                          tuple(s.name for s in slots.segments) if slots else (), fresh,
                          peers if made else (), () if made else peers,
                          str(unavailable) if unavailable else None,
                          node_copy=node.name if node is not None else "", owner=owner if node is not None else 0)
            payload = encode_offer(offer)
            at.stage = "relay offer"
            for rank in (peer_of(route), *peers):  # the sender first: it waits for the answer
                side_stream(route, rank, sending=True).send_message(payload, at.stage)
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
        return cls(route, peers, slots, chan, fresh, manifest.weights_version, node,
                   buckets[-1].index if buckets else -1)

    def attach(self, at: _Receiving) -> None:
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
                            _announcer(self.chan, self.peers, b.index, 0))
            return
        assert self.slots is not None
        slot = b.index % self.nslots
        self.waiter.free(slot, stage)
        self.slots.segments[slot].mark(b.index, self.weights_version, b.nbytes)
        self.filling = (slot, self.slots.data(slot)[: b.nbytes], _announcer(self.chan, self.peers, b.index, slot))

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
        _drop_relay_slots(self.route.comm.group)
        if self.node is not None:  # a failed version's node copy never stays
            self.node.unlink()

    def close(self) -> None:
        self.chan.close()


def _receiver_failed(comm: Communicator, at: _Receiving, exc: BaseException) -> None:
    if at.chan is not None and not isinstance(exc, PeerLost):
        with contextlib.suppress(TransportError):  # a writer that is gone: nothing to tell
            at.chan.send({"kind": "failed", "reason": f"{type(exc).__name__} during {at.stage}: {exc}"[:500]})
    if at.relay is not None:
        at.relay.failed(at.stage, exc)
    if at.read is not None and at.read.segments and not pid_alive(at.read.pid):
        unlink_names(at.read.segments)  # a writer SIGKILLed before it could unlink its own
    if at.node is not None:
        if not pid_alive(at.node.writer):
            at.node.unlink()  # a failed version's node copy never stays, whoever dies
        at.node.close()
        forget_mappings()
    drop_mappings(group=comm.group)
    comm.abort(f"weight transfer failed during {at.stage}")


__all__ = ["NET_TAG", "PIECE", "POLL_S", "RELAY_TAG", "Offer", "broadcast", "decode_offer", "drop_mappings", "drop_slots",
           "encode_offer", "receive", "send_to"]
