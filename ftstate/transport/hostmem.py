"""Fresh host memory for a whole version: staging buffers backed by transparent huge pages.

A receiver that keeps no spare (its engine holds the committed version, so the transport lets
go of its own copy: issue 24) stages every sync into memory it has never touched, and the
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
"""

from __future__ import annotations

import contextlib
import mmap

import torch

#: The huge page size transparent huge pages use on x86-64 and most arm64 kernels.
HUGE_PAGE_BYTES = 2 << 20


def empty_host(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` host tensor of ``nbytes`` (at least 1), on huge pages when it
    is at least :data:`HUGE_PAGE_BYTES` long and the platform offers them."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_BYTES or advice is None:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # transparent huge pages compiled out: plain pages, same behaviour
        mapping.madvise(advice)
    # frombuffer keeps ``mapping`` alive for as long as the tensor's storage lives
    return torch.frombuffer(mapping, dtype=torch.uint8)
