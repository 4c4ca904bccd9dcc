"""Moving a whole state of weights over a communicator: bucketed, pipelined, checksummed, atomic."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ftstate.core.errors import ChecksumMismatch, DeadlineExceeded, SharedMemoryUnavailable, TransportError
from ftstate.transport import hostmem
from ftstate.transport.base import Communicator
from ftstate.transport.buckets import bucket_segments, plan_layout
from ftstate.transport.checksum import (
    combine,
    format_checksum,
    function_for,
    host_copied_bytes,
    state_checksum,
    torch_dtype,
)
from ftstate.transport.hashing import own_state_checksum, verify
from ftstate.transport.manifest import (
    Manifest,
    Seal,
    decode_manifest,
    decode_seal,
    encode_manifest,
    encode_seal,
)
from ftstate.transport.routes.base import Plan, ReceiveRoute, SendRoute, Transfer
from ftstate.transport.routes.broadcast import BroadcastReceive, BroadcastSend
from ftstate.transport.stream import (
    VOTE_CHECKSUM_MISMATCH,
    VOTE_COMMIT,
    VOTE_NAMES,
    BroadcastStream,
    PeerStream,
    Stream,
    with_stage,
)
from ftstate.transport.validate import check_state_dict
from ftstate.transport.weights import DEFAULT_BUCKET_SIZE, CommittedWeights, OnProgress, TransferReport

log = logging.getLogger("ftstate.transport")


# -- sender --------------------------------------------------------------------------------


class Sender:
    """Sends whole states; keeps its two packing buffers between transfers."""

    def __init__(self, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> None:
        plan_layout([], bucket_size)  # validates the size
        self.bucket_size = bucket_size
        self._pack: list[torch.Tensor | None] = [None, None]
        #: what the same-host routes keep between transfers: their slots (routes.slots) and the
        #: node copies written (routes.nodecopy), so the readers keep their mappings
        self.shm_slots: Any = None
        self.node_copies: Any = None

    def broadcast(
        self,
        comm: Communicator,
        weights: Mapping[str, torch.Tensor] | CommittedWeights,
        *,
        weights_version: int | None = None,
        timeout_s: float,
        progress: OnProgress | None = None,
    ) -> TransferReport:
        """Send ``weights`` to every other member of ``comm``; ``timeout_s`` bounds manifest to vote.

        Raises PeerLost, SyncTimeout, StaleGroupVersion (fenced), or StateDictError before
        sending for a mapping that cannot travel; receivers that rejected the data are in the report."""
        stream = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=comm.rank, sending=True)
        return self.transfer(stream, weights, weights_version, progress, self._broadcast_route)

    def send_to(
        self,
        comm: Communicator,
        peer: int,
        weights: Mapping[str, torch.Tensor] | CommittedWeights,
        *,
        weights_version: int | None = None,
        timeout_s: float,
        progress: OnProgress | None = None,
    ) -> TransferReport:
        """Send ``weights`` to ``peer`` only (same manifest, checksums and atomic commit)."""
        stream = PeerStream(comm, time.monotonic() + timeout_s, timeout_s, peer=peer, sending=True)
        return self.transfer(stream, weights, weights_version, progress, self._broadcast_route)

    # -- internals ----------------------------------------------------------------------

    def state_to_send(
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

    def report(
        self, comm: Communicator, manifest: Manifest, state: int, num_buckets: int, started: float,
        votes: Mapping[int, int], routes: Mapping[int, str] | None = None, shm_fallback: str | None = None,
        host_from: int = 0,
    ) -> TransferReport:
        """The sender's report of a completed transfer, logged. ``host_from``: the process's
        :func:`host_copied_bytes` when the transfer began."""
        report = TransferReport(
            group=comm.group,
            group_version=comm.version,
            weights_version=manifest.weights_version,
            state_checksum=format_checksum(state, manifest.digest),
            nbytes=manifest.payload_bytes,
            num_buckets=num_buckets,
            seconds=time.monotonic() - started,
            committed=tuple(sorted(r for r, v in votes.items() if v == VOTE_COMMIT)),
            rejected={r: VOTE_NAMES.get(v, f"vote {v}") for r, v in sorted(votes.items()) if v != VOTE_COMMIT},
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

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Packing buffer ``slot``, at least ``nbytes`` long (grown on demand, kept between
        transfers: only buckets of small tensors are packed, so they stay small in practice)."""
        buf = self._pack[slot]
        if buf is None or buf.device != device or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._pack[slot] = buf
        return buf[:nbytes]

    def _broadcast_route(self, stream: Stream, plan: Plan) -> SendRoute:
        return BroadcastSend(stream, plan, self.buffer, self._drop_buffers)

    def _drop_buffers(self) -> None:
        self._pack = [None, None]

    def transfer(
        self,
        stream: Stream,
        weights: Mapping[str, torch.Tensor] | CommittedWeights,
        weights_version: int | None,
        progress: OnProgress | None,
        route: Callable[[Stream, Plan], SendRoute],
    ) -> TransferReport:
        """One transfer on ``stream``, the buckets' bytes moved by the route ``route`` makes
        for the plan: manifest, every bucket, seal, vote, report. Every route's sender."""
        comm = stream.comm
        started, host_from = time.monotonic(), host_copied_bytes()
        tensors, weights_version, committed = self.state_to_send(comm, weights, weights_version)
        comm.check_usable()
        plan = Plan.of(stream, tensors, weights_version, self.bucket_size, committed)
        manifest = plan.manifest
        way = route(stream, plan)  # may refuse the transfer (SharedMemoryUnavailable) before anything is sent
        at = Transfer("manifest", progress, len(plan.buckets))
        try:
            stream.send_message(encode_manifest(manifest), at.stage)
            stream.transfer = manifest.transfer
            way.open(at)
            for b in plan.buckets:
                at.stage = f"bucket {b.index + 1}/{at.buckets}"
                way.write(b, at)
            way.drain(at)
            digests, tensor_sums = way.checksums(at)
            state = combine((e.name, e.dtype, e.shape, h) for e, h in zip(plan.entries, tensor_sums, strict=True))
            seal = Seal(comm.group, comm.version, weights_version, tuple(digests), tuple(tensor_sums), state,
                        manifest.transfer)
            at.stage = "seal"
            stream.send_message(encode_seal(seal), at.stage)
            at.stage = "commit vote"
            votes = stream.vote(VOTE_COMMIT, at.stage)
        except SharedMemoryUnavailable as exc:  # said as it is: the caller's fallback reads it
            way.failed(at, exc)
            comm.abort(f"weight transfer failed during {at.stage}")
            raise
        except (TransportError, DeadlineExceeded) as exc:
            way.failed(at, exc)
            comm.abort(f"weight transfer failed during {at.stage}")
            raise with_stage(exc, at.stage, weights_version, stream) from exc
        except BaseException as exc:
            way.failed(at, exc)
            comm.abort(f"weight transfer {way.interrupted} during {at.stage}")
            raise
        finally:
            way.close()
        report = self.report(comm, manifest, state, len(plan.buckets), started, votes, way.routes, way.fallback,
                             host_from)
        return way.settle(report)


