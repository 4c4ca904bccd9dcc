"""Device memory that other processes on the host can map: the same-host route's slots on a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgpack

from ftstate.core.errors import ManifestError

if TYPE_CHECKING:
    import torch


@runtime_checkable
class DeviceMemory(Protocol):
    """Memory on a device that other processes on this host can map (one implementation per kind)."""

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A new uint8 tensor of ``nbytes`` on ``device`` that :meth:`export` can hand out."""
        ...

    def export(self, t: torch.Tensor) -> bytes:
        """An opaque handle to ``t`` (made by :meth:`alloc` here) that another process opens."""
        ...

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        """The memory ``handle`` names, mapped into this process on its own ``device``.
        A malformed handle raises :class:`~ftstate.core.errors.ManifestError` (field ``handles``)."""
        ...

    def unlink(self, t: torch.Tensor) -> None:
        """Every process that maps ``t`` has opened it: whatever names it on the host can go
        (the memory stays with the mappings). Idempotent."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Return once all work this process queued on ``device`` is done."""
        ...

    def release(self, t: torch.Tensor) -> None:
        """This process is done with ``t`` (allocated or opened here); the caller drops its references."""
        ...


#: The fields of ``rebuild_cuda_tensor``'s arguments a handle carries: the device index and the
#: IPC handles of the allocation, its reference counter and its sharing event.
_STORAGE = ("device", "handle", "storage_size", "storage_offset", "requires_grad", "ref_handle", "ref_offset",
            "event_handle", "event_sync")


def pack_rebuild_args(args: tuple) -> bytes:
    """A handle from the arguments ``reduce_tensor`` gives for a uint8 CUDA tensor (msgpack of
    its plain fields; the tensor and storage classes and the dtype are implied)."""
    size, stride, offset = args[1], args[2], args[3]
    rest = dict(zip(_STORAGE, args[6:15], strict=True))
    return msgpack.packb({"kind": "cuda-ipc", "size": [int(x) for x in size], "stride": [int(x) for x in stride],
                          "offset": int(offset), **rest}, use_bin_type=True)


def unpack_rebuild_args(handle: bytes, device_index: int) -> tuple:
    """``rebuild_cuda_tensor``'s arguments from a handle, the device index replaced by
    ``device_index`` (the writer's means nothing under another ``CUDA_VISIBLE_DEVICES``, as in
    vLLM, verl and OpenRLHF). Raises ManifestError (field ``handles``) for a bad handle."""
    try:
        d = msgpack.unpackb(handle, raw=False, strict_map_key=True) if isinstance(handle, bytes) else None
    except Exception as exc:
        raise ManifestError(f"malformed device handle: not msgpack: {exc}", field="handles") from exc

    def bad(what: str) -> ManifestError:
        return ManifestError(f"malformed device handle: {what}: {handle!r:.80}", field="handles")

    if not isinstance(d, dict) or d.get("kind") != "cuda-ipc":
        raise bad("not a CUDA IPC handle")
    ints = ("offset", "device", "storage_size", "storage_offset", "ref_offset")
    for name in ints:
        if not isinstance(d.get(name), int) or isinstance(d.get(name), bool):
            raise bad(f"field {name!r}")
    for name in ("size", "stride"):
        if not isinstance(d.get(name), list) or not all(isinstance(x, int) for x in d[name]):
            raise bad(f"field {name!r}")
    for name in ("handle", "ref_handle"):
        if not isinstance(d.get(name), bytes):
            raise bad(f"field {name!r}")
    if d.get("event_handle") is not None and not isinstance(d["event_handle"], bytes):
        raise bad("field 'event_handle'")
    for name in ("requires_grad", "event_sync"):
        if not isinstance(d.get(name), bool):
            raise bad(f"field {name!r}")
    return (tuple(d["size"]), tuple(d["stride"]), d["offset"], device_index, d["handle"], d["storage_size"],
            d["storage_offset"], d["requires_grad"], d["ref_handle"], d["ref_offset"], d["event_handle"],
            d["event_sync"])


class CudaIpc:
    """:class:`DeviceMemory` on CUDA, through torch's CUDA IPC (the caching allocator's blocks,
    reference-counted across processes by torch)."""

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)

    def export(self, t: torch.Tensor) -> bytes:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        if t.device.type != "cuda" or t.dtype != torch.uint8:
            raise ValueError(f"CudaIpc exports the uint8 CUDA tensors it allocated, not {t.dtype} on {t.device}")
        _rebuild, args = reduce_tensor(t.detach())
        return pack_rebuild_args(args)

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        import torch
        import torch.cuda
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = device.index if device.index is not None else torch.cuda.current_device()
        size, stride, offset, *storage = unpack_rebuild_args(handle, index)
        return rebuild_cuda_tensor(torch.Tensor, size, stride, offset, torch.storage.TypedStorage, torch.uint8,
                                   *storage)

    def unlink(self, t: torch.Tensor) -> None:
        """Nothing: a CUDA IPC handle names nothing on the host."""

    def synchronize(self, device: torch.device) -> None:
        import torch.cuda

        torch.cuda.current_stream(device).synchronize()

    def release(self, t: torch.Tensor) -> None:
        import torch.cuda

        # blocks this process exported and its readers let go of return to the allocator
        torch.cuda.ipc_collect()


_CUDA = CudaIpc()

#: Device memory installed in this process by device type (:func:`install`).
_INSTALLED: dict[str, DeviceMemory | None] = {}


def install(device_type: str, memory: DeviceMemory | None) -> None:
    """Use ``memory`` for the slots of devices of ``device_type`` in this process (None: host
    slots, or for ``cuda`` refuse device slots); :func:`uninstall` goes back to the default."""
    _INSTALLED[device_type] = memory


def uninstall(device_type: str) -> None:
    _INSTALLED.pop(device_type, None)


def device_memory_for(device: torch.device) -> DeviceMemory | None:
    """The memory that holds slots for ``device``: what :func:`install` put there, else
    :class:`CudaIpc` for ``cuda``, else None (host memory: ``/dev/shm`` slots)."""
    if device.type in _INSTALLED:
        return _INSTALLED[device.type]
    return _CUDA if device.type == "cuda" else None


__all__ = ["CudaIpc", "DeviceMemory", "device_memory_for", "install", "pack_rebuild_args", "uninstall",
           "unpack_rebuild_args"]
