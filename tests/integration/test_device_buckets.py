"""Host to device bucket by bucket (``ftstate.transport.devicebuckets``), with the GPU mocked.

This machine has no GPU, so the device here is a stand-in: CPU memory handed out by a
:class:`CountingMemory` that knows, at every moment, how many of its bytes are still alive
(each block is a bytearray that every tensor viewing it keeps alive, watched by a weakref).
The engine is a set of weights allocated once, into which each part is copied, as an
engine's ``load_weights`` copies into the parameters it built. What is asserted: the engine
ends bit-equal to the host version (whole-state checksum), the device never held more than two
buckets beyond the engine's weights, and nothing after the load; an engine that keeps the
parts it was handed shows as live memory (so the counter counts). tests/gpu/test_device_buckets.py
is the same on a real CUDA device, measured by torch's own allocator.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from ftstate.core.errors import ManifestError
from ftstate.transport import state_checksum
from ftstate.transport.devicebuckets import load_by_buckets, parts_of

KiB = 1024


class _Block(bytearray):
    """A bytearray that can be watched (plain bytearrays take no weakref)."""


class CountingMemory:
    """The stand-in device memory: live bytes now, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.allocations = 0

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        block = _Block(nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.allocations += 1
        weakref.finalize(block, self._freed, nbytes)
        return torch.frombuffer(block, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def synchronize(self, device: torch.device) -> None:
        pass


def version(seed: int, floats: int = 40 * KiB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(floats, generator=g), "layer.0.w": torch.randn(floats // 3, generator=g),
            "layer.0.b": torch.randn(7, generator=g).to(torch.bfloat16),
            "layer.1.w": torch.randn(floats // 2, generator=g).to(torch.bfloat16), "step": torch.tensor(seed)}


class Engine:
    """Weights built once; each part is copied into them (an engine's load)."""

    def __init__(self, like: dict[str, torch.Tensor], keep: bool = False) -> None:
        self.weights = {n: torch.zeros_like(t) for n, t in like.items()}
        self.keep = keep
        self.kept: list[dict[str, torch.Tensor]] = []
        self.calls: list[tuple[list[str], bool, bool]] = []

    def load(self, part: dict[str, torch.Tensor], first: bool, last: bool) -> None:
        for n, t in part.items():
            self.weights[n].copy_(t)
        self.calls.append((list(part), first, last))
        if self.keep:
            self.kept.append(part)


class TestTwoBucketsAtMost:
    @pytest.mark.parametrize("bucket_kib", [16, 64, 1024])
    def test_the_engine_ends_bit_equal_and_the_device_held_at_most_two_buckets(self, bucket_kib):
        host = version(1)
        engine, memory = Engine(host), CountingMemory()
        bucket = bucket_kib * KiB
        got = load_by_buckets(host, device=torch.device("cpu"), bucket_bytes=bucket, load=engine.load, memory=memory)
        assert state_checksum(engine.weights) == state_checksum(host)
        largest = max(t.numel() * t.element_size() for t in host.values())
        assert memory.peak <= 2 * max(bucket, largest), (memory.peak, bucket)
        assert memory.peak == got["device_bytes"] and memory.allocations <= 2  # allocated once per load
        assert memory.live == 0  # nothing stays on the device once loaded
        names = [n for part, _, _ in engine.calls for n in part]
        assert names == list(host) and got["buckets"] == len(engine.calls)
        assert [c[1] for c in engine.calls] == [True] + [False] * (len(engine.calls) - 1)
        assert [c[2] for c in engine.calls] == [False] * (len(engine.calls) - 1) + [True]

    def test_many_small_parts_still_two_buffers_reused_in_turn(self):
        host = version(2, floats=64 * KiB)  # 256 KiB of float32 alone: dozens of 8 KiB parts
        engine, memory = Engine(host), CountingMemory()
        got = load_by_buckets(host, device=torch.device("cpu"), bucket_bytes=8 * KiB, load=engine.load,
                              memory=memory)
        assert got["buckets"] == len(engine.calls) >= 4
        largest = max(t.numel() * t.element_size() for t in host.values())
        assert memory.allocations == 2 and memory.peak == 2 * largest  # the largest tensor is a part alone
        assert state_checksum(engine.weights) == state_checksum(host) and memory.live == 0

    @pytest.mark.parametrize("bucket_kib", [8, 1024])
    def test_the_proof_of_a_load_is_the_versions_nh64_checksum_whatever_the_parts(self, bucket_kib):
        host = version(4)
        engine, memory = Engine(host), CountingMemory()
        got = load_by_buckets(host, device=torch.device("cpu"), bucket_bytes=bucket_kib * KiB, load=engine.load,
                              memory=memory, prove=True)
        assert got["state_checksum"] == state_checksum(host, "nh64") == state_checksum(engine.weights, "nh64")

    def test_the_proof_hashes_the_devices_buffers_not_the_host_copy(self, monkeypatch):
        from ftstate.transport import digest

        host = version(5)
        buffers: list[torch.Tensor] = []
        memory = CountingMemory()
        alloc = memory.alloc
        monkeypatch.setattr(memory, "alloc", lambda n, d: buffers.append(alloc(n, d)) or buffers[-1])
        hashed: list[int] = []
        real = digest.tensor_digest
        monkeypatch.setattr(digest, "tensor_digest", lambda t, key=None: hashed.append(t.data_ptr()) or real(t, key))
        load_by_buckets(host, device=torch.device("cpu"), bucket_bytes=16 * KiB, load=Engine(host).load,
                        memory=memory, prove=True)
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
        assert len(hashed) == len(host)
        assert all(any(lo <= p < hi for lo, hi in spans) for p in hashed)  # every tensor hashed in a device buffer

    def test_an_engine_that_keeps_the_parts_it_was_handed_shows_as_live_device_memory(self):
        host = version(3)
        engine, memory = Engine(host, keep=True), CountingMemory()
        load_by_buckets(host, device=torch.device("cpu"), bucket_bytes=16 * KiB, load=engine.load, memory=memory)
        assert memory.live > 0  # what it kept: the buckets cannot go (and the second load overwrote them)
        engine.kept.clear()
        assert memory.live == 0


class TestParts:
    def test_parts_keep_the_order_fit_the_bucket_and_align_each_tensor(self):
        host = version(4)
        for part in parts_of(host, 16 * KiB):
            assert all(off % 64 == 0 for _, off, _ in part)
            if len(part) > 1:
                assert part[-1][1] + part[-1][2] <= 16 * KiB
        assert [n for part in parts_of(host, 16 * KiB) for n, _, _ in part] == list(host)

    def test_a_bucket_of_no_size_is_a_typed_error_naming_the_field(self):
        with pytest.raises(ManifestError, match="field 'bucket_bytes': expected a positive size, got 0"):
            parts_of(version(5), 0)


class TestTheDeviceBytesAreReported:
    """What a load by parts took on the device reaches ``SyncReport.device_bytes`` and the
    group's ``sync_done`` record, per rollout (the host returns it from its commit)."""

    @staticmethod
    def rollouts(*names: str) -> list:
        from types import SimpleNamespace

        return [SimpleNamespace(name=n, node_id="node-a", node="10.0.0.1") for n in names]

    def test_each_rollout_that_loaded_by_parts_reports_its_peak_device_bytes(self):
        from ftstate.controller.sync import memory_fields, memory_record

        host = version(5)
        loads = {}
        for name, bucket_kib in (("rollout-0", 16), ("rollout-1", 64)):
            memory = CountingMemory()
            got = load_by_buckets(host, device=torch.device("cpu"), bucket_bytes=bucket_kib * KiB,
                                  load=Engine(host).load, memory=memory)
            assert got["device_bytes"] == memory.peak  # what the device held at its peak
            loads[name] = got["device_bytes"]
        fields = memory_fields(self.rollouts("rollout-0", "rollout-1"), {"rollout-0": 10, "rollout-1": 20},
                               {"rollout-0": 0, "rollout-1": 0}, loads)
        assert fields["device_bytes"] == loads
        record = memory_record(fields)
        assert record["device_bytes"] == loads and record["peak_device_bytes"] == max(loads.values())
        assert record["peak_staging_bytes"] == 20 and record["node_staging_bytes"] == {"node-a": 30}

    def test_a_rollout_whose_load_failed_or_that_loaded_whole_reports_no_device_bytes(self):
        from ftstate.controller.sync import memory_fields, memory_record

        # rollout-1's commit failed: it is not among those that loaded, so its figure goes
        fields = memory_fields(self.rollouts("rollout-0"), {"rollout-0": 10}, {"rollout-0": 0},
                               {"rollout-0": 4 * KiB, "rollout-1": 8 * KiB})
        assert fields["device_bytes"] == {"rollout-0": 4 * KiB}
        # whole loads (no weights_device()): the record carries no device fields at all
        record = memory_record(memory_fields(self.rollouts("rollout-0"), {"rollout-0": 10}, {"rollout-0": 0}))
        assert "device_bytes" not in record and "peak_device_bytes" not in record
