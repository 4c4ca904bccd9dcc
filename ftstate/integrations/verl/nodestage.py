"""The staged update's node copy: one copy of a verl update per node, not one per rollout worker.

In ``commit_mode: staged`` a rollout yields nothing until the final vote says every chunk
verified on every rollout, so the update must be held somewhere until then. Held privately,
that is one full copy of the weights per rollout worker beside its engine's own. Here the node
holds it once: ``build_topology`` (in the driver, which knows every worker's node) makes the
first rollout of each node its **writer** and the others its **followers**.

* **The writer** is the only one of its node in the broadcast group. Each chunk it receives and
  verifies (one ftstate transfer each: the chunks arrive lazily, so no layout is known up
  front) is copied into a segment of its own in ``/dev/shm`` (a
  :class:`~ftstate.transport.nodecopy.NodeCopy`: 0600, space reserved at creation, its header
  carrying the chunk's tensor layout and whole-chunk checksum), and its receive buffer is
  recycled for the next chunk. After the final vote it **publishes the outcome**: a small
  record listing the chunk segments (``ok``) or saying why the update failed (``rejected`` /
  ``failed``), written under a temporary name and renamed into place, so a follower sees a
  whole record or none.
* **A follower** stays out of the gloo group and waits for that record, bounded by the
  update's ``sync_timeout_s``; it polls the writer's pid too (same host), so a writer that died
  (SIGKILL) ends its wait at once with :class:`~ftstate.core.errors.PeerLost` naming it, and
  the manager's ``abandon`` ends it within a poll. On ``ok`` it maps every chunk read-only
  (private mapping: it writes nothing the others read), re-hashes each against the checksum
  the writer verified, and only when all match yields views of them: nothing is yielded
  before the whole update is proven, so a failed update leaves every rollout having yielded
  nothing.

**Names and lifetime.** ``ftstate-<group>.staged-v<group version>-p<writer pid>-g<n>-n0``
(``g0``: the outcome record; ``g1``...: chunks), so an update's segments are found by name.
The writer unlinks them at ``finalize`` (verl calls it once every rollout's
``update_weights`` returned, i.e. once every follower mapped and yielded them; the mappings
outlive the names), at the next update's ``prepare``, and on every failure path. A SIGKILLed
writer leaves orphans (its pid is dead): the manager removes the failed update's segments by
name (:func:`remove_update`) and every writer sweeps orphans when it joins the next update.

Memory: the writer's private staging is one chunk (its receive buffer, reused) and the node's
shared one is the update, once, while it is in flight.
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
from ftstate.transport.buckets import TensorEntry
from ftstate.transport.nodecopy import NodeCopy, copy_name, tensors_of
from ftstate.transport.shm import SHM_DIR, list_segments, parse_name, pid_alive, safe_group, unlink_names

if TYPE_CHECKING:
    import torch

    from ftstate.transport.sync import CommittedWeights

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


def _layout(entries: tuple[TensorEntry, ...], checksum: str) -> bytes:
    return msgpack.packb({"checksum": checksum, "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes]
                                                            for e in entries]})


def _entries(node: NodeCopy) -> tuple[str, tuple[TensorEntry, ...]]:
    try:
        data = msgpack.unpackb(node.manifest)
        entries = tuple(TensorEntry(str(n), str(d), tuple(int(s) for s in shape), int(o), int(b))
                        for n, d, shape, o, b in data["tensors"])
        checksum = str(data["checksum"])
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"staged segment {node.name!r}: malformed layout: {exc}", field="layout") from exc
    if any(e.end > node.data_bytes for e in entries):
        raise ManifestError(f"staged segment {node.name!r}: its layout exceeds its {node.data_bytes} bytes",
                            field="layout")
    return checksum, entries


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
        self._chunks: list[tuple[NodeCopy, tuple[TensorEntry, ...]]] = []
        self._names: list[str] = []
        self._published = False

    def add(self, chunk: CommittedWeights) -> None:
        """Copy one verified chunk into a new segment (its receive buffer is then free again)."""
        entries = chunk._entries
        flat = chunk._flat
        if entries is None or flat is None:
            raise TransportError("staged node copy: a received chunk has no flat layout")
        size = max((e.end for e in entries), default=0)
        node = NodeCopy.create(stage_group(self.group), group_version=self.group_version, owner=os.getpid(),
                               weights_version=chunk.weights_version,
                               manifest=_layout(entries, chunk.state_checksum), data_bytes=size)
        self._names.append(node.name)  # named first: unlinked on every path out, even a failed copy
        if size:
            node.data.copy_(flat[:size])
        self._chunks.append((node, entries))
        self.nbytes += size

    def publish(self, status: str, reason: str = "") -> None:
        """The outcome record, atomically (a temporary name renamed into place); once."""
        if self._published:
            return
        self._published = True
        record = msgpack.packb({"status": status, "reason": reason, "chunks": self._names})
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
        return [tensors_of(node.data, _Layout(entries)) for node, entries in self._chunks]

    def close(self) -> None:
        """Unlink every name of this update (mappings, and tensors viewing them, live on)."""
        unlink_names(self._names)
        for node, _ in self._chunks:
            node.close()
        self._names, self._chunks = [], []


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
        record = msgpack.unpackb(record_copy.manifest)
        status, reason, chunks = str(record["status"]), str(record["reason"]), [str(n) for n in record["chunks"]]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"{me}: staged outcome {name!r} is malformed: {exc}", field="outcome") from exc
    finally:
        record_copy.close()
    if status == REJECTED:
        raise ChecksumMismatch(f"{me}: staged update not applied: {reason}; nothing was yielded")
    if status != OK:
        raise TransportError(f"{me}: staged update not applied: {writer} reports {reason}; nothing was yielded")
    out: list[Mapping[str, torch.Tensor]] = []
    for chunk in chunks:
        node = NodeCopy.attach(chunk, group=sgroup, owner=writer_pid, group_version=group_version, writer=writer_pid)
        try:
            checksum, entries = _entries(node)
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


__all__ = ["StageWriter", "remove_update", "segments_of", "stage_group", "sweep", "wait_and_map"]
