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

from tests.integration._transport_workers import RemoteError
from tests.integration.test_transport_shm import (
    FAST_S,
    SYNC_S,
    a_readers_damaged_copy_is_its_own,
    assert_bit_exact,
    committed_checksum,
    every_reader_refuses_bucket_1,
    expected_checksum,
    our_segments,
    planned,
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


class TestFaults:
    def test_sender_killed_mid_bucket_nothing_committed_nothing_left_next_sync_succeeds(self, group):
        planned(group, [1, 2])
        group.form()  # a new group version: new slots, made, offered and unlinked in this transfer
        trainer, *rollouts = group.members
        trainer.call("load", seed=3, weights_version=2)
        for r in rollouts:
            r.start("receive_planned", timeout_s=SYNC_S)
        t0 = time.monotonic()
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], kill_at=3)  # after bucket 3 of 8
        assert trainer.outcome()[0] == "died"
        for r in rollouts:
            with pytest.raises(RemoteError) as info:
                r.result(FAST_S)
            err = info.value.info
            assert info.value.isinstance("PeerLost") and err["peer"] == 0, err
            assert err["op"].startswith("bucket ") and err["op"].endswith("/8"), err
        assert time.monotonic() - t0 < FAST_S
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
        assert time.monotonic() - t0 < FAST_S
        assert doomed.outcome()[0] == "died"
        kind, survivor_err = survivor.outcome(FAST_S)
        assert kind == "err" and survivor_err.isinstance("PeerLost"), survivor_err
        assert committed_checksum(survivor) == expected_checksum(1)
        assert stats(trainer)["release"] - released == 2  # both device slots given back
        assert our_segments(group) == []

    def test_a_damaged_device_slot_is_caught_by_every_readers_checksum(self, group):
        planned(group, [1, 2])
        trainer, *readers = group.members
        trainer.call("load", seed=6, weights_version=2)
        trainer.call("tamper_device_slot")  # the slot is damaged after the copy, before the readers read it
        for r in readers:
            r.start("receive_planned", timeout_s=SYNC_S)
        report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        every_reader_refuses_bucket_1(readers)
        assert report["rejected"] == {1: "ChecksumMismatch", 2: "ChecksumMismatch"} and report["committed"] == []

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
                kind, err = r.outcome(FAST_S)
                assert kind == "err" and err.isinstance("TransportError"), err
        finally:
            install([trainer])
        assert our_segments(group) == []


def test_the_module_leaves_nothing_in_dev_shm(pool):
    assert our_segments(pool) == []
