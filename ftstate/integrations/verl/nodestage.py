"""The staged update's node copy: one copy of a verl update per node, not one per rollout worker.

In ``commit_mode: staged`` a rollout yields nothing until the final vote says every chunk
verified on every rollout, so the update must be held somewhere until then. Held privately,
that is one full copy of the weights per rollout worker beside its engine's own. Here the node
holds it once: ``build_topology`` (in the driver, which knows every worker's node) makes the
first rollout of each node its **writer** and the others its **followers**.

* **The writer** is the only one of its node in the broadcast group. Each chunk (one ftstate
  transfer each: the chunks arrive lazily, so no layout is known up front) is received
  straight into a segment of its own in ``/dev/shm`` (:class:`NodeReceiver`: a
  :class:`~ftstate.transport.sync.Receiver` whose staging for each transfer is a new
  :class:`~ftstate.transport.nodecopy.NodeCopy`, 0600, space reserved at creation) and
  verified there: the writer keeps no private copy. After the final vote it **publishes the
  outcome**: a small record listing the chunk segments with each chunk's tensor layout and
  the whole-chunk checksum it verified (``ok``), or saying why the update failed
  (``rejected`` / ``failed``), written under a temporary name and renamed into place, so a
  follower sees a whole record or none.
* **A follower** stays out of the gloo group and waits for that record, bounded by the
  update's ``sync_timeout_s``; it polls the writer's pid too (same host), so a writer that died
  (SIGKILL) ends its wait at once with :class:`~ftstate.core.errors.PeerLost` naming it, and
  the manager's ``abandon`` ends it within a poll. On ``ok`` it maps every chunk read-only
  (private mapping: it writes nothing the others read), re-hashes each against the checksum
  the writer verified, and only when all match yields views of them: nothing is yielded
  before the whole update is proven, so a failed update leaves every rollout having yielded
  nothing.
* **A follower that dies** before the vote makes its writer vote the update down (it checks
  its followers' pids just before voting), so a staged update reaches every rollout or none,
  as when a member of the group dies. One that dies after that check is a rollout dying after
  the vote: the others may have applied the update; the manager still hears of its death.

**Names and lifetime.** ``ftstate-<group>.staged-v<group version>-p<writer pid>-g<n>-n0``
(``g0``: the outcome record; ``g1``...: chunks), so an update's segments are found by name.
The writer unlinks them at ``finalize`` (verl calls it once every rollout's
``update_weights`` returned, i.e. once every follower mapped and yielded them; the mappings
outlive the names), at the next update's ``prepare``, and on every failure path. A SIGKILLed
writer leaves orphans (its pid is dead): the manager removes the failed update's segments by
name (:func:`remove_update`) and every writer sweeps orphans when it joins the next update.

Memory: the node holds the update once, shared, while it is in flight; no rollout holds a
private copy of it (on a device transport the writer receives into device staging and copies
each verified chunk into the segment: one chunk of device staging).
"""

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

#: How often a follower looks for the outcome record and at the writer's pid (its wait is
#: bounded by ``sync_timeout_s``; this only sets how soon it notices).
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
    """Unlink every staged segment of ``group`` at ``group_version`` on this host (the manager,
    after a failed update: a SIGKILLed writer cannot); returns the names removed."""
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
        """One verified chunk: kept where it landed (its segment), or copied into a new one
        when it landed elsewhere (a device transport's staging)."""
        entries, flat = chunk._entries, chunk._flat
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
    """A :class:`~ftstate.transport.sync.Receiver` for the writer of a staged update: each
    transfer on the host lands in a new segment of the node's copy (:meth:`StageWriter.segment`)
    instead of a private buffer, and is verified there; nothing is recycled (each chunk's
    segment is the node's until the update ends). A device transport keeps device staging."""

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
    """A follower: wait for the writer's outcome (until ``deadline``, ``sync_timeout_s``), then
    map and re-verify every chunk. Returns the chunks' tensors; raises
    :class:`~ftstate.core.errors.ChecksumMismatch` (a chunk rejected anywhere, or a mapped
    chunk that does not hash to what the writer verified), :class:`PeerLost` (the writer
    died), :class:`SyncTimeout` (no outcome in time), :class:`TransportError` (the update
    failed, or ``abandoned()`` returned a reason: the manager gave the update up). Nothing is returned unless every chunk verified."""
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
        # signed by the writer with the run's key (when the run authenticates): a record planted
        # by anyone else who can write /dev/shm names chunks and checksums of their choosing
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
