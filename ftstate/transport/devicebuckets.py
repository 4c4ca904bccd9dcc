"""Host to device, bucket by bucket: a GPU engine loads the committed version through two buckets."""

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
    """Load host ``tensors`` into an engine on ``device`` through two device buckets; returns
    ``buckets`` (parts), ``bucket_bytes`` and ``device_bytes`` (at most two buckets)."""
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
