"""What a transfer produces: the receiver's committed weights and the sender's report."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ftstate.transport.buckets import TensorEntry
from ftstate.transport.checksum import function_of
from ftstate.transport.manifest import Seal

#: Default bucket size (the config's ``bucket_size_mb`` default, 256 MiB), in bytes.
DEFAULT_BUCKET_SIZE = 256 * 1024 * 1024

#: Buckets on the wire at once, so that the next operation is queued before the current
#: one drains (a gap between two gloo operations costs throughput). Independent of the
#: sender's two packing buffers, which are reused only once their last send completed.
WINDOW = 3

OnProgress = Callable[[int, int], None]
"""Called after each bucket with ``(buckets done, buckets in total)``; may be used to
show progress in heartbeats. An exception raised by it aborts the transfer."""


@dataclass(frozen=True)
class CommittedWeights:
    """A complete, verified state held by a :class:`Receiver` (or given to it initially)."""

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

    @property
    def flat(self) -> torch.Tensor | None:
        """The staging buffer ``tensors`` view (None: released, or given without one)."""
        return self._flat

    @property
    def entries(self) -> tuple[TensorEntry, ...] | None:
        """Where each tensor lies in :attr:`flat`."""
        return self._entries

    @property
    def baseline(self) -> int:
        """The use count of :attr:`flat` when only its receiver holds it (more: someone kept a view)."""
        return self._baseline

    @property
    def node_copy(self) -> str | None:
        """The node copy whose mapping ``tensors`` view (:mod:`ftstate.transport.nodecopy`); None: a
        private buffer."""
        return self._node

    def staged_as(self, entries: tuple[TensorEntry, ...]) -> torch.Tensor | None:
        """The staging buffer these weights view when it is laid out as ``entries`` (a resend
        then sends slices of it), else None."""
        return self._flat if self._flat is not None and self._entries == entries else None

    def seal_for(self, entries: tuple[TensorEntry, ...], windows: tuple[tuple[int, int], ...],
                 function: str) -> Seal | None:
        """The seal these weights were verified against, when a transfer cuts them into the same
        buckets and hashes with the same ``function``: its checksums can go out again (a
        failover's resync) instead of being hashed again; every receiver hashes what it reads."""
        if self._seal is None or self._entries != entries or self._windows != windows:
            return None
        return self._seal if function_of(self.state_checksum) == function else None


@dataclass(frozen=True)
class TransferReport:
    """What the sender knows after a transfer."""

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


__all__ = ["DEFAULT_BUCKET_SIZE", "WINDOW", "CommittedWeights", "OnProgress", "TransferReport"]
