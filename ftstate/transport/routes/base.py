"""The interface every route implements: how the bytes of one transfer's buckets travel."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ftstate.core.errors import PeerLost
from ftstate.transport.buckets import Bucket, TensorEntry, bucket_segments, plan_layout
from ftstate.transport.checksum import StreamHasher, byte_view, dtype_name, function_for
from ftstate.transport.manifest import Manifest, Seal, new_transfer_id
from ftstate.transport.shm import pid_alive
from ftstate.transport.stream import Stream
from ftstate.transport.weights import CommittedWeights, OnProgress, TransferReport

#: How often a wait on a signal looks at the deadline, at abandonment and at the peer's pid.
POLL_S = 0.02

Buffer = Callable[[int, int, torch.device], torch.Tensor]
"""A sender's packing buffer ``slot`` (0 or 1), at least ``nbytes`` long, on ``device``."""


@dataclass
class Transfer:
    """Where one side's transfer is (named in its errors), and its progress callback."""

    stage: str = "manifest"
    progress: OnProgress | None = None
    buckets: int = 0
    done: int = 0

    def bucket_done(self) -> None:
        """One more bucket is through (sent and completed, or received and hashed)."""
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.buckets)


@dataclass
class Plan:
    """What the sender sends: its tensors' bytes cut into buckets, and the manifest saying so."""

    names: list[str]
    sources: list[torch.Tensor]
    entries: tuple[TensorEntry, ...]
    windows: tuple[tuple[int, int], ...]
    buckets: list[Bucket]
    manifest: Manifest
    committed: CommittedWeights | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, stream: Stream, tensors: Mapping[str, torch.Tensor], weights_version: int, bucket_size: int,
           committed: CommittedWeights | None) -> Plan:
        comm = stream.comm
        names = list(tensors)
        sources = [byte_view(tensors[n]) for n in names]
        entries, windows, total = plan_layout(
            ((n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names), bucket_size
        )
        manifest = Manifest(comm.group, comm.version, weights_version, bucket_size, total, entries, windows,
                            new_transfer_id(), function_for(sources))
        return cls(names, sources, tuple(entries), tuple(windows), bucket_segments(entries, windows), manifest,
                   committed)

    def known_seal(self) -> Seal | None:
        """The verified seal of the committed state being resent, when it still holds for this
        plan (:meth:`~ftstate.transport.weights.CommittedWeights.seal_for`)."""
        c = self.committed
        return c.seal_for(self.entries, self.windows, self.manifest.digest) if c is not None else None

    @property
    def capacity(self) -> int:
        """The largest bucket's bytes (one slot's size)."""
        return max([b.nbytes for b in self.buckets] + [1])


class SendRoute:
    """The sender's side of a route: open, write per bucket, drain, checksums, settle;
    failed on error, close always."""

    #: rank -> how its buckets travelled (``TransferReport.routes``); empty for a plain broadcast.
    routes: dict[int, str]
    #: why same-host ranks did not read shared memory (``TransferReport.shm_fallback``).
    fallback: str | None = None
    #: the abort message's verb for an error that is not the transport's (``interrupted``).
    interrupted = "failed"

    def open(self, at: Transfer) -> None:
        """After the manifest: what the receivers must hear before the first bucket."""

    def write(self, b: Bucket, at: Transfer) -> None:
        raise NotImplementedError

    def drain(self, at: Transfer) -> None:
        """Every bucket written: wait until every receiver has them."""

    def checksums(self, at: Transfer) -> tuple[list[int], list[int]]:
        """The buckets' and the tensors' checksums, for the seal."""
        raise NotImplementedError

    def failed(self, at: Transfer, exc: BaseException) -> None:
        """Clean up after ``exc`` (the loop then aborts the communicator)."""

    def close(self) -> None:
        """Let go of what this transfer alone used (after success or failure)."""

    def settle(self, report: TransferReport) -> TransferReport:
        """After the vote: keep or drop what outlives the transfer; the report, completed."""
        return report


class ReceiveRoute:
    """A receiver's side of a route: begin, staging, open, read per bucket, drain, digests;
    failed on error, close always, settle after the vote."""

    #: the abort message's verb for an error that is not the transport's (``interrupted``).
    interrupted = "failed"

    def begin(self, manifest: Manifest, buckets: list[Bucket], at: Transfer) -> None:
        """After the manifest: whatever else the route must hear or set up before the buckets."""

    def staging(self, at: Transfer) -> tuple[torch.Tensor, int] | None:
        """A buffer the route provides (a node copy), or None: the receiver's own staging."""
        return None

    def open(self, flat: torch.Tensor, at: Transfer) -> None:
        """Staging ready (``flat``): what comes before the first bucket (attach, first receives)."""

    def read(self, b: Bucket, flat: torch.Tensor, at: Transfer) -> None:
        raise NotImplementedError

    def drain(self, at: Transfer) -> None:
        """Every bucket read: what must happen before the seal."""

    def digests(self, at: Transfer) -> list[int]:
        raise NotImplementedError

    def tensor_sums(self, seal: Seal) -> list[int]:
        raise NotImplementedError

    def failed(self, at: Transfer, exc: BaseException) -> None:
        """Clean up after ``exc`` (the loop then aborts the communicator)."""

    def close(self) -> None:
        """Let go of what this transfer alone used (after success or failure)."""

    def settle(self, committed: bool) -> str | None:
        """After the vote: the node copy the committed state views, if any."""
        return None


class HashedReceive(ReceiveRoute):
    """A receiver's route that hashes each bucket itself as it reads it (``hasher``), keeping
    the buckets' digests in order."""

    def __init__(self, hasher: StreamHasher) -> None:
        self.hasher = hasher
        self.bucket_digests: list[int] = []

    def digested(self, b: Bucket, at: Transfer) -> None:
        """Bucket ``b`` is read and hashed."""
        self.bucket_digests.append(self.hasher.bucket_digest(b))
        at.bucket_done()

    def digests(self, at: Transfer) -> list[int]:
        return self.bucket_digests

    def tensor_sums(self, seal: Seal) -> list[int]:
        return self.hasher.tensor_digests(seal.tensor_checksums)


def check(stream: Stream, stage: str, pids: Mapping[int, int]) -> None:
    """Between two slices of a wait: the deadline, abandonment, and the other end's pids."""
    comm = stream.comm
    stream.remaining(stage)  # raises SyncTimeout past the deadline
    if comm.aborted:
        raise comm.aborted_error()
    for rank, pid in pids.items():
        if not pid_alive(pid):
            raise PeerLost(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: rank {rank} (pid {pid}, same host) "
                f"died during {stage}",
                group=comm.group, group_version=comm.version, rank=comm.rank, op=stage, peer=rank,
            )


__all__ = ["POLL_S", "Buffer", "HashedReceive", "Plan", "ReceiveRoute", "SendRoute", "Transfer", "check"]
