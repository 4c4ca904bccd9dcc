"""The same-host route with its slots in device memory, with real processes.

This machine has no GPU, so GPU memory is replaced by a stand-in
(tests/integration/_device_standin.py: named /dev/shm files behind the same
:class:`~ftstate.transport.cudaipc.DeviceMemory` interface as CUDA IPC), installed in every
member process as the device memory of the ``cpu`` device: the route then takes its device
path on CPU (header-only segments, handles in the offer, a copy then a synchronize before
each bucket is announced, hashing through the host). The project's standards allow this:
mock only what cannot run here, and say so. The CUDA calls themselves are exercised by
tests/gpu/test_cuda_ipc.py on a GPU.

Rank 0 sends, ranks 1 and 2 read. What is checked: both readers bit-exact to the sender, the
report's routes say ``shm``; a second sync reuses the slots; a mixed transfer sends the
device slots over the collective too; a point-to-point resync takes device slots too, and a
relay keeps its own in /dev/shm; a SIGKILLed sender or reader ends the transfer with
nothing committed and nothing left in /dev/shm (the headers and the stand-in's files); a
damaged device slot, or a reader's damaged copy, is caught by the checksum; memory that
cannot be allocated is an announced fallback with ``auto`` and a typed error with ``require``.
"""

from __future__ import annotations

import time

import pytest

from tests.integration._transport_workers import RemoteError, make_state
from tests.integration.test_transport_shm import (
    SYNC_S,
    a_readers_damaged_copy_is_its_own,
    assert_bit_exact,
    committed_checksum,
    every_reader_refuses_bucket_1,
    expected_checksum,
    our_segments,
    planned,
    resync_newcomer,
)

STANDIN = "tests.integration._device_standin:HostStandIn"
NO_ROOM = "tests.integration._device_standin:NoRoomStandIn"


def install(members, factory: str = STANDIN) -> None:
    for w in members:
        w.call("install_device_memory", device_type="cpu", factory=factory)


@pytest.fixture
def group(pool):
    pool.heal()
    install(pool.members)
    pool.form()
    pool.members[0].call("load", seed=1, weights_version=1)
    return pool


def stats(worker) -> dict[str, int]:
    return worker.call("device_memory_stats")


class TestDeviceSlots:
    def test_two_readers_get_the_state_bit_exact_through_device_slots(self, group):
        rollouts = group.members[1:]
        before = [stats(w) for w in group.members]
        report = planned(group, [1, 2])
        assert report["routes"] == {1: "shm", 2: "shm"} and report["shm_fallback"] is None
        assert report["committed"] == [1, 2] and report["rejected"] == {}
        for rollout in rollouts:
            assert_bit_exact(rollout, 1)
            assert committed_checksum(rollout) == expected_checksum(1) == report["checksum"]
        after = [stats(w) for w in group.members]
        buckets = report["buckets"]
        # the sender made two slots in device memory, exported them, dropped their names once
        # both readers opened them, and synchronized before announcing each bucket
        sent = {k: after[0][k] - before[0][k] for k in after[0]}
        assert sent == {"alloc": 2, "export": 2, "open": 0, "unlink": 2, "synchronize": buckets, "release": 0}, sent
        for b, a in zip(before[1:], after[1:], strict=True):  # each reader opened both, synchronized each bucket
            assert (a["open"] - b["open"], a["synchronize"] - b["synchronize"]) == (2, buckets)
        # the header segments and the device memory's names went once the readers mapped them
        assert our_segments(group) == []

    def test_a_second_sync_reuses_the_slots_and_replaces_the_first(self, group):
        planned(group, [1, 2])
        before = [stats(w) for w in group.members]
        group.members[0].call("load", seed=2, weights_version=2)
        report = planned(group, [1, 2])
        assert report["committed"] == [1, 2] and report["routes"] == {1: "shm", 2: "shm"}
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 2)
            assert committed_checksum(rollout) == expected_checksum(2)
        after = [stats(w) for w in group.members]
        assert after[0]["alloc"] == before[0]["alloc"]  # the same slots
        assert [a["open"] for a in after[1:]] == [b["open"] for b in before[1:]]  # the same mappings

    def test_mixed_one_reader_on_device_slots_one_on_the_collective(self, group):
        report = planned(group, [1])
        assert report["routes"] == {1: "shm", 2: "collective"}
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)


    def test_point_to_point_resync_of_a_newcomer_from_a_members_device_slots(self, group):
        planned(group, [1, 2])
        _trainer, source, newcomer = group.members
        newcomer.call("reset_receiver")
        allocated = stats(source)["alloc"]
        newcomer.start("receive_planned", timeout_s=SYNC_S, src=1, point_to_point=True)
        report = source.call("send_to_planned", peer=2, timeout_s=SYNC_S, source="committed")
        assert newcomer.result()["checksum"] == expected_checksum(1)
        assert report["routes"] == {2: "shm"} and report["committed"] == [2]
        assert stats(source)["alloc"] - allocated == 2  # the source's own slots, in device memory
        assert_bit_exact(newcomer, 1)
        assert our_segments(group) == []

    def test_a_relay_keeps_its_slots_in_dev_shm(self, group):
        relay = group.members[1]
        allocated = stats(relay)["alloc"]
        report = planned(group, [], relays={1: [2]})
        assert report["routes"] == {1: "collective", 2: "relay"} and report["shm_fallback"] is None
        assert report["committed"] == [1, 2]
        assert stats(relay)["alloc"] == allocated
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)
        assert our_segments(group) == []


