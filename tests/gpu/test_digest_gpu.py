"""nh64 on a GPU: the same bits as on the CPU, from the torch form and from the fused Triton kernel.

Skipped where ``torch.cuda.is_available()`` is false (this project's CPU machines): tests/unit/
test_digest.py pins the bits on the CPU against a big-integer reference; this file checks what
the CPU cannot: that CUDA's int64 ops and the Triton kernel give exactly those bits, on random and
adversarial bytes, whatever the cut into segments, that a state on the GPU and its CPU copy have
one whole-state checksum, and that hashing a GPU transfer copies no byte to the host.
"""

from __future__ import annotations

import pytest
import torch

from ftstate.transport import checksum, digest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

GPU = torch.device("cuda", 0)


def adversarial(n: int) -> list[torch.Tensor]:
    """Bytes that stress the arithmetic: all ones (every product and sum overflows), zeros,
    alternating words, bf16 NaN and -0.0, and random bytes."""
    g = torch.Generator().manual_seed(n)
    ones = torch.full((n,), 0xFF, dtype=torch.uint8)
    alternating = torch.tensor([0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0], dtype=torch.uint8).repeat(n // 8 + 1)[:n]
    nan = torch.full((n // 2 + 1,), float("nan"), dtype=torch.bfloat16).view(torch.uint8)[:n]
    negzero = torch.full((n // 2 + 1,), -0.0, dtype=torch.bfloat16).view(torch.uint8)[:n]
    return [ones, torch.zeros(n, dtype=torch.uint8), alternating, nan, negzero,
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 4095, 4096, 4097, 37 * 4096 + 5, (4 << 20) + 5])
def test_cpu_cuda_and_the_kernel_agree_bit_for_bit(n):
    for data in adversarial(n):
        cpu = digest.tensor_digest(data)
        assert digest.tensor_digest(data.to(GPU)) == cpu


def test_a_state_on_the_gpu_and_its_cpu_copy_have_one_whole_state_checksum():
    g = torch.Generator().manual_seed(3)
    cpu = {"embed": torch.randn(1000, 64, generator=g).to(torch.bfloat16), "norm": torch.randn(7, generator=g),
           "big": torch.randn(3 << 20, generator=g).to(torch.bfloat16)}
    gpu = {k: v.to(GPU) for k, v in cpu.items()}
    assert checksum.state_checksum(gpu, "nh64") == checksum.state_checksum(cpu, "nh64")
    assert checksum.function_for(gpu.values()) == "nh64" and checksum.function_for(cpu.values()) == "xxh3"


def test_a_bucketed_gpu_transfers_digests_equal_the_cpus_and_copy_nothing_to_the_host():
    from ftstate.transport.buckets import bucket_segments, plan_layout
    from ftstate.transport.checksum import StreamHasher
    from ftstate.transport.hashing import feed_bucket

    g = torch.Generator().manual_seed(4)
    state = {f"w{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate((5 << 20, 3, 4097, 1 << 16))}
    entries, windows, total = plan_layout([(k, "bfloat16", tuple(v.shape)) for k, v in state.items()], 3 << 20)
    flat = torch.zeros(total, dtype=torch.uint8)
    for e in entries:
        flat[e.offset : e.offset + e.nbytes] = state[e.name].view(torch.uint8)
    results = []
    for device in ("cpu", "cuda"):
        buf = flat.to(device)
        h = StreamHasher(len(entries), function="nh64", sizes=[e.nbytes for e in entries])
        before = checksum.host_copied_bytes()
        sums = []
        for b in bucket_segments(entries, windows):
            feed_bucket(h, b, buf[b.start : b.stop])
            sums.append(h.bucket_digest(b))
        results.append((sums, h.tensor_digests()))
        assert checksum.host_copied_bytes() == before
    assert results[0] == results[1]


def test_flips_swaps_zeroed_tails_are_caught_on_the_gpu():
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=GPU)
    base = digest.tensor_digest(data)
    for pos in (0, 4095, 1 << 20, (3 << 20) - 1):
        bad = data.clone()
        bad[pos] ^= 1
        assert digest.tensor_digest(bad) != base
    half = data.numel() // 2
    assert digest.tensor_digest(torch.cat([data[half:], data[:half]])) != base
    tail = data.clone()
    tail[-100:] = 0
    assert digest.tensor_digest(tail) != base


def test_keyed_digests_on_the_gpu_equal_the_cpus():
    key = digest.keyed(b"s" * 32)
    data = torch.randint(0, 256, ((1 << 20) + 12,), dtype=torch.uint8)
    assert digest.tensor_digest(data.to(GPU), key) == digest.tensor_digest(data, key) != digest.tensor_digest(data)
