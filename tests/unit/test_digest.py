"""nh64, the digest computed where the weights are: its definition, its invariances, what it catches.

Runs on the CPU: torch's int64 ops wrap the same on CPU and CUDA, so these pin the bits the
device computes too (tests/gpu/test_digest_gpu.py compares CPU, CUDA and the Triton kernel on a
GPU machine)."""

from __future__ import annotations

import hashlib
import itertools
import random
import struct

import pytest
import torch

from ftstate.transport import digest as d
from ftstate.transport.buckets import bucket_segments, plan_layout
from ftstate.transport.checksum import combine, dtype_name

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1


def reference(data: bytes, key: d.NHKey) -> int:
    """nh64 written out in Python integers from the module's definition (no torch arithmetic)."""
    n = len(data)
    padded = data + bytes(-n % 8)
    words = struct.unpack(f"<{len(padded) // 4}I", padded)
    k1 = [int(v) for v in key.k1.tolist()]
    _, k2 = key.tables(torch.device("cpu"), len(words) // d.CHUNK_WORDS + 1)
    z = [0, 0]
    for c in range(0, len(words), d.CHUNK_WORDS):
        m = words[c : c + d.CHUNK_WORDS]
        y = [sum(((m[2 * i] + k1[2 * i + d.SHIFT * t]) & M32) * ((m[2 * i + 1] + k1[2 * i + 1 + d.SHIFT * t]) & M32)
                 for i in range(len(m) // 2)) & M64 for t in range(2)]
        h = [y[0] & M32, y[0] >> 32, y[1] & M32, y[1] >> 32]
        row = [int(v) for v in k2[c // d.CHUNK_WORDS].tolist()]
        for u in range(2):
            a = [(h[i] + row[4 * u + i]) & M32 for i in range(4)]
            z[u] = (z[u] + a[0] * a[1] + a[2] * a[3]) & M64
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in z]
    return d.finish(signed, n, key)


def rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def fed(data: torch.Tensor, cuts: list[int], order: list[int] | None = None, key: d.NHKey | None = None) -> int:
    key = key or d.public_key()
    bounds = [0, *cuts, data.numel()]
    pieces = list(itertools.pairwise(bounds))
    s = d.TensorState(key)
    for i in order or range(len(pieces)):
        lo, hi = pieces[i]
        s.feed(data[lo:hi], lo, last=hi == data.numel())
    return d.finish(s.value().tolist(), data.numel(), key)


class TestTheDefinition:
    @pytest.mark.parametrize("n", [0, 1, 7, 8, 4095, 4096, 4097, 3 * 4096 + 13])
    def test_the_torch_form_gives_the_big_integer_reference_bits(self, n):
        data = rand_bytes(n, seed=n)
        assert d.tensor_digest(data) == reference(bytes(data.tolist()), d.public_key())

    def test_words_at_the_top_of_their_range_wrap_like_the_reference(self):
        # every product and sum overflows int64: the wrap must be the reference's modulo 2**64
        data = torch.full((2 * 4096 + 24,), 0xFF, dtype=torch.uint8)
        assert d.tensor_digest(data) == reference(bytes(data.tolist()), d.public_key())

    def test_raw_bits_are_hashed_not_values(self):
        zero, negzero = torch.zeros(8, dtype=torch.bfloat16), torch.full((8,), -0.0, dtype=torch.bfloat16)
        assert d.tensor_digest(zero) != d.tensor_digest(negzero)  # equal as numbers, not as bytes
        nan = torch.full((8,), float("nan"), dtype=torch.bfloat16)
        assert d.tensor_digest(nan) == d.tensor_digest(nan.clone())

    def test_a_view_at_an_offset_not_divisible_by_4_hashes_like_its_bytes(self):
        data = rand_bytes(4096 * 2 + 1, seed=3)
        assert d.tensor_digest(data[1:]) == d.tensor_digest(data[1:].clone())


class TestOneValueHoweverTheTensorIsCut:
    data = rand_bytes(5 * 4096 + 21, seed=7)
    whole = d.tensor_digest(data)

    @pytest.mark.parametrize("cuts", [[4096], [8, 16], [4096 + 8], [1000, 9000, 16384], [4088, 4104, 20480]])
    def test_segments_cut_anywhere_on_8_bytes_give_the_whole_tensors_digest(self, cuts):
        assert fed(self.data, cuts) == self.whole

    def test_segments_fed_in_any_order_give_the_same_digest(self):
        cuts = [1000, 9000, 16384]
        for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
            assert fed(self.data, cuts, order) == self.whole

    def test_a_cut_off_8_bytes_is_refused_rather_than_hashed_differently(self):
        s = d.TensorState(d.public_key())
        with pytest.raises(ValueError, match="multiple of 8"):
            s.feed(self.data[4:], 4)
        with pytest.raises(ValueError, match="last segment"):
            s.feed(self.data[:12], 0)


def state_digest(tensors: dict[str, torch.Tensor]) -> int:
    return combine((n, dtype_name(t.dtype), tuple(t.shape), d.tensor_digest(t)) for n, t in tensors.items())


class TestWhatItCatches:
    def test_a_single_flipped_bit_anywhere_changes_the_digest(self):
        data = rand_bytes(3 * 4096 + 5, seed=11)
        base = d.tensor_digest(data)
        for pos in (0, 1, 4095, 4096, 8191, 3 * 4096 + 4):
            for bit in (0, 7):
                bad = data.clone()
                bad[pos] ^= 1 << bit
                assert d.tensor_digest(bad) != base, (pos, bit)

    def test_two_same_shaped_tensors_swapped_change_the_bytes_digest_and_the_state_checksum(self):
        a, b = rand_bytes(4096 * 2, seed=1), rand_bytes(4096 * 2, seed=2)
        assert d.tensor_digest(torch.cat([a, b])) != d.tensor_digest(torch.cat([b, a]))
        small_a, small_b = a[:64], b[:64]  # within one chunk: told apart by the position's key words
        assert d.tensor_digest(torch.cat([small_a, small_b])) != d.tensor_digest(torch.cat([small_b, small_a]))
        assert state_digest({"x": a, "y": b}) != state_digest({"x": b, "y": a})

    def test_a_zeroed_tail_changes_the_digest_even_where_padding_zeros_it_pads(self):
        data = rand_bytes(4096 + 13, seed=5)
        bad = data.clone()
        bad[-5:] = 0
        assert d.tensor_digest(bad) != d.tensor_digest(data)
        # the same bytes with the zeros the padding adds, as real bytes: the length tells them apart
        padded = torch.cat([data, torch.zeros(3, dtype=torch.uint8)])
        assert d.tensor_digest(padded) != d.tensor_digest(data)

    def test_a_stale_bucket_in_a_transfer_is_caught_by_its_bucket_and_its_tensor(self):
        from ftstate.transport.checksum import StreamHasher

        old = {"w": rand_bytes(4096 * 4, seed=20).view(torch.float32), "b": rand_bytes(256, seed=21).view(torch.float32)}
        new = {k: v + 1 for k, v in old.items()}
        entries, windows, _ = plan_layout([(k, "float32", tuple(v.shape)) for k, v in new.items()],
                                       bucket_size=8192, direct_min=8192)
        buckets = bucket_segments(entries, windows)
        assert len(buckets) >= 3

        def run(stale: int | None) -> tuple[list[int], list[int]]:
            h = StreamHasher(len(entries), function=d.NAME)
            sums = []
            for b in buckets:
                src = old if b.index == stale else new
                for s in b.segments:
                    t = src[entries[s.tensor].name].reshape(-1).view(torch.uint8)
                    h.feed_at(s.tensor, s.start, t[s.start : s.start + s.length], last=s.start + s.length == t.numel())
                sums.append(h.bucket_digest(b))
            return sums, h.tensor_digests()

        good_buckets, good_tensors = run(None)
        bad_buckets, bad_tensors = run(1)
        assert bad_buckets[1] != good_buckets[1] and bad_buckets[0] == good_buckets[0]
        assert bad_tensors != good_tensors


class TestKeyed:
    def test_a_key_from_the_runs_secret_gives_other_values_than_the_public_key_and_another_secret(self):
        data = rand_bytes(3 * 4096, seed=9)
        one, two = d.keyed(b"s" * 32), d.NHKey(hashlib.blake2b(b"t" * 32, digest_size=32).digest())
        values = {d.tensor_digest(data), d.tensor_digest(data, one), d.tensor_digest(data, two)}
        assert len(values) == 3
        assert d.tensor_digest(data, one) == reference(bytes(data.tolist()), one)


def test_the_key_tables_grow_without_changing_their_first_rows():
    key = d.NHKey(b"grow")
    _, small = key.tables(torch.device("cpu"), 10)
    first = small[:10].clone()
    _, big = key.tables(torch.device("cpu"), 5000)
    assert torch.equal(big[:10], first) and big.shape[0] >= 5000


def test_random_segments_of_random_sizes_agree_with_the_whole(tmp_path):
    rng = random.Random(1)
    for trial in range(5):
        n = rng.randrange(1, 6 * 4096)
        data = rand_bytes(n, seed=100 + trial)
        cuts = sorted({rng.randrange(1, max(2, n // 8)) * 8 for _ in range(3)} - {0})
        cuts = [c for c in cuts if c < n]
        assert fed(data, cuts) == d.tensor_digest(data), (n, cuts)


class TestOneValueWherever:
    def test_a_state_hashed_bucket_by_bucket_in_a_transfer_gives_the_direct_whole_state_checksum(self):
        from ftstate.transport.checksum import StreamHasher, format_checksum, state_checksum

        state = {"a": rand_bytes(3 * 4096 + 64, seed=30).view(torch.bfloat16),
                 "b": rand_bytes(200, seed=31).view(torch.bfloat16), "c": rand_bytes(8192, seed=32).view(torch.int32)}
        entries, windows, _ = plan_layout([(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in state.items()],
                                          bucket_size=5000)
        h = StreamHasher(len(entries), function=d.NAME)
        for b in bucket_segments(entries, windows):
            for s in b.segments:
                t = state[entries[s.tensor].name].reshape(-1).view(torch.uint8)
                h.feed_at(s.tensor, s.start, t[s.start : s.start + s.length], last=s.start + s.length == t.numel())
            h.bucket_digest(b)
        got = combine((e.name, e.dtype, e.shape, v) for e, v in zip(entries, h.tensor_digests(), strict=True))
        assert format_checksum(got, d.NAME) == state_checksum(state, d.NAME)
        assert state_checksum(state, d.NAME).startswith("nh64:") and state_checksum(state) != state_checksum(state, d.NAME)

    def test_the_function_of_a_checksum_is_read_from_it_and_used_to_recompute(self):
        from ftstate.transport.checksum import function_of, state_checksum, state_checksum_like

        state = {"w": rand_bytes(4096, seed=40)}
        for function in ("xxh3", d.NAME):
            want = state_checksum(state, function)
            assert function_of(want) == function
            assert state_checksum_like(state, want) == want

    def test_nh64_feeds_never_copy_to_the_host(self, monkeypatch):
        from ftstate.transport import checksum

        def no(t):  # the device path must not take this
            raise AssertionError("host_bytes called on an nh64 path")

        monkeypatch.setattr(checksum, "host_bytes", no)
        h = checksum.StreamHasher(1, function=d.NAME)
        h.feed_at(0, 0, rand_bytes(4096 + 8, seed=41), last=True)
        assert len(h.tensor_digests()) == 1


class TestKeyedIntegrityOnTheDevice:
    """``security.integrity: keyed`` with weights on a device: nh64 keyed with the run's secret."""

    @pytest.fixture
    def keyed_run(self):
        from ftstate.transport import auth, checksum

        def use(secret: bytes | None) -> None:
            if secret is None:
                checksum.use_integrity("xxh3")
                auth.uninstall()
            else:
                auth.install("run", secret)
                checksum.use_integrity("keyed")

        yield use
        use(None)

    @staticmethod
    def bucket_and_tensor(data: torch.Tensor) -> tuple[int, int]:
        from ftstate.transport.checksum import StreamHasher

        entries, windows, _ = plan_layout([("w", "uint8", (data.numel(),))], bucket_size=1 << 20)
        (b,) = bucket_segments(entries, windows)
        h = StreamHasher(1, receiving=True, function=d.NAME, sizes=[data.numel()])
        h.feed_at(0, 0, data)
        return h.bucket_digest(b), h.tensor_digests()[0]

    def test_the_runs_secret_keys_every_digest_and_another_secret_does_not_match(self, keyed_run):
        data = rand_bytes(3 * 4096 + 8, seed=50)
        public = self.bucket_and_tensor(data)
        keyed_run(b"a" * 32)
        mine = self.bucket_and_tensor(data)
        assert mine[1] == d.tensor_digest(data, d.keyed(b"a" * 32))
        keyed_run(b"b" * 32)
        theirs = self.bucket_and_tensor(data)
        assert len({public[0], mine[0], theirs[0]}) == 3 and len({public[1], mine[1], theirs[1]}) == 3


class TestTheHostForm:
    @pytest.mark.parametrize("chunks", [1, 3, 1025, 2100])
    def test_numpys_form_gives_the_torch_forms_bits(self, chunks):
        key = d.public_key()
        k1, k2 = key.tables(torch.device("cpu"), chunks + 8)
        for data in (rand_bytes(chunks * d.CHUNK_BYTES, seed=chunks), torch.full((chunks * d.CHUNK_BYTES,), 0xFF,
                                                                                dtype=torch.uint8)):
            assert d._full_numpy(data, 5, k1, k2).tolist() == d._full_torch(data, 5, k1, k2).tolist()
