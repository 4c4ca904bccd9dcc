"""The staged update's node copy, in verl's rollout workers: one copy of a verl update per node, not one per
rollout. The node's first rollout (the writer) receives each chunk straight into a ``/dev/shm`` segment,
verifies it and publishes the vote's outcome atomically; the others (followers) wait for it, map the segments
read-only, re-verify and only then yield. Names, lifetime and the failure cases are in docs/integration.md
("verl")."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from ftstate.core.errors import ChecksumMismatch, ManifestError, PeerLost, SyncTimeout, TransportError
from ftstate.transport import auth
from ftstate.transport.buckets import TensorEntry
from ftstate.transport.hostmem import copy_bytes
from ftstate.transport.nodecopy import NodeCopy, copy_name, tensors_of
from ftstate.transport.shm import SHM_DIR, list_segments, parse_name, pid_alive, safe_group, unlink_names
from ftstate.transport.sync import Receiver, use_count

if TYPE_CHECKING:
    import torch

    from ftstate.transport.sync import CommittedWeights

#: The channel the outcome record's tag is bound to (:func:`ftstate.transport.auth.sign`).
OUTCOME_CHANNEL = "verl_staged_outcome"

#: Appended to the weight group's name in every staged segment's name.
SUFFIX = ".staged"

#: How often a follower checks for the outcome record and the writer's pid (sync_timeout_s bounds the wait).
POLL_S = 0.01

OK, REJECTED, FAILED = "ok", "rejected", "failed"


def stage_group(group: str) -> str:
    """The group name staged segments of weight group ``group`` carry."""
    return f"{group}{SUFFIX}"


def outcome_name(group: str, group_version: int, writer: int) -> str:
    return copy_name(stage_group(group), group_version, writer, 0)


def segments_of(group: str, group_version: int | None = None) -> list[str]:
    """The staged segments of ``group`` in this host's ``/dev/shm`` (of ``group_version`` when given)."""
    want = safe_group(stage_group(group))
    out = []
    for name in list_segments():
        fields = parse_name(name)
        if fields is not None and fields["kind"] == "node" and fields["group"] == want and (
                group_version is None or fields["version"] == group_version):
            out.append(name)
    return out


def remove_update(group: str, group_version: int) -> list[str]:
    """Unlink every staged segment of ``group`` at ``group_version`` here (a SIGKILLed writer cannot)."""
    names = segments_of(group, group_version)
    unlink_names(names)
    return names


def _layout(name: str, entries: tuple[TensorEntry, ...], checksum: str) -> list:
    return [name, checksum, [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]]


def _entries(row: object) -> tuple[str, str, tuple[TensorEntry, ...]]:
    try:
        name, checksum, tensors = row  # type: ignore[misc]
        entries = tuple(TensorEntry(str(n), str(d), tuple(int(s) for s in shape), int(o), int(b))
                        for n, d, shape, o, b in tensors)
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"staged outcome: malformed chunk layout: {exc}", field="layout") from exc
    return str(name), str(checksum), entries


@dataclass
class _Layout:
    """What :func:`~ftstate.transport.nodecopy.tensors_of` needs of a manifest."""

    tensors: tuple[TensorEntry, ...]


class StageWriter:
    """The writer's side of one staged update on its node (see the module docstring)."""

    def __init__(self, group: str, group_version: int) -> None:
        self.group = group
        self.group_version = group_version
        self.nbytes = 0
        self._chunks: list[tuple[NodeCopy, tuple[TensorEntry, ...], str]] = []
        self._fresh: NodeCopy | None = None  # the segment the transfer in progress lands in
        self._names: list[str] = []
        self._published = False

    def segment(self, nbytes: int) -> torch.Tensor:
        """A new segment of ``nbytes`` for the next chunk to land in (:class:`NodeReceiver`)."""
        node = NodeCopy.create(stage_group(self.group), group_version=self.group_version, owner=os.getpid(),
                               weights_version=0, manifest=b"", data_bytes=nbytes)
        self._names.append(node.name)  # named at once: unlinked on every path out, even a failed chunk
        self._fresh = node
        self.nbytes += nbytes
        return node.data

    def add(self, chunk: CommittedWeights) -> None:
        """One verified chunk: kept in its segment, or copied into a new one (device staging)."""
        entries, flat = chunk.entries, chunk.flat
        if entries is None or flat is None:
            raise TransportError("staged node copy: a received chunk has no flat layout")
        node, self._fresh = self._fresh, None
        if node is None or flat.numel() == 0 or flat.data_ptr() != node.data.data_ptr():
            size = max((e.end for e in entries), default=0)
            data = self.segment(size)
            node, self._fresh = self._fresh, None
            if size:
                copy_bytes(data, flat[:size])
        assert node is not None
        self._chunks.append((node, entries, chunk.state_checksum))

    def publish(self, status: str, reason: str = "") -> None:
        """The outcome record, atomically (a temporary name renamed into place); once."""
        if self._published:
            return
        self._published = True
        record = auth.sign(OUTCOME_CHANNEL, self.group, self.group_version, os.getpid(), msgpack.packb(
            {"status": status, "reason": reason, "chunks": [_layout(n.name, e, c) for n, e, c in self._chunks]}))
        tmp = NodeCopy.create(stage_group(self.group), group_version=self.group_version, owner=os.getpid(),
                              weights_version=0, manifest=record, data_bytes=0)
        final = outcome_name(self.group, self.group_version, os.getpid())
        self._names.append(final)
        try:
            os.rename(SHM_DIR / tmp.name, SHM_DIR / final)
        except OSError:
            unlink_names([tmp.name])
            raise
        finally:
            tmp.close()

    def tensors(self) -> list[dict[str, torch.Tensor]]:
        """The writer's own views of the update, chunk by chunk."""
        return [tensors_of(node.data, _Layout(entries)) for node, entries, _ in self._chunks]

    def close(self) -> None:
        """Unlink every name of this update (mappings, and tensors viewing them, live on)."""
        unlink_names(self._names)
        for node, _, _ in self._chunks:
            node.close()
        self._names, self._chunks, self._fresh = [], [], None