def a_damaged_device_slot_is_refused(group, checksum) -> None:
    """The slot is damaged after the writer's copy, before the readers read it: both refuse and
    keep version 1 (whose whole-state checksum is ``checksum(1)``)."""
    planned(group, [1, 2])
    trainer, *readers = group.members
    trainer.call("load", seed=6, weights_version=2)
    trainer.call("tamper_device_slot")
    for r in readers:
        r.start("receive_planned", timeout_s=SYNC_S)
    report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
    every_reader_refuses_bucket_1(readers, checksum=checksum)
    assert report["rejected"] == {1: "ChecksumMismatch", 2: "ChecksumMismatch"} and report["committed"] == []


def nh64_checksum(seed: int) -> str:
    from ftstate.transport.checksum import state_checksum

    return state_checksum(make_state(seed), "nh64")


@pytest.fixture
def on_device(group):
    """The group, with every member taking the stand-in's buffers for device memory in the choice
    of checksum function too: the sync is then proved with nh64, as on a GPU."""
    for w in group.members:
        w.call("use_device_digest", on=True)
    yield group
    for w in group.members:
        w.call("use_device_digest", on=False)


def planned_with_readers(group, same_host) -> tuple[dict, list[dict]]:
    trainer, *readers = group.members
    for r in readers:
        r.start("receive_planned", timeout_s=SYNC_S)
    report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=same_host)
    return report, [r.result() for r in readers]


class TestTheDigestWhereTheWeightsAre:
    """The weights on a device: every side hashes with nh64 where the bytes are, none goes to the host."""

    def test_a_sync_through_device_slots_is_proved_with_nh64_and_copies_no_byte_to_the_host(self, on_device):
        report, got = planned_with_readers(on_device, [1, 2])
        assert report["routes"] == {1: "shm", 2: "shm"} and report["committed"] == [1, 2]
        assert report["checksum"] == nh64_checksum(1) and report["checksum"].startswith("nh64:")
        assert report["host_bytes"] == 0 and [g["host_bytes"] for g in got] == [0, 0]
        for r in on_device.members[1:]:
            assert_bit_exact(r, 1)
            assert committed_checksum(r) == nh64_checksum(1)  # recomputed from the bytes held, with nh64

    def test_the_same_sync_hashed_with_xxh3_would_have_copied_every_byte_to_the_host(self, group):
        # the counter's control: the stand-in's buffers counted as device memory, the function
        # left at xxh3 by marking them only for counting (what a GPU sync cost before nh64)
        for w in group.members:
            w.call("use_device_digest", on=True)
        try:
            group.members[0].call("force_checksum_function", function="xxh3")
            report, got = planned_with_readers(group, [1, 2])
        finally:
            group.members[0].call("force_checksum_function", function=None)
            for w in group.members:
                w.call("use_device_digest", on=False)
        assert report["committed"] == [1, 2] and not report["checksum"].startswith("nh64:")
        payload = sum(t.numel() * t.element_size() for t in make_state(1).values())
        assert report["host_bytes"] >= payload and all(g["host_bytes"] >= payload for g in got)

    def test_a_damaged_device_slot_is_caught_by_every_readers_nh64(self, on_device):
        a_damaged_device_slot_is_refused(on_device, nh64_checksum)

    def test_a_collective_rank_of_a_mixed_transfer_proves_it_with_nh64_too(self, on_device):
        report, got = planned_with_readers(on_device, [1])
        assert report["routes"] == {1: "shm", 2: "collective"} and report["committed"] == [1, 2]
        assert [g["checksum"] for g in got] == [nh64_checksum(1)] * 2
        assert report["host_bytes"] == 0 and [g["host_bytes"] for g in got] == [0, 0]

    def test_a_resync_from_a_members_committed_device_weights_is_proved_with_nh64(self, on_device):
        report, got = resync_newcomer(on_device)
        newcomer = on_device.members[2]
        assert got["checksum"] == report["checksum"] == nh64_checksum(1) and got["host_bytes"] == 0
        assert_bit_exact(newcomer, 1)


