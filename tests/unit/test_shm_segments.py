"""Shared-memory segments and the same-host offer, in one process: names, fencing, sweeping."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import pytest

from ftstate.core.errors import ManifestError, SharedMemoryUnavailable, StaleGroupVersion
from ftstate.transport import shm
from ftstate.transport.offer import Offer, decode_offer, encode_offer


@pytest.fixture
def made():
    segs: list[shm.Segment] = []
    yield segs
    for s in segs:
        s.unlink()
        s.close()


def create(made, version: int, slot: int = 0, capacity: int = 4096, generation: int = 1) -> shm.Segment:
    seg = shm.Segment.create(shm.segment_name("weights", version, os.getpid(), generation, slot),
                             group_version=version, slot=slot, capacity=capacity)
    made.append(seg)
    return seg


class TestNamesAndHeaders:
    def test_a_name_carries_group_version_creator_and_slot(self):
        name = shm.segment_name("my/group", 7, 1234, 3, 1)
        assert name == "ftstate-my_group-v7-p1234-g3-s1"
        assert shm.parse_name(name) == {"group": "my_group", "version": 7, "pid": 1234, "generation": 3, "slot": 1,
                                        "kind": "slot"}
        assert shm.parse_name("ftstate-something-else") is None

    def test_a_reader_sees_what_the_sender_wrote(self, made):
        seg = create(made, 4)
        seg.data[:5].copy_(seg.data.new_tensor([1, 2, 3, 4, 5]))
        seg.mark(2, 9, 5)
        other = shm.Segment.attach(seg.name, group="weights", group_version=4, creator_pid=os.getpid())
        try:
            assert other.holds() == (2, 9, 5) and other.data[:5].tolist() == [1, 2, 3, 4, 5]
        finally:
            other.close()


class TestFencing:
    def test_a_segment_of_an_older_group_version_is_refused_before_it_is_mapped(self, made):
        seg = create(made, 3)
        with pytest.raises(StaleGroupVersion, match="rejected message from shared-memory segment") as info:
            shm.Segment.attach(seg.name, group="weights", group_version=4, creator_pid=os.getpid())
        assert (info.value.got, info.value.current) == (3, 4)

    def test_a_header_that_disagrees_with_the_name_is_refused(self, made):
        seg = create(made, 3)
        renamed = shm.segment_name("weights", 4, os.getpid(), 9, 0)
        os.link(shm.SHM_DIR / seg.name, shm.SHM_DIR / renamed)  # same bytes, a v4 name: a forged segment
        try:
            with pytest.raises(StaleGroupVersion):
                shm.Segment.attach(renamed, group="weights", group_version=4, creator_pid=os.getpid())
        finally:
            shm.unlink_names([renamed])

    def test_a_segment_made_by_another_process_than_the_sender_is_refused(self, made):
        seg = create(made, 5)
        with pytest.raises(ManifestError, match="is not the sender's") as info:
            shm.Segment.attach(seg.name, group="weights", group_version=5, creator_pid=1)
        assert info.value.field == "segment"

    def test_an_older_offer_is_stale_and_a_malformed_one_names_its_field(self):
        offer = Offer("weights", 3, 10, "tcp://127.0.0.1:5555", ("a", "b"), True, (1,), (2,))
        assert decode_offer(encode_offer(offer), group="weights", group_version=3) == offer
        with pytest.raises(StaleGroupVersion):
            decode_offer(encode_offer(offer), group="weights", group_version=4)
        bad = Offer("weights", 3, 10, "tcp://127.0.0.1:5555", ("a", "b"), True, (1,), ("x",))  # type: ignore[arg-type]
        with pytest.raises(ManifestError) as info:
            decode_offer(encode_offer(bad), group="weights", group_version=3)
        assert info.value.field == "collective"

    def test_an_offer_carries_its_relays_and_a_malformed_relay_names_its_field(self):
        offer = Offer("weights", 3, 10, "", (), False, (), (1, 3), None, ((1, (2,)), (3, (4, 5))), True)
        assert decode_offer(encode_offer(offer), group="weights", group_version=3) == offer
        bad = Offer("weights", 3, 10, "", (), False, (), (1,), None, ((1, ("x",)),), False)  # type: ignore[arg-type]
        with pytest.raises(ManifestError) as info:
            decode_offer(encode_offer(bad), group="weights", group_version=3)
        assert info.value.field == "relays"

    def test_an_offer_carries_its_chunk_size_and_a_negative_one_names_its_field(self):
        offer = Offer("weights", 3, 10, "", (), False, (), (1,), chunk=8 << 20)
        assert decode_offer(encode_offer(offer), group="weights", group_version=3).chunk == 8 << 20
        with pytest.raises(ManifestError) as info:
            decode_offer(encode_offer(Offer("weights", 3, 10, "", (), False, (), (1,), chunk=-1)), group="weights",
                         group_version=3)
        assert info.value.field == "chunk"


    def test_an_offer_carries_one_device_handle_per_slot_and_a_malformed_one_names_its_field(self):
        offer = Offer("weights", 3, 10, "tcp://127.0.0.1:5555", ("a", "b"), True, (1, 2), (), handles=(b"h0", b"\x00h1"))
        assert decode_offer(encode_offer(offer), group="weights", group_version=3) == offer
        host = Offer("weights", 3, 10, "tcp://127.0.0.1:5555", ("a", "b"), True, (1, 2), ())
        assert decode_offer(encode_offer(host), group="weights", group_version=3).handles == ()
        for handles in [(b"h0",), (b"h0", b"h1", b"h2"), ("h0", "h1"), (b"h0", 1)]:
            bad = Offer("weights", 3, 10, "", ("a", "b"), True, (1, 2), (), handles=handles)  # type: ignore[arg-type]
            with pytest.raises(ManifestError, match="field 'handles'") as info:
                decode_offer(encode_offer(bad), group="weights", group_version=3)
            assert info.value.field == "handles", handles

    def test_a_header_only_segment_is_fenced_and_marked_like_any_other(self, made):
        seg = create(made, 6, capacity=0)  # the header of a slot whose data is in device memory
        assert seg.data.numel() == 0
        seg.mark(2, 9, 12345)
        reader = shm.Segment.attach(seg.name, group="weights", group_version=6, creator_pid=os.getpid())
        try:
            assert (reader.group_version(), reader.holds(), reader.data.numel()) == (6, (2, 9, 12345), 0)
        finally:
            reader.close()
        with pytest.raises(StaleGroupVersion):
            shm.Segment.attach(seg.name, group="weights", group_version=7, creator_pid=os.getpid())


class TestSpace:
    def test_a_segment_larger_than_dev_shm_is_a_typed_error_and_leaves_nothing(self):
        name = shm.segment_name("weights", 1, os.getpid(), 77, 0)
        with pytest.raises(SharedMemoryUnavailable, match="cannot create /dev/shm/ftstate-weights-v1") as info:
            shm.Segment.create(name, group_version=1, slot=0, capacity=1 << 50)  # 1 PiB
        assert info.value.nbytes > 1 << 50 and "bytes free in /dev/shm" in info.value.problem
        assert name not in shm.list_segments()


class TestOrphans:
    def test_segments_of_a_sigkilled_creator_are_swept_and_a_live_ones_kept(self, made):
        live = create(made, 2)
        code = ("import os, signal, sys; from ftstate.transport import shm;"
                "s = shm.Segment.create(shm.segment_name('weights', 2, os.getpid(), 1, 0), group_version=2, slot=0,"
                " capacity=4096); print(s.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == -signal.SIGKILL, out.stderr
        orphan = out.stdout.strip()
        assert orphan in shm.list_segments()
        swept = shm.sweep_orphans()
        assert orphan in swept and orphan not in shm.list_segments()
        assert live.name in shm.list_segments() and live.name not in swept


class TestStreaming:
    """A writer tells its readers how far it has filled a slot while it fills it, and a reader
    copies each piece once the writer has said it is there: a bucket is read while written."""

    def bucket(self, sizes: list[int]):
        from ftstate.transport.buckets import bucket_segments, plan_layout

        entries, windows, _ = plan_layout(((f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)), 1 << 30)
        (b,) = bucket_segments(entries, windows)
        return b

    def test_a_writer_announces_its_progress_every_stream_bytes_and_at_the_end(self, monkeypatch):
        import torch

        from ftstate.transport.checksum import StreamHasher
        from ftstate.transport.routes import copying

        monkeypatch.setattr(copying, "PIECE", 1024)
        monkeypatch.setattr(copying, "STREAM", 4096)
        b = self.bucket([10_000, 3_000])
        src = torch.randint(0, 255, (b.nbytes,), dtype=torch.uint8)
        dst = torch.zeros(b.nbytes, dtype=torch.uint8)
        told: list[int] = []
        asked: list[int] = []
        copying.copy_hash(b, dst, copying.in_bucket(src), StreamHasher(2), filled=told.append,
                          awaiting=asked.append)
        assert all(told[i] - told[i - 1] >= 4096 for i in range(1, len(told) - 1)) and told[-1] == b.nbytes
        assert len(told) >= 3 and told == sorted(told)
        # every piece is asked for before it is copied, by where it ends
        assert asked == sorted(asked) and asked[-1] == b.segments[-1].bucket_offset + b.segments[-1].length
        for s in b.segments:
            lo, hi = s.bucket_offset, s.bucket_offset + s.length
            assert torch.equal(dst[lo:hi], src[lo:hi])

    def follower(self):
        from types import SimpleNamespace

        from ftstate.transport.routes.signalling import Follower
        from ftstate.transport.signals import Channel

        writer = Channel.bind()
        reader = Channel.connect(writer.endpoint, 1)
        reader.send({"kind": "hello", "rank": 1, "pid": os.getpid()})
        assert writer.recv(5.0)["kind"] == "hello"
        route = SimpleNamespace(comm=SimpleNamespace(rank=1, group="weights", version=3))
        return writer, reader, Follower(reader, route, {0: os.getpid()}, 2)  # type: ignore[arg-type]

    def test_a_reader_waits_for_the_bytes_it_copies_and_refuses_a_malformed_progress(self):
        writer, reader, follow = self.follower()
        try:
            writer.send({"kind": "ready", "bucket": 0, "slot": 1, "upto": 40}, to=1)
            writer.send({"kind": "ready", "bucket": 0, "slot": 1, "upto": 100}, to=1)
            assert follow.start(0, 100, "bucket 1/2") == 1 and follow.upto == 40
            follow.awaiting(30)  # already there: no message read
            assert follow.upto == 40
            follow.awaiting(41)
            assert follow.upto == 100
            cases = [({"upto": 10}, "upto"), ({"upto": 120}, "upto"), ({"slot": 1, "upto": 50}, "bucket"),
                     ({"bucket": 2, "upto": 50}, "bucket")]
            for bad, field in cases:
                writer.send({"kind": "ready", "bucket": 1, "slot": 0, "upto": 10}, to=1)
                writer.send({"kind": "ready", "bucket": 1, "slot": 0, **bad}, to=1)
                assert follow.start(1, 100, "bucket 2/2") == 0
                with pytest.raises(ManifestError) as err:
                    follow.awaiting(100)
                assert err.value.field == field, bad
        finally:
            reader.close()
            writer.close()


class TestChunks:
    """A bucket goes to a collective rank in chunks, each hashed as it lands: the chunks cover
    every byte once, in order, and hashing them one by one gives the whole bucket's digests."""

    def test_chunks_cut_every_bucket_in_order_and_hash_as_the_whole(self):
        import torch

        from ftstate.transport.buckets import bucket_segments, plan_layout
        from ftstate.transport.checksum import StreamHasher
        from ftstate.transport.hashing import feed_bucket
        from ftstate.transport.routes.collective import chunks as cut_into
        from ftstate.transport.routes.copying import hash_bucket

        entries, windows, total = plan_layout(((f"t{i}", "uint8", (n,)) for i, n in enumerate([700, 2_500, 90])), 1024)
        buckets = bucket_segments(entries, windows)
        chunks = cut_into(buckets, 300)
        for b in buckets:
            mine = [(lo, hi) for c, lo, hi in chunks if c is b]
            assert mine[0][0] == 0 and mine[-1][1] == b.nbytes
            assert all(hi - lo <= 300 for lo, hi in mine)
            assert all(hi == nxt for (_, hi), (nxt, _) in itertools.pairwise(mine))
        flat = torch.randint(0, 255, (total,), dtype=torch.uint8)
        whole, cut = StreamHasher(3), StreamHasher(3)
        for b in buckets:
            hash_bucket(b, flat[b.start : b.stop], whole)
        for b, lo, hi in chunks:
            feed_bucket(cut, b, flat[b.start : b.stop], lo, hi)
        assert cut.tensor_digests() == whole.tensor_digests()
