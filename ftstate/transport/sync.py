"""Moving a whole state of weights over a communicator: bucketed, pipelined, checksummed, atomic.

One transfer, from the sending member to every other member (:meth:`Sender.broadcast`,
:meth:`Receiver.receive_broadcast`) or to one peer only (:meth:`Sender.send_to`,
:meth:`Receiver.receive_from`; recovery of a newcomer from the trainer or from a rollout
holding the current version, and the reverse sync to a new trainer)::

    sender                                   receiver(s)
    ------                                   -----------
    header + manifest (msgpack)  ─────────▶  fence on the group version, validate, pick staging
    bucket 0 … bucket n-1        ─────────▶  received straight into the staging buffer
      (hashes bucket k while it is on the      (hashes bucket k while k+1 is on the wire)
       wire, packs k+1 meanwhile)
    header + seal (checksums)    ─────────▶  compare every bucket, every tensor, the state
    vote (allgather / one status)◀────────▶  the commit point: 0 = verified, 1 = checksum mismatch
                                             commit = swap one reference; else keep the old version

**Channel.** The manifest and the seal travel on the collective itself (an int64 header
``[magic, wire format, group version, length]`` then the msgpack bytes as a uint8
tensor), not on a side channel such as ZMQ ROUTER/DEALER: they are then ordered with the
buckets by construction, belong to exactly the members of the group version (a second
channel would need its own membership, fencing and failure detection, and could
disagree with the collective about who is alive), and are bounded by the same per-operation
timeouts. Every header carries the group version and a receiver rejects an older one
with :class:`~ftstate.core.errors.StaleGroupVersion` before reading anything else.

**Same host.** :mod:`ftstate.transport.samehost` runs this same protocol (manifest, seal,
vote and commit on the communicator) with the buckets' bytes through shared memory for
the receivers on the sender's host; it shares this module's checks and commit.

**Pipelining.** Buckets are gloo (or NCCL) asynchronous operations executed by the
backend's own threads, which do not hold the GIL, with up to :data:`WINDOW` on the wire
at once. A helper thread hashes each bucket while the driving thread keeps the wire
busy: the sender's bucket k is hashed while it is itself on the wire (its bytes do not
change and its checksum is only needed in the seal) and while the next bucket of small
tensors is packed into the other of two packing buffers (double buffering: a buffer is
refilled only once its last send completed and it was hashed); the receiver's bucket k
is hashed while the next buckets arrive. A bucket that is exactly one tensor or one chunk of a large tensor
is sent from the tensor's own memory, without packing (see
:mod:`ftstate.transport.buckets`). Each byte is hashed once on each side (see
:mod:`ftstate.transport.checksum`); resending a committed state with the same buckets
reuses the checksums it was verified against instead of hashing again.

**Cost.** On the 2-core development machine a raw gloo broadcast is bound by CPU and
memory bandwidth (the kernel copies every byte twice on loopback), so the one extra
read of every byte per side that the checksums need is not free: see
``benchmarks/transfer.py`` for the measured ratio against a raw broadcast.

**Atomic commit.** The receiver stages the whole state in a buffer that is never the
one holding its committed weights, and replaces its :class:`CommittedWeights` (one
reference assignment) only after every bucket, every tensor and the whole-state checksum
matched and the vote completed. Any failure — peer died, deadline, checksum mismatch,
stale or malformed manifest — raises a typed error and leaves :attr:`Receiver.committed`
exactly as it was. Staging buffers are recycled between syncs only when nothing outside
the receiver still references them (so the weights of version N stay valid for as long as
the caller holds them).

**Failure.** A transfer that fails in the middle aborts the communicator (its stream can
no longer be trusted to be aligned), which also makes the other members fail at once
instead of at their timeouts: the runtime forms the next group version. A checksum
mismatch does not abort: the stream stayed aligned, the sender learns from the vote which
ranks rejected the update (:attr:`SyncReport.rejected`), and the group stays usable. The
vote is the commit point: when it completes, every member that voted 0 commits (a local
reference swap that cannot fail); in the narrow window where a member dies during the vote
itself, some members may have committed and others not, and the runtime reconciles by
comparing committed checksums.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import struct
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ftstate.core.errors import (
    ChecksumMismatch,
    CommunicatorAborted,
    DeadlineExceeded,
    ManifestError,
    PeerLost,
    StaleGroupVersion,
    SyncTimeout,
    TransportError,
)
from ftstate.transport import auth, hostmem
from ftstate.transport.base import Communicator, Pending
from ftstate.transport.buckets import Bucket, TensorEntry, bucket_segments, plan_layout
from ftstate.transport.checksum import (
    StreamHasher,
    byte_view,
    combine,
    dtype_name,
    format_checksum,
    function_for,
    function_of,
    host_bytes,
    host_copied_bytes,
    state_checksum,
    torch_dtype,
)
from ftstate.transport.manifest import (
    MAX_MESSAGE_BYTES,
    WIRE_FORMAT,
    Manifest,
    Seal,
    decode_manifest,
    decode_seal,
    encode_manifest,
    encode_seal,
    new_transfer_id,
)
from ftstate.transport.validate import check_state_dict

log = logging.getLogger("ftstate.transport")

#: Default bucket size (the config's ``bucket_size_mb`` default, 256 MiB), in bytes.
DEFAULT_BUCKET_SIZE = 256 * 1024 * 1024

#: Buckets on the wire at once, so that the next operation is queued before the current
#: one drains (a gap between two gloo operations costs throughput). Independent of the
#: sender's two packing buffers, which are reused only once their last send completed.
WINDOW = 3

#: First word of every message header ("ftst").
MAGIC = 0x66747374

#: Vote values.
VOTE_COMMIT = 0
VOTE_CHECKSUM_MISMATCH = 1
_VOTE_NAMES = {VOTE_COMMIT: "committed", VOTE_CHECKSUM_MISMATCH: "ChecksumMismatch", -1: "ForgedVote"}

Progress = Callable[[int, int], None]
"""Called after each bucket with ``(buckets done, buckets in total)``; may be used to
show progress in heartbeats. An exception raised by it aborts the transfer."""


@dataclass(frozen=True)
class CommittedWeights:
    """A complete, verified state held by a :class:`Receiver` (or given to it initially).

    ``tensors`` is read-only as a mapping; the tensors are views into one staging buffer.
    ``state_checksum`` is :func:`~ftstate.transport.checksum.state_checksum` of
    ``tensors``, computed from the bytes this member holds, not copied from the sender.
    """

    tensors: Mapping[str, torch.Tensor]
    weights_version: int
    state_checksum: str
    group: str | None = None
    group_version: int | None = None
    nbytes: int = 0
    _flat: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _entries: tuple[TensorEntry, ...] | None = field(default=None, repr=False, compare=False)
    _baseline: int = field(default=0, repr=False, compare=False)
    # the verified seal and the windows it covers, so a resend with the same plan need not re-hash
    _windows: tuple[tuple[int, int], ...] | None = field(default=None, repr=False, compare=False)
    _seal: Seal | None = field(default=None, repr=False, compare=False)
    # the node copy whose mapping ``tensors`` view (ftstate.transport.nodecopy), None: a private buffer
    _node: str | None = field(default=None, repr=False, compare=False)
    #: bytes this member's process copied from a device to host memory while it received these
    #: weights (:func:`~ftstate.transport.checksum.host_copied_bytes`); 0 on a GPU sync hashed with nh64.
    host_bytes: int = 0


@dataclass(frozen=True)
class SyncReport:
    """What the sender knows after a transfer.

    ``committed``: ranks that verified and committed the new weights; ``rejected``: rank →
    reason (``"ChecksumMismatch"``) for those that kept their previous version.
    """

    group: str
    group_version: int
    weights_version: int
    state_checksum: str
    nbytes: int
    num_buckets: int
    seconds: float
    committed: tuple[int, ...]
    rejected: Mapping[int, str]
    #: rank -> how its buckets travelled (``shm``: read from shared memory on the sender's
    #: host; ``collective``: over the communicator). Empty for a plain broadcast / send_to.
    routes: Mapping[int, str] = field(default_factory=dict)
    #: why same-host ranks took the collective instead of shared memory (``shared_memory: auto``).
    shm_fallback: str | None = None
    #: the node copy this transfer's same-host ranks committed (``staging: node``,
    #: :mod:`ftstate.transport.nodecopy`), kept named as the source of newcomers; else None.
    node_copy: str | None = None
    #: with ``node_copy_spare``: the copy of the version before, kept to be rewritten as the next one.
    node_spare: str | None = None
    #: ``node_copy`` is that spare rewritten (nothing allocated by this sync), not a fresh one.
    node_copy_recycled: bool = False
    #: bytes the sender's process copied from a device to host memory during the transfer
    #: (:func:`~ftstate.transport.checksum.host_copied_bytes`): 0 when its weights are on a GPU
    #: and hashed there (nh64); each receiver's count is its :attr:`CommittedWeights.host_bytes`.
    host_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.rejected


# -- routes: how the messages of one transfer travel --------------------------------------


class _Route:
    """The ordered message stream of one transfer, on one communicator, under one deadline.

    ``deadline``: ``time.monotonic()`` value by which the whole transfer must be done;
    every operation is posted with what is left of it. ``timeout_s``: the budget the
    deadline was made from, named in :class:`SyncTimeout`.
    """

    def __init__(self, comm: Communicator, deadline: float, timeout_s: float) -> None:
        self.comm = comm
        self.deadline = deadline
        self.timeout_s = timeout_s
        #: The transfer's id, once its manifest is sent or read: bound into the votes' tags.
        self.transfer = 0

    def remaining(self, stage: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.comm.abort(f"sync deadline passed during {stage}")
            raise SyncTimeout(
                f"weight transfer on group {self.comm.group!r} ({stage})",
                key="sync_timeout_s",
                seconds=self.timeout_s,
                member=f"rank {self.comm.rank}",
                group_version=self.comm.version,
            )
        return left

    def post(self, tensor: torch.Tensor, stage: str) -> Pending:
        raise NotImplementedError

    def _other(self) -> int:
        """The rank at the other end of what this member receives (the sender, or the peer)."""
        raise NotImplementedError

    def send_message(self, payload: bytes, stage: str, *, group_version: int | None = None) -> None:
        """Header then payload, the payload tagged for this rank when the run authenticates
        (:mod:`ftstate.transport.auth`). ``group_version`` overrides the stamp (tests of fencing only)."""
        dev = self.comm.device
        stamp = self.comm.version if group_version is None else group_version
        payload = auth.sign("gloo", self.comm.group, stamp, self.comm.rank, payload)
        header = torch.tensor([MAGIC, WIRE_FORMAT, stamp, len(payload)], dtype=torch.int64).to(dev)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        first = self.post(header, stage)
        second = self.post(body, stage)
        first.wait()
        second.wait()

    def recv_message(self, stage: str) -> bytes:
        comm = self.comm
        header = torch.zeros(4, dtype=torch.int64, device=comm.device)
        self.post(header, stage).wait()
        magic, fmt, stamp, length = (int(v) for v in header.cpu().tolist())
        if magic != MAGIC:
            raise ManifestError(f"malformed message header during {stage}: field 'magic': {magic:#x}, expected {MAGIC:#x}",
                                field="magic")
        if fmt != WIRE_FORMAT:
            raise ManifestError(
                f"malformed message header during {stage}: field 'wire_format': {fmt}, expected {WIRE_FORMAT}",
                field="wire_format",
            )
        if stamp < comm.version:
            raise StaleGroupVersion(comm.group, got=stamp, current=comm.version)
        if stamp > comm.version:
            raise ManifestError(
                f"malformed message header during {stage}: field 'group_version': {stamp} is newer than "
                f"this member's version {comm.version} of group {comm.group!r}",
                field="group_version",
            )
        if not 0 < length <= MAX_MESSAGE_BYTES:
            raise ManifestError(
                f"malformed message header during {stage}: field 'length': {length}, expected 1..{MAX_MESSAGE_BYTES}",
                field="length",
            )
        body = torch.empty(length, dtype=torch.uint8, device=comm.device)
        self.post(body, stage).wait()
        sender = self._other()
        payload = auth.verify("gloo", comm.group, comm.version, sender, bytes(host_bytes(body, weights=False)))
        if payload is None:  # recorded by auth; never decoded, never acted on
            raise ManifestError(
                f"message during {stage} on group {comm.group!r} v{comm.version} claimed to come from rank {sender} "
                "and its tag does not verify: forged or from outside the run; dropped",
                field="tag", peer=f"rank {sender}")
        return payload

    def vote(self, value: int, stage: str) -> dict[int, int]:
        raise NotImplementedError


class _BroadcastRoute(_Route):
    def __init__(self, comm: Communicator, deadline: float, timeout_s: float, root: int, sending: bool) -> None:
        super().__init__(comm, deadline, timeout_s)
        if not 0 <= root < comm.world_size or (root == comm.rank) != sending:
            role = "the sender" if sending else "a receiver"
            raise ValueError(
                f"root must be the sending rank in [0, {comm.world_size}); rank {comm.rank} is {role}, got root {root}"
            )
        self.root = root

    def post(self, tensor: torch.Tensor, stage: str) -> Pending:
        return self.comm.broadcast(tensor, self.root, timeout_s=self.remaining(stage))

    def _other(self) -> int:
        return self.root

    def vote(self, value: int, stage: str) -> dict[int, int]:
        mine = _signed_vote(self.comm, self.comm.rank, value, self.transfer)
        votes = self.comm.allgather(mine, timeout_s=self.remaining(stage))
        return {r: _vote_value(self.comm, r, v, self.transfer) for r, v in enumerate(votes) if r != self.root}


class _PeerRoute(_Route):
    def __init__(self, comm: Communicator, deadline: float, timeout_s: float, peer: int, sending: bool) -> None:
        super().__init__(comm, deadline, timeout_s)
        if peer == comm.rank or not 0 <= peer < comm.world_size:
            raise ValueError(f"peer must be another rank in [0, {comm.world_size}), got {peer} (this is rank {comm.rank})")
        self.peer = peer
        self.sending = sending
        self.seq = 0

    def post(self, tensor: torch.Tensor, stage: str) -> Pending:
        tag, self.seq = self.seq, self.seq + 1
        t = self.remaining(stage)
        if self.sending:
            return self.comm.send(tensor, self.peer, tag=tag, timeout_s=t)
        return self.comm.recv(tensor, self.peer, tag=tag, timeout_s=t)

    def _other(self) -> int:
        return self.peer

    def vote(self, value: int, stage: str) -> dict[int, int]:
        box = _signed_vote(self.comm, self.comm.rank, value, self.transfer).to(self.comm.device)
        tag, self.seq = self.seq, self.seq + 1
        t = self.remaining(stage)
        if self.sending:  # the sender collects the receiver's vote
            self.comm.recv(box, self.peer, tag=tag, timeout_s=t).wait()
            return {self.peer: _vote_value(self.comm, self.peer, box.cpu(), self.transfer)}
        self.comm.send(box, self.peer, tag=tag, timeout_s=t).wait()
        return {}


#: What a vote that does not authenticate counts as: not a commit (the sender reports the rank
#: as rejected with this reason; the forgery is recorded by :mod:`ftstate.transport.auth`).
VOTE_FORGED = -1


def _vote_payload(value: int, transfer: int) -> bytes:
    """What a vote's tag covers: its value and the transfer it is about (a vote recorded in
    another transfer of the same group version does not verify)."""
    return value.to_bytes(8, "little", signed=True) + transfer.to_bytes(8, "little")


def _signed_vote(comm: Communicator, rank: int, value: int, transfer: int) -> torch.Tensor:
    """A vote as int64 words: the value, then its tag when the run authenticates."""
    if not auth.enabled():
        return torch.tensor([value], dtype=torch.int64)
    t = auth.tag("vote", comm.group, comm.version, rank, _vote_payload(value, transfer))
    return torch.tensor([value, *struct.unpack("<2q", t)], dtype=torch.int64)


def _vote_value(comm: Communicator, rank: int, words: torch.Tensor, transfer: int) -> int:
    """The vote of ``rank`` in transfer ``transfer``, or :data:`VOTE_FORGED` when its tag does not verify."""
    vals = [int(v) for v in words.reshape(-1).tolist()]
    if not auth.enabled():
        return vals[0]
    signed = _vote_payload(vals[0], transfer) + struct.pack("<2q", *vals[1:3])
    if auth.verify("vote", comm.group, comm.version, rank, signed) is None:
        return VOTE_FORGED
    return vals[0]


def _with_stage(exc: Exception, stage: str, weights_version: int | None, route: _Route) -> Exception:
    """The communicator's error again, saying what the transfer was doing."""
    comm = route.comm
    wv = f" of weights version {weights_version}" if weights_version is not None else ""
    if isinstance(exc, DeadlineExceeded):
        return type(exc)(
            f"weight transfer{wv} on group {comm.group!r} ({stage})",
            key="sync_timeout_s",
            seconds=route.timeout_s,
            member=exc.member or f"rank {comm.rank}",
            group_version=comm.version,
            missing=exc.missing,
            arrived=exc.arrived,
        )
    if isinstance(exc, (StaleGroupVersion, CommunicatorAborted)):
        return exc
    if isinstance(exc, PeerLost):
        # the route knows who the other end was: the sender of a broadcast, or the peer
        peer = exc.peer
        if peer is None:
            if isinstance(route, _PeerRoute):
                peer = route.peer
            elif isinstance(route, _BroadcastRoute) and route.root != comm.rank:
                peer = route.root
        return PeerLost(
            f"{exc} (weight transfer{wv}, {stage})",
            group=comm.group, group_version=comm.version, rank=comm.rank, op=stage, peer=peer,
        )
    if isinstance(exc, ManifestError):
        peer = exc.peer
        if peer is None:  # the route knows who sent what this member received
            if isinstance(route, _PeerRoute):
                peer = f"rank {route.peer}"
            elif isinstance(route, _BroadcastRoute) and route.root != comm.rank:
                peer = f"rank {route.root}"
        sender = f", from {peer}" if peer else ""
        return ManifestError(f"{exc} (weight transfer{wv}, {stage}{sender})", field=exc.field, peer=peer)
    return type(exc)(f"{exc} (weight transfer{wv}, {stage})")


