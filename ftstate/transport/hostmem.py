"""Host memory for a whole version: staging buffers on transparent huge pages, and the copy
that moves bulk bytes between host buffers on one thread.

A receiver that keeps no spare (its engine holds the committed version, so the transport lets
go of its own copy) stages every sync into memory it has never touched, and the
first write into each 4 KiB page is a page fault: about 120 ms per 311 MB on the 2-core
development machine, a third of what vLLM's own reload of those bytes costs. Asking the kernel
for 2 MiB pages (``madvise(MADV_HUGEPAGE)`` on an anonymous mapping) takes 512 times fewer
faults; the zeroing that remains runs at memory speed (311 MB filled by a copy: 35-75 ms on
huge pages against 150-240 ms on plain ones, same process; the effect on whole syncs is in
``benchmarks/memory.py``'s ``held`` rows, docs/benchmarks.md).

Only host buffers of at least one huge page take that path. Huge pages are a hint: where the
kernel has transparent huge pages off (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``never``) or Python's :mod:`mmap` has no ``MADV_HUGEPAGE`` (not Linux), the mapping is plain
pages and behaves exactly as ``torch.empty`` would, only slower to fill; nothing else differs.
The tensor owns its mapping: it is unmapped when the last view of it goes.

Bulk copies (:func:`copy_bytes`): torch's ``copy_`` splits a large host copy across its
intra-op threads and returns when the last part is done. Where another process holds one of
the cores (the trainer packing the next bucket while a rollout copies the last one out of a
slot, on any host with fewer free cores than torch has threads) the part on that core waits for
a time slice, once per piece: a 311 MB copy in 2 MiB pieces beside one busy process took
119-1518 ms with ``copy_`` (2 threads) against 33-42 ms with one ``memmove`` per piece, same
process, same buffers (the vLLM engine's rollout made 3x its native reload out of that wait). The transport already runs its copies beside each other, in separate processes, and
hashes on one thread; one thread per copy is what it wants.
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
    """A writable buffer of ``nbytes`` (at least 1) of fresh anonymous memory, advised huge pages
    where the platform offers them: for bytes that arrive by ``recv_into`` rather than a copy (a
    ``bytearray`` would first zero every page, a fault each, for nothing)."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= HUGE_PAGE_BYTES:
        with contextlib.suppress(OSError):  # transparent huge pages compiled out: plain pages, same behaviour
            mapping.madvise(advice)
    return mapping


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, on this thread alone when both are contiguous host tensors of the
    same dtype and size (``memmove``, which releases the GIL: see the module docstring); any
    other pair (a device tensor, a strided view, a conversion) goes to torch's ``copy_``."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()):
        n = dst.numel() * dst.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)
