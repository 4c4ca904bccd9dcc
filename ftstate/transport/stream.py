"""The ordered message stream of one transfer: headers, manifest, offer, seal and votes."""

from __future__ import annotations

import struct
import time

import torch

from ftstate.core.errors import (
    CommunicatorAborted,
    DeadlineExceeded,
    ManifestError,
    PeerLost,
    StaleGroupVersion,
    SyncTimeout,
)
from ftstate.transport import auth
from ftstate.transport.base import Communicator, Pending
from ftstate.transport.checksum import host_bytes
from ftstate.transport.manifest import MAX_MESSAGE_BYTES, WIRE_FORMAT

#: First word of every message header ("ftst").
MAGIC = 0x66747374

#: Vote values.
VOTE_COMMIT = 0
VOTE_CHECKSUM_MISMATCH = 1
VOTE_NAMES = {VOTE_COMMIT: "committed", VOTE_CHECKSUM_MISMATCH: "ChecksumMismatch", -1: "ForgedVote"}


class Stream:
    """The ordered message stream of one transfer, on one communicator, under one deadline."""

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

    def other(self) -> int:
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
        sender = self.other()
        payload = auth.verify("gloo", comm.group, comm.version, sender, bytes(host_bytes(body, weights=False)))
        if payload is None:  # recorded by auth; never decoded, never acted on
            raise ManifestError(
                f"message during {stage} on group {comm.group!r} v{comm.version} claimed to come from rank {sender} "
                "and its tag does not verify: forged or from outside the run; dropped",
                field="tag", peer=f"rank {sender}")
        return payload

    def vote(self, value: int, stage: str) -> dict[int, int]:
        raise NotImplementedError


class BroadcastStream(Stream):
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

    def other(self) -> int:
        return self.root

    def vote(self, value: int, stage: str) -> dict[int, int]:
        mine = signed_vote(self.comm, self.comm.rank, value, self.transfer)
        votes = self.comm.allgather(mine, timeout_s=self.remaining(stage))
        return {r: vote_value(self.comm, r, v, self.transfer) for r, v in enumerate(votes) if r != self.root}


class PeerStream(Stream):
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

    def other(self) -> int:
        return self.peer

    def vote(self, value: int, stage: str) -> dict[int, int]:
        box = signed_vote(self.comm, self.comm.rank, value, self.transfer).to(self.comm.device)
        tag, self.seq = self.seq, self.seq + 1
        t = self.remaining(stage)
        if self.sending:  # the sender collects the receiver's vote
            self.comm.recv(box, self.peer, tag=tag, timeout_s=t).wait()
            return {self.peer: vote_value(self.comm, self.peer, box.cpu(), self.transfer)}
        self.comm.send(box, self.peer, tag=tag, timeout_s=t).wait()
        return {}


#: What a vote that does not authenticate counts as: not a commit (the sender reports the rank
#: as rejected with this reason; the forgery is recorded by :mod:`ftstate.transport.auth`).
VOTE_FORGED = -1


def vote_payload(value: int, transfer: int) -> bytes:
    """What a vote's tag covers: its value and the transfer it is about (a vote recorded in
    another transfer of the same group version does not verify)."""
    return value.to_bytes(8, "little", signed=True) + transfer.to_bytes(8, "little")


def signed_vote(comm: Communicator, rank: int, value: int, transfer: int) -> torch.Tensor:
    """A vote as int64 words: the value, then its tag when the run authenticates."""
    if not auth.enabled():
        return torch.tensor([value], dtype=torch.int64)
    t = auth.tag("vote", comm.group, comm.version, rank, vote_payload(value, transfer))
    return torch.tensor([value, *struct.unpack("<2q", t)], dtype=torch.int64)


def vote_value(comm: Communicator, rank: int, words: torch.Tensor, transfer: int) -> int:
    """The vote of ``rank`` in transfer ``transfer``, or :data:`VOTE_FORGED` when its tag does not verify."""
    vals = [int(v) for v in words.reshape(-1).tolist()]
    if not auth.enabled():
        return vals[0]
    signed = vote_payload(vals[0], transfer) + struct.pack("<2q", *vals[1:3])
    if auth.verify("vote", comm.group, comm.version, rank, signed) is None:
        return VOTE_FORGED
    return vals[0]


def with_stage(exc: Exception, stage: str, weights_version: int | None, stream: Stream) -> Exception:
    """The communicator's error again, saying what the transfer was doing."""
    comm = stream.comm
    wv = f" of weights version {weights_version}" if weights_version is not None else ""
    if isinstance(exc, DeadlineExceeded):
        return type(exc)(
            f"weight transfer{wv} on group {comm.group!r} ({stage})",
            key="sync_timeout_s",
            seconds=stream.timeout_s,
            member=exc.member or f"rank {comm.rank}",
            group_version=comm.version,
            missing=exc.missing,
            arrived=exc.arrived,
        )
    if isinstance(exc, (StaleGroupVersion, CommunicatorAborted)):
        return exc
    if isinstance(exc, PeerLost):
        # the stream knows who the other end was: the sender of a broadcast, or the peer
        peer = exc.peer
        if peer is None:
            if isinstance(stream, PeerStream):
                peer = stream.peer
            elif isinstance(stream, BroadcastStream) and stream.root != comm.rank:
                peer = stream.root
        return PeerLost(
            f"{exc} (weight transfer{wv}, {stage})",
            group=comm.group, group_version=comm.version, rank=comm.rank, op=stage, peer=peer,
        )
    if isinstance(exc, ManifestError):
        peer = exc.peer
        if peer is None:  # the stream knows who sent what this member received
            if isinstance(stream, PeerStream):
                peer = f"rank {stream.peer}"
            elif isinstance(stream, BroadcastStream) and stream.root != comm.rank:
                peer = f"rank {stream.root}"
        sender = f", from {peer}" if peer else ""
        return ManifestError(f"{exc} (weight transfer{wv}, {stage}{sender})", field=exc.field, peer=peer)
    return type(exc)(f"{exc} (weight transfer{wv}, {stage})")


#: First tag of the messages beside a transfer's own stream (a relay's offer to the sender and
#: to each of its peers); the peer stream's own messages use small sequence numbers.
SIDE_TAG = 1 << 19


def side_stream(stream: Stream, peer: int, *, sending: bool) -> PeerStream:
    """Messages between two members beside the transfer's own stream (tags of their own from
    :data:`SIDE_TAG`, same deadline): a relay's offer to the sender and to its peers."""
    side = PeerStream(stream.comm, stream.deadline, stream.timeout_s, peer=peer, sending=sending)
    side.seq = SIDE_TAG
    return side


def peer_of(stream: Stream) -> int:
    """The rank at the other end: a broadcast's root, or the peer."""
    return stream.other()


__all__ = ["MAGIC", "SIDE_TAG", "VOTE_CHECKSUM_MISMATCH", "VOTE_COMMIT", "VOTE_FORGED", "VOTE_NAMES",
           "BroadcastStream", "PeerStream", "Stream", "peer_of", "side_stream", "signed_vote", "vote_value",
           "with_stage"]
