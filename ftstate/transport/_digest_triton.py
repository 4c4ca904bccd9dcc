"""nh64's whole chunks as one fused Triton kernel (imported only where Triton is installed).

It must give exactly :func:`ftstate.transport.digest._full_torch`'s bits: each program hashes one
chunk of 1024 words (L1, both passes, then L2 with its chunk's key row) in 64-bit registers and
writes that chunk's pair; the pairs are summed by torch (int64, exact modulo 2**64, so neither
the grid nor the order of the sum changes anything). The chunk's words are read once, from HBM;
the L1 key (8 KiB) stays in cache. Words are widened to uint64 *before* the multiply: Triton's
32-bit multiply wraps like C's. :func:`ftstate.transport.digest._checked` compares the kernel
with the torch form once per process before it is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _nh_kernel(words_ptr, k1_ptr, k2_ptr, out_ptr, first, CW: tl.constexpr, SH: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, CW // 2)
    m32 = 0xFFFFFFFF
    base = words_ptr + c * CW
    wa = tl.load(base + 2 * half).to(tl.uint32, bitcast=True).to(tl.uint64)
    wb = tl.load(base + 2 * half + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
    ka0 = tl.load(k1_ptr + 2 * half).to(tl.uint64)
    kb0 = tl.load(k1_ptr + 2 * half + 1).to(tl.uint64)
    ka1 = tl.load(k1_ptr + 2 * half + SH).to(tl.uint64)
    kb1 = tl.load(k1_ptr + 2 * half + 1 + SH).to(tl.uint64)
    y0 = tl.sum(((wa + ka0) & m32) * ((wb + kb0) & m32), axis=0)
    y1 = tl.sum(((wa + ka1) & m32) * ((wb + kb1) & m32), axis=0)
    krow = k2_ptr + (c + first) * 8
    k0 = tl.load(krow + 0).to(tl.uint64)
    k1 = tl.load(krow + 1).to(tl.uint64)
    k2 = tl.load(krow + 2).to(tl.uint64)
    k3 = tl.load(krow + 3).to(tl.uint64)
    k4 = tl.load(krow + 4).to(tl.uint64)
    k5 = tl.load(krow + 5).to(tl.uint64)
    k6 = tl.load(krow + 6).to(tl.uint64)
    k7 = tl.load(krow + 7).to(tl.uint64)
    h0 = y0 & m32
    h1 = (y0 >> 32) & m32
    h2 = y1 & m32
    h3 = (y1 >> 32) & m32
    a0 = ((h0 + k0) & m32) * ((h1 + k1) & m32) + ((h2 + k2) & m32) * ((h3 + k3) & m32)
    a1 = ((h0 + k4) & m32) * ((h1 + k5) & m32) + ((h2 + k6) & m32) * ((h3 + k7) & m32)
    tl.store(out_ptr + 2 * c, a0.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * c + 1, a1.to(tl.int64, bitcast=True))


def full_chunks(words_u8: torch.Tensor, first: int, k1: torch.Tensor, k2: torch.Tensor, *,
                chunk_words: int, shift: int) -> torch.Tensor:
    """``(z_0, z_1)`` of the whole chunks in ``words_u8`` (first one: chunk ``first``), int64 on its
    device. ``chunk_words`` / ``shift``: nh64's (passed in: this module imports nothing of ftstate)."""
    chunk_bytes = 4 * chunk_words
    n = words_u8.numel() // chunk_bytes
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=words_u8.device)
    if words_u8.data_ptr() % 4:
        words_u8 = words_u8.clone()
    words = words_u8[: n * chunk_bytes].view(torch.int32)
    out = torch.empty((n, 2), dtype=torch.int64, device=words_u8.device)
    with torch.cuda.device(words_u8.device):  # a hashing thread's current device may be another GPU
        _nh_kernel[(n,)](words, k1, k2, out, first, CW=chunk_words, SH=shift)
    return out.sum(dim=0)