class NodeReceiver(Receiver):
    """A :class:`~ftstate.transport.sync.Receiver` for a staged writer: each transfer lands in a new segment
    of the node's copy and is verified there; nothing is recycled."""

    def __init__(self, writer: StageWriter) -> None:
        super().__init__()
        self._writer = writer

    def _staging(self, nbytes: int, device: torch.device, wait_s: float = 0.0) -> tuple[torch.Tensor, int]:
        if device.type != "cpu":
            return super()._staging(nbytes, device, wait_s)
        self._spare = None  # the last chunk's segment stays the node's, never this receiver's spare
        buf = self._writer.segment(nbytes)
        self._peak = buf.numel()
        return buf, use_count(buf) or 0


def wait_and_map(group: str, group_version: int, *, writer_pid: int, writer: str, me: str, deadline: float,
                 timeout_s: float, abandoned: Callable[[], str | None]) -> list[Mapping[str, torch.Tensor]]:
    """A follower: wait for the writer's outcome until ``deadline``, then map and re-verify every chunk;
    returns the tensors only when all verified. Raises ``ChecksumMismatch``, ``PeerLost`` (writer died),
    ``SyncTimeout``, or ``TransportError`` (failed, or ``abandoned()`` gave a reason)."""
    from ftstate.transport.checksum import state_checksum

    sgroup = stage_group(group)
    name = outcome_name(group, group_version, writer_pid)
    while True:
        if os.path.exists(SHM_DIR / name):
            break
        why = abandoned()
        if why is not None:
            raise TransportError(f"{me}: staged update (group version {group_version}) abandoned while waiting "
                                 f"for {writer}: {why}; nothing was yielded")
        if not pid_alive(writer_pid):
            raise PeerLost(f"{me}: {writer}, the writer of this node's staged copy, died during the update "
                           f"(group version {group_version}); nothing was yielded", op="staged update")
        if time.monotonic() >= deadline:
            raise SyncTimeout(f"verl staged update: waiting for the node copy of {writer}", key="sync_timeout_s",
                              seconds=timeout_s, member=me, group_version=group_version, missing=[writer])
        time.sleep(POLL_S)
    record_copy = NodeCopy.attach(name, group=sgroup, owner=writer_pid, group_version=group_version,
                                  writer=writer_pid)
    try:
        # Signed with the run's key: else anyone who can write /dev/shm could name chunks and checksums.
        payload = auth.verify(OUTCOME_CHANNEL, group, group_version, writer_pid, bytes(record_copy.manifest),
                              peer=writer)
        if payload is None:
            raise ManifestError(f"{me}: staged outcome {name!r} does not authenticate as {writer}'s; "
                                "nothing was yielded", field="outcome")
        record = msgpack.unpackb(payload)
        status, reason, chunks = str(record["status"]), str(record["reason"]), list(record["chunks"])
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"{me}: staged outcome {name!r} is malformed: {exc}", field="outcome") from exc
    finally:
        record_copy.close()
    if status == REJECTED:
        raise ChecksumMismatch(f"{me}: staged update not applied: {reason}; nothing was yielded")
    if status != OK:
        raise TransportError(f"{me}: staged update not applied: {writer} reports {reason}; nothing was yielded")
    out: list[Mapping[str, torch.Tensor]] = []
    for row in chunks:
        chunk, checksum, entries = _entries(row)
        try:
            node = NodeCopy.attach(chunk, group=sgroup, owner=writer_pid, group_version=group_version,
                                   writer=writer_pid)
        except ManifestError as exc:
            raise ManifestError(f"{me}: {exc}; the update's segments on this node now: "
                                f"{segments_of(group, group_version)}", field="node_copy") from exc
        try:
            if any(e.end > node.data_bytes for e in entries):
                raise ManifestError(f"{me}: staged chunk {chunk!r}: its layout exceeds its {node.data_bytes} bytes",
                                    field="layout")
            tensors = tensors_of(node.data, _Layout(entries))
        finally:
            node.close()  # the tensors keep the mapping
        held = state_checksum(tensors)
        if held != checksum:
            raise ChecksumMismatch(f"{me}: staged chunk {chunk!r} hashes to {held}, {writer} verified {checksum}; "
                                   "nothing was yielded")
        out.append(tensors)
    return out


def sweep(group: str) -> None:
    """Remove this group's staged segments whose writer is gone (a SIGKILLed writer's)."""
    with contextlib.suppress(OSError):
        unlink_names([n for n in segments_of(group) if not pid_alive(int(parse_name(n)["pid"]))])  # type: ignore[index]


__all__ = ["NodeReceiver", "StageWriter", "remove_update", "segments_of", "stage_group", "sweep", "wait_and_map"]
