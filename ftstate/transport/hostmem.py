"""Host memory for a whole version: staging buffers on transparent huge pages, and the copy
that moves bulk bytes between host buffers on one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

#: The huge page size transparent huge pages use on x86-64 and most arm64 kernels.
HUGE_PAGE_BYTES = 2 << 20


def empty_host(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` host tensor of ``nbytes`` (at least 1), on huge pages when it
    is at least :data:`HUGE_PAGE_BYTES` long and the platform offers them."""
    if nbytes < HUGE_PAGE_BYTES or getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)
    # frombuffer keeps the mapping alive for as long as the tensor's storage lives
    return torch.frombuffer(host_buffer(nbytes), dtype=torch.uint8)


def host_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of fresh anonymous memory on huge pages where offered, for ``recv_into`` (a
    ``bytearray`` would fault in every page zeroing it for nothing)."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= HUGE_PAGE_BYTES:
        with contextlib.suppress(OSError):  # transparent huge pages compiled out: plain pages, same behaviour
            mapping.madvise(advice)
    return mapping


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, on this thread alone when both are contiguous host tensors of the
    same dtype and size (``memmove``, which releases the GIL: see docs/concepts.md); any
    other pair (a device tensor, a strided view, a conversion) goes to torch's ``copy_``."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()):
        n = dst.numel() * dst.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)