# -- receiver ------------------------------------------------------------------------------


def _fresh(nbytes: int, device: torch.device) -> torch.Tensor:
    """A staging buffer of ``nbytes`` never touched: on the host, on huge pages
    (:mod:`ftstate.transport.hostmem`: a fresh staging buffer's page faults are a sizeable
    part of a sync whose receiver keeps no spare)."""
    if device.type == "cpu":
        return hostmem.empty_host(nbytes)
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)


def use_count(t: torch.Tensor) -> int | None:
    """How many references hold ``t``'s storage (None when torch does not tell)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    try:
        return int(counter(t.untyped_storage()._cdata))
    except Exception:  # noqa: BLE001 - a private torch API: without it buffers are simply not recycled
        return None


class Receiver:
    """Owns one member's committed weights and replaces them only with a complete, verified state."""

    def __init__(
        self, initial: Mapping[str, torch.Tensor] | None = None, *, weights_version: int | None = None
    ) -> None:
        self._committed: CommittedWeights | None = None
        self._spare: tuple[torch.Tensor, int] | None = None
        # Held while reserve() makes the spare, so a transfer waits for it instead of
        # page-faulting a second buffer beside it on the same cores.
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
        """Bytes of buffers kept between transfers (committed staging and spare): what fault
        tolerance costs a rollout in memory. A node copy is the node's, counted elsewhere."""
        seen: set[int] = set()
        total = 0
        c = self._committed
        for buf in (c.flat if c is not None and c.node_copy is None else None,
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
        """Drop the committed bytes and the spare, keeping the version and checksum: the engine
        is now the only full copy. ``keep_spare``: the committed buffer becomes the spare, reused
        only if nothing else still holds a view of it."""
        c = self._committed
        spare = (c.flat, c.baseline) if keep_spare and c is not None and c.flat is not None \
            and c.node_copy is None else None
        if c is not None and c.flat is not None:
            self._committed = dataclasses.replace(c, tensors=types.MappingProxyType({}), _flat=None, _entries=None,
                                                  _windows=None, _seal=None, _baseline=0)
        self._spare = spare

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Allocate and touch the next staging buffer (``nbytes``) now, so its page faults are
        paid off the transfer's critical path."""
        with self._reserving:
            if self._spare is not None and self._spare[0].device == device and self._spare[0].numel() >= nbytes:
                return
            buf = _fresh(nbytes, device)
            buf.zero_()
            self._spare = (buf, use_count(buf) or 0)

    def corrupt_next_bucket(self) -> None:
        """Chaos/test hook: flip one byte of the next bucket this receiver gets, after it
        arrived and before it is checked (so the transfer ends in ChecksumMismatch)."""
        self._corrupt_next = True

    def receive_broadcast(
        self, comm: Communicator, *, root: int = 0, timeout_s: float, progress: OnProgress | None = None
    ) -> CommittedWeights:
        """Receive and commit the state ``root`` broadcasts within ``timeout_s``; returns :attr:`committed`.

        Raises ChecksumMismatch, PeerLost, SyncTimeout, StaleGroupVersion or ManifestError,
        leaving :attr:`committed` unchanged."""
        stream = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=root, sending=False)
        return self.transfer(stream, progress, BroadcastReceive(stream, self.take_damage))

    def receive_from(
        self, comm: Communicator, peer: int, *, timeout_s: float, progress: OnProgress | None = None
    ) -> CommittedWeights:
        """Receive a state sent to this member only by ``peer`` (:meth:`Sender.send_to`)."""
        stream = PeerStream(comm, time.monotonic() + timeout_s, timeout_s, peer=peer, sending=False)
        return self.transfer(stream, progress, BroadcastReceive(stream, self.take_damage))

    # -- internals ----------------------------------------------------------------------

    def staging(self, nbytes: int, device: torch.device, wait_s: float = 0.0) -> tuple[torch.Tensor, int]:
        """The buffer a transfer of ``nbytes`` lands in: the spare when it fits and nobody else
        holds it, else a fresh one. A reserve in flight is waited for up to ``wait_s`` (what is
        left of the transfer's deadline); past that the transfer allocates its own."""
        if self._reserving.acquire(timeout=max(wait_s, 0.0)):
            self._reserving.release()
        spare, self._spare = self._spare, None
        if spare is not None:
            buf, baseline = spare
            count = use_count(buf)
            if buf.device == device and buf.numel() >= nbytes and count is not None and count <= baseline:
                self._peak = self.held_bytes + buf.numel()
                return buf, baseline
        try:
            buf = _fresh(nbytes, device)
        except (RuntimeError, MemoryError, OSError) as exc:  # the manifest passed its caps, not this host's memory
            raise TransportError(f"staging for a transfer of {nbytes} bytes cannot be allocated on {device}: "
                                 f"{str(exc)[:200]}") from exc
        self._peak = self.held_bytes + buf.numel()
        return buf, use_count(buf) or 0


    def take_damage(self, applies: bool) -> bool:
        """Whether the bucket at hand is the one :meth:`corrupt_next_bucket` asked to damage:
        True once, for the first bucket where ``applies``."""
        if self._corrupt_next and applies:
            self._corrupt_next = False
            return True
        return False

    def transfer(self, stream: Stream, progress: OnProgress | None, route: ReceiveRoute) -> CommittedWeights:
        """One transfer on ``stream``, the buckets' bytes moved by ``route``: every bucket into
        staging, the seal compared, the vote, the commit. Every route's receiver; on any error
        :attr:`committed` is exactly what it was."""
        comm = stream.comm
        kept = self._committed
        at = Transfer("manifest", progress)
        manifest: Manifest | None = None
        way = route
        self._host_from = host_copied_bytes()
        comm.check_usable()
        try:
            manifest = decode_manifest(stream.recv_message(at.stage), group=comm.group, group_version=comm.version)
            stream.transfer = manifest.transfer
            buckets = bucket_segments(manifest.tensors, manifest.buckets)
            at.buckets = len(buckets)
            way.begin(manifest, buckets, at)
            staging = way.staging(at)
            if staging is not None:  # no staging of its own: its peak is what it already keeps
                self._peak = self.held_bytes
            else:
                staging = self.staging(manifest.total_bytes, comm.device, stream.deadline - time.monotonic())
                zero_padding(staging[0], manifest)
            flat = staging[0]
            way.open(flat, at)
            for b in buckets:
                at.stage = f"bucket {b.index + 1}/{at.buckets}"
                way.read(b, flat, at)
            way.drain(at)
            at.stage = "seal"
            seal = decode_seal(stream.recv_message(at.stage), manifest)
            at.stage = "checksums"
            digests = way.digests(at)
            tensor_sums = way.tensor_sums(seal)
            own = own_state_checksum(manifest, tensor_sums)
            problem = verify(manifest, seal, digests, tensor_sums, own)
            at.stage = "commit vote"
            stream.vote(VOTE_COMMIT if problem is None else VOTE_CHECKSUM_MISMATCH, at.stage)
        except SharedMemoryUnavailable as exc:
            self._failed(comm, way, at, exc, "failed")
            raise
        except (TransportError, DeadlineExceeded) as exc:
            self._failed(comm, way, at, exc, "failed")
            wv = manifest.weights_version if manifest is not None else None
            raise with_stage(exc, at.stage, wv, stream) from exc
        except BaseException as exc:
            self._failed(comm, way, at, exc, way.interrupted)
            raise
        finally:
            way.close()
        node = way.settle(problem is None)
        return self._conclude(comm, manifest, seal, staging, kept, problem, own, node=node)

    @staticmethod
    def _failed(comm: Communicator, way: ReceiveRoute, at: Transfer, exc: BaseException, verb: str) -> None:
        way.failed(at, exc)
        comm.abort(f"weight transfer {verb} during {at.stage}")

    def _conclude(
        self, comm: Communicator, manifest: Manifest, seal: Seal, staging: tuple[torch.Tensor, int],
        kept: CommittedWeights | None, problem: str | None, own: int, node: str | None = None,
    ) -> CommittedWeights:
        """After the vote: raise ChecksumMismatch for ``problem``, else commit the staged state.
        ``own``: this member's checksum of the bytes it received, never the seal's (keyed
        integrity reuses the seal's digests only once every bucket's matched). ``node``:
        ``staging`` maps that node copy, never a buffer to recycle."""
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
        elif kept is not None and kept.flat is not None and kept.node_copy is None:
            self._spare = (kept.flat, kept.baseline)
        log.info(
            "weights committed",
            extra={"group": comm.group, "group_version": comm.version, "rank": comm.rank,
                   "weights_version": new.weights_version, "state_checksum": new.state_checksum,
                   "bytes": new.nbytes, "previous_weights_version": kept_version, "host_bytes": new.host_bytes},
        )
        return new


def zero_padding(flat: torch.Tensor, manifest: Manifest) -> None:
    """Zero the alignment gaps between tensors (never sent), so a resend from this buffer
    leaks no stale memory."""
    cursor = 0
    for e in sorted(manifest.tensors, key=lambda e: e.offset):
        if e.offset > cursor:
            flat[cursor : e.offset].zero_()
        cursor = max(cursor, e.end)


__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "CommittedWeights",
    "OnProgress",
    "Receiver",
    "Sender",
    "TransferReport",
    "use_count",
    "zero_padding",
]