# -- hashing off the critical path ---------------------------------------------------------


def hasher_for(manifest: Manifest, *, receiving: bool = False) -> StreamHasher:
    """The hasher of one side of the transfer ``manifest`` announces, with its function."""
    return StreamHasher(len(manifest.tensors), receiving=receiving, function=manifest.digest,
                        sizes=[e.nbytes for e in manifest.tensors])


def feed_bucket(hasher: StreamHasher, bucket: Bucket, data: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
    """Feed the bucket's bytes ``[lo, hi)`` (offsets in it; ``data`` holds them at those offsets)
    to their tensors' hashers: through the host for xxh3, where they are for nh64."""
    hi = bucket.nbytes if hi is None else hi
    mv = host_bytes(data[lo:hi]) if hasher.function == "xxh3" else None
    for s in bucket.segments:
        a, z = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.length)
        if a >= z:
            continue
        if mv is not None:
            hasher.feed(s.tensor, mv[a - lo : z - lo])
        else:  # nh64: each piece at its place in its tensor, on the device that holds it
            hasher.feed_at(s.tensor, s.start + a - s.bucket_offset, data[a:z])


class _Hashing:
    """Hashes the buckets of one transfer in a helper thread, in bucket order.

    The thread that drives the transfer then only packs, posts and waits, so posting the
    next bucket never waits for a hash, and on the sender packing (torch copies release
    the GIL) and hashing run on different cores. xxhash holds the GIL while it hashes, so
    the driving thread may wait a few milliseconds for it between two posts; the window
    of buckets on the wire covers that. On the 2-core development machine hashing here or
    inline measured alike within noise; on larger machines the overlap is real.
    """

    def __init__(self, manifest: Manifest, *, receiving: bool = False) -> None:
        self.hasher = hasher_for(manifest, receiving=receiving)
        self.digests: list[int] = []
        self._queue: queue.SimpleQueue[tuple[Bucket, torch.Tensor] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ftstate-hash", daemon=True)
        self._thread.start()

    def submit(self, bucket: Bucket, data: torch.Tensor) -> None:
        self._queue.put((bucket, data))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            bucket, data = item
            try:
                if not self._stopped:
                    feed_bucket(self.hasher, bucket, data)
                    digest = self.hasher.bucket_digest(bucket)
            except BaseException as exc:  # noqa: BLE001 - handed to the transfer thread by wait_for/finish
                self._error = exc
                self._stopped = True
            with self._done:
                if not self._stopped:
                    self.digests.append(digest)
                self._done.notify_all()

    def wait_for(self, index: int) -> None:
        """Block until bucket ``index`` has been hashed (its buffer may then be reused)."""
        with self._done:
            self._done.wait_for(lambda: len(self.digests) > index or self._stopped)
        self._raise()

    def finish(self) -> list[int]:
        """Every bucket's checksum, once all submitted buckets are hashed."""
        self._queue.put(None)
        self._thread.join()
        self._raise()
        return self.digests

    def cancel(self) -> None:
        """Stop hashing (the transfer failed); the thread exits after its current bucket."""
        self._stopped = True
        self._queue.put(None)

    def _raise(self) -> None:
        if self._error is not None:
            raise TransportError(f"hashing a bucket failed: {self._error}") from self._error


# -- sender --------------------------------------------------------------------------------


class Sender:
    """Sends whole states; keeps its two packing buffers between transfers.

    ``bucket_size``: bytes per bucket (``bucket_bytes(cfg.bucket_size_mb)``); tensors larger
    than a bucket are chunked across buckets. Not thread-safe: one transfer at a time.
    """

    def __init__(self, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> None:
        plan_layout([], bucket_size)  # validates the size
        self.bucket_size = bucket_size
        self._pack: list[torch.Tensor | None] = [None, None]
        self._samehost: Any = None  # the shared-memory slots of the same-host route (samehost.py)
        self._node_copy: Any = None  # the node copies it wrote and keeps (samehost._Written, nodecopy.py)

    def broadcast(
        self,
        comm: Communicator,
        weights: Mapping[str, torch.Tensor] | CommittedWeights,
        *,
        weights_version: int | None = None,
        timeout_s: float,
        progress: Progress | None = None,
    ) -> SyncReport:
        """Send ``weights`` from this member to every other member of ``comm``.

        ``weights_version``: the version stamped on the transfer (defaults to the
        version of a :class:`CommittedWeights`). ``timeout_s``: ``sync_timeout_s``, the
        bound on the whole transfer, manifest to vote. Raises :class:`PeerLost`,
        :class:`SyncTimeout`, :class:`StaleGroupVersion` (this communicator was fenced);
        receivers that rejected the data are listed in the report, not raised. A plain
        mapping is checked first (:func:`~ftstate.transport.validate.check_state_dict`, on
        this communicator's device type): one that cannot travel raises
        :class:`~ftstate.core.errors.StateDictError` before anything is sent.
        """
        route = _BroadcastRoute(comm, time.monotonic() + timeout_s, timeout_s, root=comm.rank, sending=True)
        return self._send(route, weights, weights_version, progress)

    def send_to(
        self,
        comm: Communicator,
        peer: int,
        weights: Mapping[str, torch.Tensor] | CommittedWeights,
        *,
        weights_version: int | None = None,
        timeout_s: float,
        progress: Progress | None = None,
    ) -> SyncReport:
        """Send ``weights`` to ``peer`` only (same manifest, checksums and atomic commit).

        For recovery: the trainer or a rollout holding the current version sends it to a
        newcomer, or a rollout sends it to a new trainer. Other members are not involved.
        ``timeout_s``: bound on the whole transfer (``sync_timeout_s`` or
        ``failover_timeout_s``, whichever the caller is spending). A plain mapping is
        checked as in :meth:`broadcast`.
        """
        route = _PeerRoute(comm, time.monotonic() + timeout_s, timeout_s, peer=peer, sending=True)
        return self._send(route, weights, weights_version, progress)

    # -- internals ----------------------------------------------------------------------

    def _state_to_send(
        self, comm: Communicator, weights: Mapping[str, torch.Tensor] | CommittedWeights, weights_version: int | None
    ) -> tuple[Mapping[str, torch.Tensor], int, CommittedWeights | None]:
        """The tensors to send, the version to stamp and the committed weights they are (if so)."""
        committed = weights if isinstance(weights, CommittedWeights) else None
        if weights_version is None:
            if committed is None:
                raise ValueError("weights_version is required when sending a plain mapping of tensors")
            weights_version = committed.weights_version
        if committed is not None:
            tensors = committed.tensors
        else:  # the caller's own tensors: refused here, before anything moves, if they cannot travel
            tensors = check_state_dict(
                weights, device_type=comm.device.type, member=f"rank {comm.rank}", what="weights", allow_empty=True
            )
        return tensors, weights_version, committed

    def _report(
        self, comm: Communicator, manifest: Manifest, state: int, num_buckets: int, started: float,
        votes: Mapping[int, int], routes: Mapping[int, str] | None = None, shm_fallback: str | None = None,
        host_from: int = 0,
    ) -> SyncReport:
        """The sender's report of a completed transfer, logged. ``host_from``: the process's
        :func:`host_copied_bytes` when the transfer began."""
        report = SyncReport(
            group=comm.group,
            group_version=comm.version,
            weights_version=manifest.weights_version,
            state_checksum=format_checksum(state, manifest.digest),
            nbytes=manifest.payload_bytes,
            num_buckets=num_buckets,
            seconds=time.monotonic() - started,
            committed=tuple(sorted(r for r, v in votes.items() if v == VOTE_COMMIT)),
            rejected={r: _VOTE_NAMES.get(v, f"vote {v}") for r, v in sorted(votes.items()) if v != VOTE_COMMIT},
            routes=dict(routes or {}),
            shm_fallback=shm_fallback,
            host_bytes=host_copied_bytes() - host_from,
        )
        log.info(
            "weights sent",
            extra={
                "group": comm.group, "group_version": comm.version, "rank": comm.rank,
                "weights_version": report.weights_version, "state_checksum": report.state_checksum,
                "bytes": report.nbytes, "buckets": report.num_buckets, "seconds": round(report.seconds, 4),
                "committed": list(report.committed), "rejected": dict(report.rejected),
                "routes": dict(report.routes), "shm_fallback": shm_fallback, "host_bytes": report.host_bytes,
            },
        )
        return report

    def _buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Packing buffer ``slot``, at least ``nbytes`` long (grown on demand, kept between
        transfers: only buckets of small tensors are packed, so they stay small in practice)."""
        buf = self._pack[slot]
        if buf is None or buf.device != device or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._pack[slot] = buf
        return buf[:nbytes]

    def _send(
        self,
        route: _Route,
        weights: Mapping[str, torch.Tensor] | CommittedWeights,
        weights_version: int | None,
        progress: Progress | None,
    ) -> SyncReport:
        comm = route.comm
        started, host_from = time.monotonic(), host_copied_bytes()
        tensors, weights_version, committed = self._state_to_send(comm, weights, weights_version)
        comm.check_usable()

        names = list(tensors)
        sources = [byte_view(tensors[n]) for n in names]
        entries, windows, total = plan_layout(
            ((n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names), self.bucket_size
        )
        flat = None
        known: Seal | None = None
        if committed is not None and committed._flat is not None and committed._entries == entries:
            flat = committed._flat  # the receiver's staging layout is the stream: send slices of it
            if committed._windows == windows and committed._seal is not None:
                # Same buckets as the transfer that brought these weights: resend its verified
                # checksums instead of hashing again. A byte that changed here since then is
                # caught by the receiver, which hashes what arrives.
                known = committed._seal
        buckets = bucket_segments(entries, windows)
        function = function_for(sources)
        if known is not None and function_of(committed.state_checksum) != function:  # type: ignore[union-attr]
            known = None  # its seal holds the other function's values
        manifest = Manifest(comm.group, comm.version, weights_version, self.bucket_size, total, entries, windows,
                            new_transfer_id(), function)
        hashing = _Hashing(manifest) if known is None else None
        device = comm.device
        stage = "manifest"

        # the bucket last packed into each packing buffer, and its operation
        slots: list[tuple[int, Pending] | None] = [None, None]
        packed = 0

        def pack(b: Bucket) -> tuple[torch.Tensor, int | None]:
            """The bucket's bytes on the communicator's device, and the packing slot used:
            a slice of the tensor (or of a committed staging buffer) when it is one, else
            the small tensors copied into the packing buffer whose last send completed."""
            nonlocal packed
            one = b.single
            if flat is not None and flat.device == device:
                return flat[b.start : b.stop], None
            if one is not None and sources[one.tensor].device == device:
                return sources[one.tensor][one.start : one.start + one.length], None
            slot, packed = packed % 2, packed + 1
            previous, slots[slot] = slots[slot], None
            if previous is not None:  # double buffering: never overwrite bytes still on the wire
                index, pending = previous  # or not yet hashed
                pending.wait()
                if hashing is not None:
                    hashing.wait_for(index)
            data = self._buffer(slot, b.nbytes, device)
            cursor = 0
            for s in b.segments:
                if s.bucket_offset > cursor:
                    data[cursor : s.bucket_offset].zero_()
                hostmem.copy_bytes(data[s.bucket_offset : s.bucket_offset + s.length],
                                   sources[s.tensor][s.start : s.start + s.length])
                cursor = s.bucket_offset + s.length
            return data, slot

        try:
            route.send_message(encode_manifest(manifest), stage)
            route.transfer = manifest.transfer
            n = len(buckets)
            inflight: deque[Pending] = deque()  # at most WINDOW buckets on the wire
            done = 0
            for b in buckets:
                stage = f"bucket {b.index + 1}/{n}"
                data, slot = pack(b)  # the buckets already on the wire overlap this packing
                pending = route.post(data, stage)
                inflight.append(pending)
                if slot is not None:
                    slots[slot] = (b.index, pending)
                if hashing is not None:
                    # hashed while on the wire: the checksums only go out in the seal
                    hashing.submit(b, data)
                while len(inflight) >= WINDOW:
                    inflight.popleft().wait()
                    done += 1
                    if progress is not None:
                        progress(done, n)
            while inflight:
                stage = f"bucket {done + 1}/{n}"
                inflight.popleft().wait()
                done += 1
                if progress is not None:
                    progress(done, n)
            if hashing is not None:
                stage = "checksums"
                digests = hashing.finish()
                tensor_sums = hashing.hasher.tensor_digests()
            else:
                assert known is not None
                digests, tensor_sums = list(known.bucket_checksums), list(known.tensor_checksums)
            state = combine((e.name, e.dtype, e.shape, h) for e, h in zip(entries, tensor_sums, strict=True))
            seal = Seal(comm.group, comm.version, weights_version, tuple(digests), tuple(tensor_sums), state,
                        manifest.transfer)
            stage = "seal"
            route.send_message(encode_seal(seal), stage)
            stage = "commit vote"
            votes = route.vote(VOTE_COMMIT, stage)
        except (TransportError, DeadlineExceeded) as exc:
            self._pack = [None, None]
            if hashing is not None:
                hashing.cancel()
            comm.abort(f"weight transfer failed during {stage}")
            raise _with_stage(exc, stage, weights_version, route) from exc
        except BaseException:
            self._pack = [None, None]
            if hashing is not None:
                hashing.cancel()
            comm.abort(f"weight transfer interrupted during {stage}")
            raise

        return self._report(comm, manifest, state, len(buckets), started, votes, host_from=host_from)


# -- receiver ------------------------------------------------------------------------------


def _fresh(nbytes: int, device: torch.device) -> torch.Tensor:
    """A staging buffer of ``nbytes`` never touched: on the host, on huge pages
    (:mod:`ftstate.transport.hostmem`: a fresh staging buffer's page faults are a sizeable
    part of a sync whose receiver keeps no spare)."""
    if device.type == "cpu":
        return hostmem.empty_host(nbytes)
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)


def _use_count(t: torch.Tensor) -> int | None:
    """How many references hold ``t``'s storage (None when torch does not tell)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    try:
        return int(counter(t.untyped_storage()._cdata))
    except Exception:  # noqa: BLE001 - a private torch API: without it buffers are simply not recycled
        return None


class Receiver:
    """Owns one member's committed weights and replaces them only with a complete, verified state.

    ``initial``/``weights_version``: weights this member already holds (e.g. loaded from a
    checkpoint), committed as they are (checked like a sender's, on any device but ``meta``:
    :class:`~ftstate.core.errors.StateDictError` otherwise); without them :attr:`committed`
    starts as ``None``.
    The receiver outlives communicators: pass the current group version's one to each call.
    Not thread-safe: one transfer at a time (:meth:`corrupt_next_bucket` may be called
    from any thread).
    """

    def __init__(
        self, initial: Mapping[str, torch.Tensor] | None = None, *, weights_version: int | None = None
    ) -> None:
        self._committed: CommittedWeights | None = None
        self._spare: tuple[torch.Tensor, int] | None = None
        # Held while :meth:`reserve` makes the spare: a transfer arriving meanwhile waits for
        # that buffer instead of allocating a second one beside it (both page-faulted at once
        # on the same cores stage several times slower: docs/benchmarks.md).
        self._reserving = threading.Lock()
        self._corrupt_next = False
        self._peak = 0
        self._host_from = 0  # host_copied_bytes() when the transfer in progress began
        if initial is not None:
            if weights_version is None:
                raise ValueError("weights_version is required with initial weights")
            tensors = check_state_dict(initial, device_type=None, what="initial weights", allow_empty=True)
            self._committed = CommittedWeights(
                tensors=types.MappingProxyType(tensors),
                weights_version=weights_version,
                state_checksum=state_checksum(tensors, function_for(tensors.values())),  # on a GPU: hashed there
                nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            )

    @property
    def committed(self) -> CommittedWeights | None:
        """The last complete, verified weights (unchanged by any failed transfer)."""
        return self._committed

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers this receiver keeps between transfers: the committed version's
        staging buffer (until :meth:`release`) and the spare kept for the next transfer.
        What ftstate's fault tolerance costs a rollout in memory beyond its own weights. A
        committed version in a node copy (``staging: node``) is the node's, counted once per
        node (the ``node_copy_committed`` record), not here."""
        seen: set[int] = set()
        total = 0
        c = self._committed
        for buf in (c._flat if c is not None and c._node is None else None,
                    self._spare[0] if self._spare is not None else None):
            if buf is not None and buf.data_ptr() not in seen:
                seen.add(buf.data_ptr())
                total += buf.numel() * buf.element_size()
        return total

    @property
    def peak_bytes(self) -> int:
        """The most bytes of buffers this receiver held at once during its last transfer: the
        staging buffer the transfer landed in plus the committed version it kept meanwhile."""
        return self._peak

    def release(self, keep_spare: bool = False) -> None:
        """Let go of the committed version's bytes and of the spare buffer, keeping what the
        version is (weights version, checksum): the caller's engine holds the weights now and
        is their only full copy (a rollout with ``held_weights()``). The next transfer then
        stages into a fresh buffer, paying its page faults (``benchmarks/memory.py``), and a
        failed transfer still leaves the engine untouched: nothing is loaded before the vote.
        ``keep_spare`` (``staging_spare``): the committed version's buffer becomes the spare
        instead, reused by the next transfer only if nothing else holds a view of it then
        (an engine that kept the tensors it was handed gets a fresh buffer, as without)."""
        c = self._committed
        spare = (c._flat, c._baseline) if keep_spare and c is not None and c._flat is not None \
            and c._node is None else None
        if c is not None and c._flat is not None:
            self._committed = dataclasses.replace(c, tensors=types.MappingProxyType({}), _flat=None, _entries=None,
                                                  _windows=None, _seal=None, _baseline=0)
        self._spare = spare

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Allocate the next transfer's staging buffer (at least ``nbytes``) now and touch
        every page of it, off the transfer's critical path: the first write into fresh memory
        costs a page fault per page (about 200 ms per 512 MiB on the 2-core dev machine), which
        a prewarmed spare can pay while it waits instead of while the run waits for it."""
        with self._reserving:
            if self._spare is not None and self._spare[0].device == device and self._spare[0].numel() >= nbytes:
                return
            buf = _fresh(nbytes, device)
            buf.zero_()
            self._spare = (buf, _use_count(buf) or 0)

    def corrupt_next_bucket(self) -> None:
        """Chaos/test hook: flip one byte of the next bucket this receiver gets, after it
        arrived and before it is checked (so the transfer ends in ChecksumMismatch)."""
        self._corrupt_next = True

    def receive_broadcast(
        self, comm: Communicator, *, root: int = 0, timeout_s: float, progress: Progress | None = None
    ) -> CommittedWeights:
        """Receive the state ``root`` broadcasts and commit it; returns the new :attr:`committed`.

        ``timeout_s``: ``sync_timeout_s``, bound on the whole transfer. Raises
        :class:`ChecksumMismatch`, :class:`PeerLost`, :class:`SyncTimeout`,
        :class:`StaleGroupVersion` or :class:`ManifestError`; on any of them
        :attr:`committed` is exactly what it was before the call.
        """
        route = _BroadcastRoute(comm, time.monotonic() + timeout_s, timeout_s, root=root, sending=False)
        return self._receive(route, progress)

    def receive_from(
        self, comm: Communicator, peer: int, *, timeout_s: float, progress: Progress | None = None
    ) -> CommittedWeights:
        """Receive a state sent to this member only by ``peer`` (:meth:`Sender.send_to`).

        ``timeout_s``: bound on the whole transfer. Same errors and guarantee as
        :meth:`receive_broadcast`.
        """
        route = _PeerRoute(comm, time.monotonic() + timeout_s, timeout_s, peer=peer, sending=False)
        return self._receive(route, progress)

    # -- internals ----------------------------------------------------------------------

    def _staging(self, nbytes: int, device: torch.device, wait_s: float = 0.0) -> tuple[torch.Tensor, int]:
        """The buffer a transfer of ``nbytes`` lands in: the spare when it fits and nobody else
        holds it, else a fresh one. A reserve in flight is waited for up to ``wait_s`` (what is
        left of the transfer's deadline); past that the transfer allocates its own."""
        if self._reserving.acquire(timeout=max(wait_s, 0.0)):
            self._reserving.release()
        spare, self._spare = self._spare, None
        if spare is not None:
            buf, baseline = spare
            count = _use_count(buf)
            if buf.device == device and buf.numel() >= nbytes and count is not None and count <= baseline:
                self._peak = self.held_bytes + buf.numel()
                return buf, baseline
        try:
            buf = _fresh(nbytes, device)
        except (RuntimeError, MemoryError, OSError) as exc:  # the manifest passed its caps, not this host's memory
            raise TransportError(f"staging for a transfer of {nbytes} bytes cannot be allocated on {device}: "
                                 f"{str(exc)[:200]}") from exc
        self._peak = self.held_bytes + buf.numel()
        return buf, _use_count(buf) or 0

    def _receive(self, route: _Route, progress: Progress | None) -> CommittedWeights:
        comm = route.comm
        kept = self._committed
        stage = "manifest"
        manifest: Manifest | None = None
        staging: tuple[torch.Tensor, int] | None = None
        hashing: _Hashing | None = None
        self._host_from = host_copied_bytes()
        comm.check_usable()
        try:
            manifest = decode_manifest(route.recv_message(stage), group=comm.group, group_version=comm.version)
            route.transfer = manifest.transfer
            staging = self._staging(manifest.total_bytes, comm.device, route.deadline - time.monotonic())
            flat = staging[0]
            _zero_padding(flat, manifest)
            buckets = bucket_segments(manifest.tensors, manifest.buckets)
            hashing = _Hashing(manifest, receiving=True)
            n = len(buckets)
            posted: deque[Pending] = deque()
            for b in buckets[:WINDOW]:
                posted.append(route.post(flat[b.start : b.stop], f"bucket {b.index + 1}/{n}"))
            for b in buckets:
                stage = f"bucket {b.index + 1}/{n}"
                posted.popleft().wait()
                if b.index + WINDOW < n:
                    following = buckets[b.index + WINDOW]
                    posted.append(route.post(flat[following.start : following.stop], stage))
                data = flat[b.start : b.stop]
                if self._corrupt_next and b.segments:
                    self._corrupt_next = False
                    at = b.segments[0].bucket_offset
                    data[at : at + 1].bitwise_xor_(0xFF)
                hashing.submit(b, data)  # hashed while the next buckets are on the wire
                if progress is not None:
                    progress(b.index + 1, n)
            stage = "seal"
            seal = decode_seal(route.recv_message(stage), manifest)
            stage = "checksums"
            digests = hashing.finish()
            tensor_sums = hashing.hasher.tensor_digests(seal.tensor_checksums)
            own = _own_state_checksum(manifest, tensor_sums)
            problem = _verify(manifest, seal, digests, tensor_sums, own)
            stage = "commit vote"
            route.vote(VOTE_COMMIT if problem is None else VOTE_CHECKSUM_MISMATCH, stage)
        except (TransportError, DeadlineExceeded) as exc:
            if hashing is not None:
                hashing.cancel()
            comm.abort(f"weight transfer failed during {stage}")
            wv = manifest.weights_version if manifest is not None else None
            raise _with_stage(exc, stage, wv, route) from exc
        except BaseException:
            if hashing is not None:
                hashing.cancel()
            comm.abort(f"weight transfer interrupted during {stage}")
            raise

        return self._conclude(comm, manifest, seal, staging, kept, problem, own)

    def _conclude(
        self, comm: Communicator, manifest: Manifest, seal: Seal, staging: tuple[torch.Tensor, int],
        kept: CommittedWeights | None, problem: str | None, own: int, node: str | None = None,
    ) -> CommittedWeights:
        """After the vote: raise :class:`ChecksumMismatch` for ``problem`` (keeping what was
        committed), else commit the staged state (one reference assignment). ``own``: this
        member's whole-state checksum of the bytes it received (:func:`_own_state_checksum`),
        what it reports as holding: never the seal's, except that with ``integrity: keyed`` its
        per-tensor digests are the seal's, taken only because every bucket's keyed digest of
        its own bytes matched (``problem`` is None; see ``StreamHasher``). ``node``: ``staging`` is a mapping of
        that node copy (:mod:`ftstate.transport.nodecopy`), never a buffer to recycle, and
        once it is committed no private copy is kept beside it."""
        kept_version = kept.weights_version if kept is not None else None
        if problem is not None:
            if node is None:
                self._spare = staging  # verified as garbage, but the buffer is ours to reuse
            kept_text = f"kept weights version {kept_version}" if kept is not None else "kept no weights"
            log.warning(
                "weights rejected",
                extra={"group": comm.group, "group_version": comm.version, "rank": comm.rank,
                       "weights_version": manifest.weights_version, "problem": problem},
            )
            raise ChecksumMismatch(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: weights version "
                f"{manifest.weights_version}: {problem}; {kept_text}"
            )

        flat, baseline = staging
        tensors = {
            e.name: flat[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)
            for e in manifest.tensors
        }
        new = CommittedWeights(
            tensors=types.MappingProxyType(tensors),
            weights_version=manifest.weights_version,
            state_checksum=format_checksum(own, manifest.digest),
            group=comm.group,
            group_version=comm.version,
            nbytes=manifest.payload_bytes,
            _flat=flat,
            _entries=manifest.tensors,
            _windows=manifest.buckets,
            _seal=seal,
            _baseline=baseline,
            _node=node,
            host_bytes=host_copied_bytes() - self._host_from,
        )
        self._committed = new  # the commit: one reference assignment
        if node is not None:
            self._spare = None
        elif kept is not None and kept._flat is not None and kept._node is None:
            self._spare = (kept._flat, kept._baseline)
        log.info(
            "weights committed",
            extra={"group": comm.group, "group_version": comm.version, "rank": comm.rank,
                   "weights_version": new.weights_version, "state_checksum": new.state_checksum,
                   "bytes": new.nbytes, "previous_weights_version": kept_version, "host_bytes": new.host_bytes},
        )
        return new


def _zero_padding(flat: torch.Tensor, manifest: Manifest) -> None:
    """Zero the alignment gaps between tensors (never sent), so a resend from this buffer
    leaks no stale memory."""
    cursor = 0
    for e in sorted(manifest.tensors, key=lambda e: e.offset):
        if e.offset > cursor:
            flat[cursor : e.offset].zero_()
        cursor = max(cursor, e.end)


def _own_state_checksum(manifest: Manifest, tensor_sums: list[int]) -> int:
    """The whole-state checksum of what this member received, from its per-tensor digests (its
    own; with ``integrity: keyed`` the seal's, proven by its keyed bucket digests)."""
    return combine((e.name, e.dtype, e.shape, h) for e, h in zip(manifest.tensors, tensor_sums, strict=True))


def _verify(manifest: Manifest, seal: Seal, digests: list[int], tensor_sums: list[int], state: int) -> str | None:
    """None when everything matches, else what did not (first failing bucket first). ``state``:
    the receiver's own whole-state checksum of ``tensor_sums``."""
    n = manifest.num_buckets
    for k, (got, want) in enumerate(zip(digests, seal.bucket_checksums, strict=True)):
        if got != want:
            return f"bucket {k + 1}/{n} does not match its checksum (expected {want:016x}, got {got:016x})"
    for e, got, want in zip(manifest.tensors, tensor_sums, seal.tensor_checksums, strict=True):
        if got != want:
            return f"tensor {e.name!r} does not match its checksum (expected {want:016x}, got {got:016x})"
    if state != seal.state_checksum:
        return (
            f"whole-state checksum does not match (expected {seal.state_checksum:016x}, got {state:016x})"
        )
    return None


__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "CommittedWeights",
    "Progress",
    "Receiver",
    "Sender",
    "SyncReport",
]