class TestFaults:
    def test_sender_killed_mid_bucket_nothing_committed_nothing_left_next_sync_succeeds(self, group):
        planned(group, [1, 2])
        group.form()  # a new group version: new slots, made, offered and unlinked in this transfer
        trainer, *rollouts = group.members
        trainer.call("load", seed=3, weights_version=2)
        t0 = time.monotonic()
        for r in rollouts:
            r.start("receive_planned", timeout_s=SYNC_S)
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], kill_at=3)  # after bucket 3 of 8
        assert trainer.outcome()[0] == "died"
        for r in rollouts:
            with pytest.raises(RemoteError) as info:
                r.result(SYNC_S)
            err = info.value.info
            assert info.value.isinstance("PeerLost") and err["peer"] == 0, err
            assert err["op"].startswith("bucket ") and err["op"].endswith("/8"), err
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        for r in rollouts:
            assert committed_checksum(r) == expected_checksum(1)  # nothing committed
        assert our_segments(group) == []  # no header segment, no stand-in file
        group.heal()
        install(group.members)
        group.form()
        group.members[0].call("load", seed=4, weights_version=2)
        report = planned(group, [1, 2])
        assert report["committed"] == [1, 2] and report["routes"] == {1: "shm", 2: "shm"}
        for r in group.members[1:]:
            assert committed_checksum(r) == expected_checksum(4)

    def test_reader_killed_mid_read_ends_the_transfer_and_the_sender_frees_its_slots(self, group):
        planned(group, [1, 2])
        trainer, survivor, doomed = group.members
        trainer.call("load", seed=5, weights_version=2)
        released = stats(trainer)["release"]
        survivor.start("receive_planned", timeout_s=SYNC_S)
        doomed.start("receive_planned", timeout_s=SYNC_S, kill_at=2)  # after reading bucket 2 of 8
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        err = info.value.info
        assert info.value.isinstance("PeerLost") and err["peer"] == 2 and err["op"].startswith("bucket "), err
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        assert doomed.outcome()[0] == "died"
        kind, survivor_err = survivor.outcome(SYNC_S)
        assert kind == "err" and survivor_err.isinstance("PeerLost"), survivor_err
        assert committed_checksum(survivor) == expected_checksum(1)
        assert stats(trainer)["release"] - released == 2  # both device slots given back
        assert our_segments(group) == []

    def test_a_damaged_device_slot_is_caught_by_every_readers_checksum(self, group):
        a_damaged_device_slot_is_refused(group, expected_checksum)

    def test_a_readers_damaged_copy_is_caught_and_the_other_reader_commits(self, group):
        a_readers_damaged_copy_is_its_own(group)


class TestNoDeviceMemory:
    def test_with_auto_the_collective_carries_the_sync_and_the_report_says_why(self, group):
        trainer = group.members[0]
        install([trainer], NO_ROOM)
        try:
            report = planned(group, [1, 2])
        finally:
            install([trainer])
        assert report["routes"] == {1: "collective", 2: "collective"}
        assert "out of memory (stand-in)" in report["shm_fallback"], report
        for r in group.members[1:]:
            assert_bit_exact(r, 1)
        assert our_segments(group) == []  # the header segments made before the failure went with it

    def test_with_require_it_is_a_typed_error(self, group):
        trainer, *rollouts = group.members
        install([trainer], NO_ROOM)
        try:
            for r in rollouts:
                r.start("receive_planned", timeout_s=SYNC_S)
            with pytest.raises(RemoteError) as info:
                trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], require_shm=True)
            assert info.value.isinstance("SharedMemoryUnavailable"), info.value.info
            assert "cpu memory (NoRoomStandIn)" in info.value.info["message"], info.value.info
            for r in rollouts:
                kind, err = r.outcome(SYNC_S)
                assert kind == "err" and err.isinstance("TransportError"), err
        finally:
            install([trainer])
        assert our_segments(group) == []


def test_the_module_leaves_nothing_in_dev_shm(pool):
    assert our_segments(pool) == []
