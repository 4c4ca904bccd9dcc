"""``security.integrity: keyed`` (ftstate.transport.checksum): the bucket digests an outsider
cannot match, what a keyed receiver may take from the seal, and the writer's order of work.

Each test would fail if keyed verification were skipped or weakened: a digest that does not
depend on the key, on every byte or on the bytes' positions; a receiver that takes the seal's
per-tensor checksums without its buckets being checked; a writer whose telling-before-hashing
changed what it hashes (its source, never the slot it wrote).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from ftstate.transport import auth, checksum
from ftstate.transport.buckets import bucket_segments, plan_layout
from ftstate.transport.checksum import StreamHasher
from ftstate.transport.routes import copying

SIZES = [10_000, 3_000, 700]


@pytest.fixture
def keyed():
    auth.install("run-a", os.urandom(32))
    checksum.use_integrity("keyed")
    try:
        yield
    finally:
        checksum.use_integrity("xxh3")
        auth.uninstall()


def layout(bucket_size: int = 8_192):
    entries, windows, total = plan_layout(((f"t{i}", "uint8", (n,)) for i, n in enumerate(SIZES)), bucket_size)
    return entries, bucket_segments(entries, windows), total


def digests(flat: torch.Tensor, *, receiving: bool = False, bucket_size: int = 8_192) -> tuple[list[int], StreamHasher]:
    entries, buckets, _ = layout(bucket_size)
    hasher = StreamHasher(len(entries), receiving=receiving)
    out = []
    for b in buckets:
        copying.hash_bucket(b, flat[b.start : b.stop], hasher)
        out.append(hasher.bucket_digest(b))
    return out, hasher


def weights() -> torch.Tensor:
    return torch.randint(0, 255, (layout()[2],), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


class TestTheWholeStateChecksumBindsNames:
    """The held-bytes proof compares whole-state checksums: an engine that swaps two tensors of
    one shape and dtype (q/k, gate/up) holds the same bytes under other names and must not pass."""

    def test_two_same_shaped_tensors_swapped_change_it(self):
        q, k = torch.arange(12.0).reshape(3, 4), -torch.arange(12.0).reshape(3, 4)
        assert checksum.state_checksum({"q": q, "k": k}) != checksum.state_checksum({"q": k, "k": q})

    def test_a_tensor_renamed_changes_it_and_the_order_of_the_mapping_does_not(self):
        q, k = torch.ones(4), torch.zeros(4)
        assert checksum.state_checksum({"q": q, "k": k}) == checksum.state_checksum({"k": k, "q": q})
        assert checksum.state_checksum({"q": q, "k": k}) != checksum.state_checksum({"q": q, "v": k})


class TestAnOutsiderCannotMatchAKeyedDigest:
    def test_the_same_bytes_under_another_secret_do_not_match(self, keyed):
        flat = weights()
        ours, _ = digests(flat)
        auth.install("run-a", os.urandom(32))  # an outsider: the same code, not the run's secret
        checksum.use_integrity("keyed")
        assert all(a != b for a, b in zip(ours, digests(flat)[0], strict=True))

    def test_the_unkeyed_digests_an_outsider_can_compute_do_not_match(self, keyed):
        flat = weights()
        ours, _ = digests(flat)
        checksum.use_integrity("xxh3")
        assert all(a != b for a, b in zip(ours, digests(flat)[0], strict=True))

    def test_one_byte_changed_anywhere_changes_its_buckets_digest_and_no_other(self, keyed):
        flat = weights()
        ours, _ = digests(flat)
        _, buckets, _ = layout()
        for b in buckets:
            for at in (b.start, (b.start + b.stop) // 2, b.stop - 1):
                damaged = flat.clone()
                damaged[at] ^= 0xFF
                theirs, _ = digests(damaged)
                assert [k for k, (x, y) in enumerate(zip(ours, theirs, strict=True)) if x != y] == [b.index]

    def test_the_same_bytes_at_another_place_do_not_match(self, keyed):
        _, buckets, _ = layout()
        b = buckets[0]
        moved = dataclasses.replace(b, start=b.start + 64, stop=b.stop + 64)  # same segments, same bytes
        data = weights()[b.start : b.stop]
        here, there = StreamHasher(len(SIZES)), StreamHasher(len(SIZES))
        copying.hash_bucket(b, data, here)
        copying.hash_bucket(moved, data, there)
        assert here.bucket_digest(b) != there.bucket_digest(moved)

    def test_keyed_mode_refuses_to_start_without_the_runs_secret(self):
        auth.uninstall()
        with pytest.raises(ValueError, match="needs the run's secret"):
            checksum.use_integrity("keyed")


class TestAKeyedReceiverHashesOnceAndTrustsOnlyAVerifiedSeal:
    def test_it_computes_the_senders_digests_without_per_tensor_hashes(self, keyed):
        flat = weights()
        sent, sender = digests(flat)
        got, receiver = digests(flat, receiving=True)
        assert got == sent
        assert receiver._hashers == [] and len(sender._hashers) == len(SIZES)

    def test_its_per_tensor_checksums_are_the_seals_only_when_handed_them(self, keyed):
        flat = weights()
        _, sender = digests(flat)
        _, receiver = digests(flat, receiving=True)
        with pytest.raises(ValueError, match="pass the seal's"):
            receiver.tensor_digests()
        sealed = sender.tensor_digests()
        assert receiver.tensor_digests(sealed) == sealed == [checksum.tensor_checksum(flat[e.offset : e.end])
                                                             for e in layout()[0]]

    def test_a_damaged_byte_is_refused_although_its_tensor_sums_are_the_seals(self, keyed):
        from ftstate.transport.hashing import own_state_checksum, verify

        flat = weights()
        sent, sender = digests(flat)
        damaged = flat.clone()
        damaged[len(flat) // 2] ^= 0xFF
        got, receiver = digests(damaged, receiving=True)
        entries = layout()[0]
        manifest = SimpleNamespace(num_buckets=len(sent), tensors=entries)
        sums = sender.tensor_digests()
        seal = SimpleNamespace(bucket_checksums=sent, tensor_checksums=sums,
                               state_checksum=own_state_checksum(manifest, sums))
        taken = receiver.tensor_digests(seal.tensor_checksums)
        problem = verify(manifest, seal, got, taken, own_state_checksum(manifest, taken))
        assert problem is not None and "does not match its checksum" in problem and problem.startswith("bucket ")
        assert verify(manifest, seal, sent, taken, own_state_checksum(manifest, taken)) is None

    def test_with_xxh3_a_receiver_still_hashes_every_tensor(self):
        flat = weights()
        _, receiver = digests(flat, receiving=True)
        assert receiver.tensor_digests() == [checksum.tensor_checksum(flat[e.offset : e.end]) for e in layout()[0]]


class TestTheWriterTellsBeforeItHashesItsSource:
    @pytest.fixture
    def small_pieces(self, monkeypatch):
        monkeypatch.setattr(copying, "PIECE", 1024)
        monkeypatch.setattr(copying, "STREAM", 4096)

    @pytest.mark.parametrize("mode", ["xxh3", "keyed"])
    def test_it_tells_each_stretch_before_hashing_it_and_its_digests_are_the_sources(self, small_pieces, mode):
        auth.install("run-a", os.urandom(32))
        checksum.use_integrity(mode)
        try:
            entries, buckets, _ = layout(1 << 20)
            flat = weights()
            [b] = buckets
            events: list[tuple[str, int]] = []

            class Recording(StreamHasher):
                def feed(self, tensor: int, data: memoryview) -> None:
                    events.append(("hash", len(data)))
                    super().feed(tensor, data)

            hasher = Recording(len(entries))
            slot = torch.zeros(b.nbytes, dtype=torch.uint8)

            def tamper(piece: torch.Tensor) -> None:  # a write into the slot right after the copy
                piece[:1].bitwise_xor_(0xFF)

            copying.after_slot_copy = tamper
            try:
                copying.copy_hash(b, slot, copying.in_tensors([flat[e.offset : e.end] for e in entries]), hasher,
                                    hash_source=True, filled=lambda n: events.append(("told", n)))
            finally:
                copying.after_slot_copy = None
            told = [n for kind, n in events if kind == "told"]
            assert told[-1] == b.nbytes and len(told) >= 3
            # every stretch is told before any of its bytes is hashed
            hashed = before = 0
            for kind, n in events:
                if kind == "hash":
                    hashed += n
                else:
                    assert hashed <= before, (hashed, before, n)
                    before = n
            assert hashed == sum(SIZES)
            assert hasher.bucket_digest(b) == digests(flat, bucket_size=1 << 20)[0][0]  # the source's, not the slot's
            assert slot[0] != flat[b.start]  # the slot was written into after the copy
        finally:
            checksum.use_integrity("xxh3")
            auth.uninstall()
