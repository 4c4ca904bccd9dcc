"""nh64's whole chunks as one fused Triton kernel (imported only where Triton is installed).

It must give exactly :func:`ftstate.transport.digest._full_torch`'s bits: each program hashes
:data:`CHUNKS` chunks of 1024 words (L1, both passes, then L2 with its chunk's key row) in
64-bit registers and writes one partial pair; the partials are summed by torch (int64, exact
modulo 2**64, so neither the grid nor the order changes anything). Words are widened to
uint64 *before* the multiply: Triton's 32-bit multiply wraps like C's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftstate.transport.digest import CHUNK_BYTES, CHUNK_WORDS, SHIFT

#: Chunks per program (16 KiB of input).
CHUNKS = 4


@triton.jit
def _nh_kernel(words_ptr, k1_ptr, k2_ptr, out_ptr, n_chunks, first,
               CW: tl.constexpr, SH: tl.constexpr, PER: tl.constexpr):
    pid = tl.program_id(0)
    half = tl.arange(0, CW // 2)
    m32 = 0xFFFFFFFF
    ka0 = tl.load(k1_ptr + 2 * half).to(tl.uint64)
    kb0 = tl.load(k1_ptr + 2 * half + 1).to(tl.uint64)
    ka1 = tl.load(k1_ptr + 2 * half + SH).to(tl.uint64)
    kb1 = tl.load(k1_ptr + 2 * half + 1 + SH).to(tl.uint64)
    z0 = tl.full((), 0, tl.uint64)
    z1 = tl.full((), 0, tl.uint64)
    for j in tl.static_range(PER):
        c = pid * PER + j
        ok = c < n_chunks
        base = c.to(tl.int64) * CW
        wa = tl.load(words_ptr + base + 2 * half, mask=ok & (half >= 0), other=0)
        wb = tl.load(words_ptr + base + 2 * half + 1, mask=ok & (half >= 0), other=0)
        wa = wa.to(tl.uint32, bitcast=True).to(tl.uint64)
        wb = wb.to(tl.uint32, bitcast=True).to(tl.uint64)
        y0 = tl.sum(((wa + ka0) & m32) * ((wb + kb0) & m32), axis=0)
        y1 = tl.sum(((wa + ka1) & m32) * ((wb + kb1) & m32), axis=0)
        krow = k2_ptr + (first + c).to(tl.int64) * 8
        k0 = tl.load(krow + 0, mask=ok, other=0).to(tl.uint64)
        k1 = tl.load(krow + 1, mask=ok, other=0).to(tl.uint64)
        k2 = tl.load(krow + 2, mask=ok, other=0).to(tl.uint64)
        k3 = tl.load(krow + 3, mask=ok, other=0).to(tl.uint64)
        k4 = tl.load(krow + 4, mask=ok, other=0).to(tl.uint64)
        k5 = tl.load(krow + 5, mask=ok, other=0).to(tl.uint64)
        k6 = tl.load(krow + 6, mask=ok, other=0).to(tl.uint64)
        k7 = tl.load(krow + 7, mask=ok, other=0).to(tl.uint64)
        h0, h1, h2, h3 = y0 & m32, (y0 >> 32) & m32, y1 & m32, (y1 >> 32) & m32
        a0 = ((h0 + k0) & m32) * ((h1 + k1) & m32) + ((h2 + k2) & m32) * ((h3 + k3) & m32)
        a1 = ((h0 + k4) & m32) * ((h1 + k5) & m32) + ((h2 + k6) & m32) * ((h3 + k7) & m32)
        # a chunk past the end contributes nothing (its loads gave zeros, its key row too)
        live = ok.to(tl.uint64)
        z0 += a0 * live
        z1 += a1 * live
    tl.store(out_ptr + 2 * pid, z0.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * pid + 1, z1.to(tl.int64, bitcast=True))


def full_chunks(words_u8: torch.Tensor, first: int, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """``(z_0, z_1)`` of the whole chunks in ``words_u8`` (first one: chunk ``first``), int64 on its device."""
    n = words_u8.numel() // CHUNK_BYTES
    if words_u8.data_ptr() % 4:
        words_u8 = words_u8.clone()
    words = words_u8.view(torch.int32)
    grid = (triton.cdiv(n, CHUNKS),)
    out = torch.empty((grid[0], 2), dtype=torch.int64, device=words_u8.device)
    _nh_kernel[grid](words, k1, k2, out, n, first, CW=CHUNK_WORDS, SH=SHIFT, PER=CHUNKS)
    return out.sum(dim=0)
