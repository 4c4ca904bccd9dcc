"""Fresh staging buffers on huge pages (:mod:`ftstate.transport.hostmem`): the advice is given
to the kernel for the mapping, the tensor is ordinary memory, and the mapping lives exactly as
long as the tensor's storage."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from ftstate.transport import hostmem


def _vm_flags(address: int) -> set[str] | None:
    """The ``VmFlags`` of the mapping holding ``address`` in this process (None: not mapped)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= address < hi
            elif current and head == "VmFlags:":
                return set(line.split()[1:])
    return None


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_a_large_buffer_is_advised_huge_pages_and_unmapped_with_its_last_view():
    buf = hostmem.empty_host(8 * hostmem.HUGE_PAGE_BYTES)
    assert buf.dtype == torch.uint8 and buf.numel() == 8 * hostmem.HUGE_PAGE_BYTES and buf.is_contiguous()
    address = buf.data_ptr()
    assert "hg" in (_vm_flags(address) or set())  # the kernel was asked for huge pages here
    buf.fill_(7)
    view = buf[hostmem.HUGE_PAGE_BYTES:]
    del buf
    gc.collect()
    assert int(view.sum()) == 7 * view.numel()  # a view keeps the mapping
    del view
    gc.collect()
    assert _vm_flags(address) is None or "hg" not in _vm_flags(address)


def test_a_small_buffer_is_plain_memory():
    buf = hostmem.empty_host(hostmem.HUGE_PAGE_BYTES - 1)
    assert buf.numel() == hostmem.HUGE_PAGE_BYTES - 1
    assert hostmem.empty_host(0).numel() == 1  # never an empty storage to write into


def test_copy_bytes_copies_host_bytes_exactly_and_leaves_the_rest_to_torch():
    src = torch.arange(5 << 20, dtype=torch.int32).view(torch.uint8)
    dst = hostmem.empty_host(src.numel())
    hostmem.copy_bytes(dst, src)
    assert torch.equal(dst, src)
    part = torch.zeros(10, dtype=torch.uint8)
    hostmem.copy_bytes(part[2:7], src[100:105])  # a window of each: only those bytes
    assert part.tolist() == [0, 0, *src[100:105].tolist(), 0, 0, 0]
    # what memmove cannot do goes to copy_: a strided source, a conversion, a broadcast
    grid = torch.arange(12, dtype=torch.float32).view(3, 4)
    out = torch.empty(4, 3)
    hostmem.copy_bytes(out, grid.t())
    assert torch.equal(out, grid.t())
    half = torch.empty(3, 4, dtype=torch.bfloat16)
    hostmem.copy_bytes(half, grid)
    assert torch.equal(half, grid.to(torch.bfloat16))
    row = torch.empty(3, 4)
    hostmem.copy_bytes(row, torch.arange(4, dtype=torch.float32))
    assert torch.equal(row, torch.arange(4, dtype=torch.float32).expand(3, 4))
    hostmem.copy_bytes(torch.empty(0), torch.empty(0))  # nothing to copy, no error
