"""Bucket planning: offsets, packing of small tensors, chunking of large ones, segments."""

from __future__ import annotations

import pytest

from ftstate.transport.buckets import (
    ALIGNMENT,
    DTYPE_ITEMSIZE,
    MIN_BUCKET_SIZE,
    bucket_bytes,
    bucket_segments,
    plan_layout,
)

KiB = 1024


def covered_bytes(entries, buckets):
    """(tensor index, byte) pairs carried by the buckets, to compare with every tensor byte."""
    got = []
    for b in buckets:
        for s in b.segments:
            got.extend((s.tensor, s.start + i) for i in range(s.length))
    return got


class TestLayout:
    def test_offsets_are_aligned_and_in_order(self):
        entries, _, total = plan_layout(
            [("a", "float32", (3,)), ("b", "bfloat16", (5,)), ("c", "int64", (2, 2))], 64 * KiB
        )
        assert [e.offset % ALIGNMENT for e in entries] == [0, 0, 0]
        assert [e.nbytes for e in entries] == [12, 10, 32]
        assert entries[0].offset < entries[1].offset < entries[2].offset
        assert total == entries[-1].end

    def test_empty_and_zero_dim_tensors_are_planned(self):
        entries, windows, total = plan_layout([("e", "float32", (0, 3)), ("s", "int64", ())], 64 * KiB)
        assert entries[0].nbytes == 0 and entries[0].offset == 0
        assert entries[1].nbytes == 8
        assert windows == ((entries[1].offset, entries[1].end),)
        assert total == 8

    def test_unknown_dtype_repeated_name_and_tiny_bucket_are_refused(self):
        with pytest.raises(ValueError, match="dtype 'float128' cannot travel"):
            plan_layout([("x", "float128", (1,))], 64 * KiB)
        with pytest.raises(ValueError, match="'x' appears twice"):
            plan_layout([("x", "float32", (1,)), ("x", "float32", (1,))], 64 * KiB)
        with pytest.raises(ValueError, match=f">= {MIN_BUCKET_SIZE}"):
            plan_layout([], MIN_BUCKET_SIZE - 1)

    def test_every_itemsize_is_a_power_of_two_within_the_alignment(self):
        for size in DTYPE_ITEMSIZE.values():
            assert ALIGNMENT % size == 0


class TestBuckets:
    def test_small_tensors_are_packed_into_one_bucket(self):
        specs = [(f"t{i}", "float32", (100,)) for i in range(10)]  # 400 B each
        entries, windows, _ = plan_layout(specs, 64 * KiB)
        assert len(windows) == 1
        (bucket,) = bucket_segments(entries, windows)
        assert [s.tensor for s in bucket.segments] == list(range(10))
        assert bucket.single is None

    def test_a_tensor_that_does_not_fit_opens_the_next_bucket(self):
        specs = [("a", "uint8", (600,)), ("b", "uint8", (600,))]
        entries, windows, _ = plan_layout(specs, 1024, direct_min=1024)
        assert len(windows) == 2
        buckets = bucket_segments(entries, windows)
        assert [b.single.tensor for b in buckets] == [0, 1]
        assert all(b.nbytes <= 1024 for b in buckets)

    def test_a_tensor_larger_than_a_bucket_is_chunked_into_buckets_of_its_own(self):
        bucket = 64 * KiB
        specs = [("small", "float32", (10,)), ("big", "float32", (40_000,)), ("tail", "int64", (3,))]
        entries, windows, _ = plan_layout(specs, bucket)
        buckets = bucket_segments(entries, windows)
        big = [b for b in buckets if any(s.tensor == 1 for s in b.segments)]
        assert len(big) == -(-160_000 // bucket) == 3
        assert all(b.single is not None and b.single.tensor == 1 for b in big)
        assert [b.nbytes for b in big] == [bucket, bucket, 160_000 - 2 * bucket]
        assert [b.single.start for b in big] == [0, bucket, 2 * bucket]

    def test_large_tensors_travel_alone_first_and_small_ones_are_grouped_after_them(self):
        MiB = 1024 * KiB
        specs = [
            ("l0.norm", "float32", (2048,)),
            ("l0.w", "float32", (4 * MiB,)),
            ("l1.norm", "float32", (2048,)),
            ("l1.w", "bfloat16", (8 * MiB,)),
            ("l1.bias", "float32", (2048,)),
        ]
        entries, windows, _ = plan_layout(specs, 256 * MiB)
        assert [e.name for e in entries] == [name for name, _, _ in specs]  # the caller's order
        buckets = bucket_segments(entries, windows)
        assert len(buckets) == 3
        assert [b.single.tensor for b in buckets[:2]] == [1, 3]
        assert [s.tensor for s in buckets[2].segments] == [0, 2, 4]

    def test_direct_min_is_capped_by_the_bucket_size(self):
        _entries, windows, _ = plan_layout([("a", "uint8", (2000,)), ("b", "uint8", (10,))], 1024)
        assert [w[1] - w[0] for w in windows] == [1024, 976, 10]

    def test_buckets_carry_every_tensor_byte_exactly_once(self):
        specs = [
            ("a", "float32", (5000,)),
            ("b", "bfloat16", (70_000,)),
            ("c", "int64", (7,)),
            ("d", "bool", (33,)),
            ("e", "float64", (20_000,)),
            ("z", "float32", (0,)),
        ]
        entries, windows, total = plan_layout(specs, 16 * KiB)
        buckets = bucket_segments(entries, windows)
        got = covered_bytes(entries, buckets)
        want = [(i, j) for i, e in enumerate(entries) for j in range(e.nbytes)]
        assert sorted(got) == want
        assert all(b.nbytes <= 16 * KiB for b in buckets)
        assert windows[-1][1] == total

    def test_segments_sit_at_their_stream_position_within_the_bucket(self):
        entries, windows, _ = plan_layout([("a", "float32", (10,)), ("b", "int64", (10,))], 4 * KiB)
        (bucket,) = bucket_segments(entries, windows)
        for s in bucket.segments:
            assert bucket.start + s.bucket_offset == entries[s.tensor].offset + s.start


def test_bucket_bytes_converts_the_configs_mebibytes():
    assert bucket_bytes(256) == 256 * 1024 * 1024
    assert bucket_bytes(0.0625) == 64 * KiB
