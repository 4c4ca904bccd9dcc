"""Host to device, bucket by bucket: a GPU engine loads the committed version through two buckets.

With ``staging: node`` the incoming version is verified and voted on in the node's host copy
(:mod:`ftstate.transport.nodecopy`); only then does each engine load it. An engine whose
weights live on a device must not be handed the whole version on that device first: that is
a second full copy beside its weights, next to a KV cache that already took most of the GPU
(a 70B model in bf16 is 140 GB). :func:`load_by_buckets` moves it instead in parts of
at most ``bucket_bytes`` (``bucket_size_mb``) through two device buffers, used in turn. So the
device holds at most ``2 x bucket_bytes`` beyond the engine's weights, for as long as the load
lasts, and nothing afterwards (a warm spare reserves nothing on the device either: its staging
is the host copy). A tensor larger than a bucket is a part of its own, so the bound is two of
the larger of the bucket and the largest tensor.

The trade-off (docs/configuration.md ``bucket_size_mb``): a smaller bucket bounds the device
memory tighter but costs more copies and more calls into the engine; both buffers are
allocated once per load, not per part.

Order and reuse: every copy and the engine's load of each part go on the device's current
stream, in order, so the copy that overwrites a buffer runs after the engine's kernels that
read the part before it from that buffer (no event is needed); the host waits for the device
once, at the end, before the buffers go. The host-to-device copies do not overlap the
engine's copies (one stream): measured on an H200, the whole load costs 1.00-1.06x a plain
per-tensor ``copy_`` of the same weights, pageable or pinned, 1 and 4 GiB
(``benchmarks/device_buckets.py``), since the engine's device-to-device copy of a part is a
small fraction of the host-to-device copy. After the load torch's caching allocator keeps the
buffers' blocks reserved for the engine's process (not returned to the driver). The memory comes from a :class:`BucketMemory`
(:func:`plain_memory`: ``torch.empty`` on the device), so a test counts what a load allocates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ftstate.core.errors import ManifestError
from ftstate.transport.buckets import align

if TYPE_CHECKING:
    import torch


class BucketMemory(Protocol):
    """Where the two device buckets come from (:class:`~ftstate.transport.cudaipc.CudaIpc` fits too)."""

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A new uint8 tensor of ``nbytes`` on ``device``."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Wait until the work queued on ``device`` is done."""
        ...


class _Plain:
    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def synchronize(self, device: torch.device) -> None:
        import torch

        if device.type == "cuda":
            torch.cuda.synchronize(device)


def plain_memory() -> BucketMemory:
    return _Plain()


#: ``load(part, first, last)``: the engine copies ``part`` (name -> tensor on the device, views
#: into a bucket that is reused two parts later) into its weights before it returns.
LoadPart = Callable[[dict[str, "torch.Tensor"], bool, bool], None]


def parts_of(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, int, int]]]:
    """``tensors`` in order, cut into parts of at most ``bucket_bytes`` (a larger tensor alone):
    each entry (name, offset in the bucket, bytes)."""
    if bucket_bytes <= 0:
        raise ManifestError(f"field 'bucket_bytes': expected a positive size, got {bucket_bytes}",
                            field="bucket_bytes")
    parts: list[list[tuple[str, int, int]]] = []
    used = bucket_bytes  # forces a first part
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        at = align(used)
        if at + n > bucket_bytes and used:
            parts.append([])
            at = 0
        parts[-1].append((name, at, n))
        used = at + n
    return parts


def load_by_buckets(tensors: Mapping[str, torch.Tensor], *, device: torch.device, bucket_bytes: int,
                    load: LoadPart, memory: BucketMemory | None = None, prove: bool = False) -> dict[str, Any]:
    """Load ``tensors`` (on the host: views into the node copy, or a private buffer) into an
    engine on ``device`` through two buckets of device memory (see the module docstring).
    Returns ``buckets`` (parts loaded), ``bucket_bytes`` (one buffer's size) and
    ``device_bytes`` (what the buffers took on the device, at most two buckets).

    ``prove``: also ``state_checksum``, the nh64 whole-state checksum
    (:mod:`ftstate.transport.digest`) of the bytes the device received, each part hashed on the
    device right after its copy and before the engine reads it (no byte goes back to the host).
    It equals the version's checksum when the version was proved with nh64 (its sender's weights
    were on a GPU); compare it with :func:`~ftstate.transport.checksum.state_checksum_like`."""
    import torch

    from ftstate.transport import checksum, digest

    memory = memory or plain_memory()
    key = checksum.nh_key() if prove else None
    proofs: dict[str, int] = {}
    parts = parts_of(tensors, bucket_bytes)
    if not parts:
        return {"buckets": 0, "bucket_bytes": 0, "device_bytes": 0}
    size = max(off + n for part in parts for _, off, n in part[-1:])
    buffers: list[torch.Tensor] = []
    for i, part in enumerate(parts):
        if len(buffers) < min(2, len(parts)):
            buffers.append(memory.alloc(size, device))
        buf = buffers[i % 2]
        views: dict[str, torch.Tensor] = {}
        for name, off, n in part:
            src = tensors[name]
            flat = src.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off : off + n].copy_(flat, non_blocking=False)
            views[name] = buf[off : off + n].view(src.dtype).view(src.shape)
            if key is not None:
                proofs[name] = digest.tensor_digest(buf[off : off + n], key)
        load(views, i == 0, i == len(parts) - 1)
        del views
    memory.synchronize(device)
    device_bytes = size * len(buffers)
    buffers.clear()
    out = {"buckets": len(parts), "bucket_bytes": size, "device_bytes": device_bytes}
    if key is not None:
        out["state_checksum"] = checksum.format_checksum(checksum.combine(
            (name, checksum.dtype_name(t.dtype), tuple(t.shape), proofs[name]) for name, t in tensors.items()),
            digest.NAME)
    return out


__all__ = ["BucketMemory", "LoadPart", "load_by_buckets", "parts_of", "plain_memory"]
