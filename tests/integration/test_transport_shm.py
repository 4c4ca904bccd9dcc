"""The same-host route with real processes: buckets through /dev/shm, signals over pyzmq.

Same pool of spawned members as test_transport.py (rank 0 sends, ranks 1..n-1 receive);
every test forms its own group version. What is checked: the bytes arrive bit-exact
through shared memory and in a mixed transfer (one reader on shared memory, one on the
collective); a SIGKILLed sender or reader ends the transfer for everyone at once, with
nothing committed and no segment left named; a damaged segment is caught by the checksum;
a segment of an older group version is refused before it is read; no shared memory at all
is a typed error or an announced fallback, never silent. The relay (one copy per remote
node): rank 1 stands in for a remote node's relay and rank 2 for its node peer; the peer
reads the relay's slots and still verifies against the sender's seal; a SIGKILLed relay
ends its peer's read within one poll, with nothing committed and nothing left in /dev/shm.
"""

from __future__ import annotations

import time

import pytest

from tests.integration._transport_workers import GROUP, RemoteError, make_state

SYNC_S = 10.0  # every transfer's timeout_s here: what a fault must end them long before


def fresh_group(pool):
    """The pool healed, a new group version formed, rank 0 holding seed 1 as weights version 1."""
    pool.heal()
    pool.form()
    pool.members[0].call("load", seed=1, weights_version=1)
    return pool


@pytest.fixture
def group(pool):
    return fresh_group(pool)


def a_readers_damaged_copy_is_its_own(group) -> None:
    """Reader 1 damages its own copy of the first bucket: it rejects, reader 2 commits the bytes as sent."""
    trainer, damaged, clean = group.members
    planned(group, [1, 2])
    trainer.call("load", seed=7, weights_version=2)
    damaged.call("corrupt_next_bucket")
    damaged.start("receive_planned", timeout_s=SYNC_S)
    clean.start("receive_planned", timeout_s=SYNC_S)
    report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
    with pytest.raises(RemoteError) as info:
        damaged.result()
    assert info.value.isinstance("ChecksumMismatch"), info.value.info
    clean.result()
    assert report["rejected"] == {1: "ChecksumMismatch"} and report["committed"] == [2]
    assert committed_checksum(clean) == expected_checksum(7)
    assert committed_checksum(damaged) == expected_checksum(1)


def expected_checksum(seed: int) -> str:
    from ftstate.transport import state_checksum

    return state_checksum(make_state(seed))


def planned(pool, same_host, *, members=None, timeout_s: float = SYNC_S, relays=None) -> dict:
    trainer, *rollouts = pool.members if members is None else members
    for r in rollouts:
        r.start("receive_planned", timeout_s=timeout_s)
    report = trainer.call("broadcast_planned", timeout_s=timeout_s, same_host=same_host, relays=relays)
    for r in rollouts:
        r.result()
    return report


def resync_newcomer(group) -> tuple[dict, dict]:
    """After a sync to ranks 1 and 2, rank 2 forgets its weights and gets them again from rank 1's
    committed copy, point to point: rank 1's report and rank 2's result."""
    planned(group, [1, 2])
    _trainer, source, newcomer = group.members
    newcomer.call("reset_receiver")
    newcomer.start("receive_planned", timeout_s=SYNC_S, src=1, point_to_point=True)
    report = source.call("send_to_planned", peer=2, timeout_s=SYNC_S, source="committed")
    return report, newcomer.result()


def committed_checksum(worker) -> str | None:
    info = worker.call("committed")
    if info is None:
        return None
    assert info["checksum"] == info["recomputed"], "committed checksum must match the bytes held"
    return info["checksum"]


def every_reader_refuses_bucket_1(readers, kept_seed: int = 1, checksum=expected_checksum) -> None:
    """Each of ``readers`` (started) fails with ChecksumMismatch in bucket 1 and still holds the
    weights of ``kept_seed`` (their whole-state checksum: ``checksum(kept_seed)``)."""
    for r in readers:
        with pytest.raises(RemoteError) as info:
            r.result()
        assert info.value.isinstance("ChecksumMismatch"), info.value.info
        assert "bucket 1/" in info.value.info["message"], info.value.info
        assert committed_checksum(r) == checksum(kept_seed)


def assert_bit_exact(worker, seed: int) -> None:
    from ftstate.transport.checksum import byte_view, dtype_name

    want = make_state(seed)
    got = worker.call("committed_bytes")
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name] == (dtype_name(t.dtype), list(t.shape), bytes(byte_view(t).numpy())), name


def our_segments(pool) -> list[str]:
    from ftstate.transport import shm

    pids = {f"-p{w.pid}-" for w in pool.started if w.pid is not None}
    return [n for n in shm.list_segments() if any(p in n for p in pids)]


class TestSameHost:
    def test_two_readers_get_the_state_bit_exact_through_shared_memory(self, group):
        report = planned(group, [1, 2])
        assert report["routes"] == {1: "shm", 2: "shm"} and report["shm_fallback"] is None
        assert report["committed"] == [1, 2] and report["rejected"] == {}
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)
            assert committed_checksum(rollout) == expected_checksum(1) == report["checksum"]
        # the names went once the readers mapped the slots: nothing is left in /dev/shm
        assert our_segments(group) == []

    def test_a_second_sync_reuses_the_slots_and_replaces_the_first(self, group):
        planned(group, [1, 2])
        group.members[0].call("load", seed=2, weights_version=2)
        report = planned(group, [1, 2])
        assert report["committed"] == [1, 2]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 2)
            assert committed_checksum(rollout) == expected_checksum(2)

    def test_mixed_one_reader_on_shared_memory_one_on_the_collective(self, group):
        report = planned(group, [1])
        assert report["routes"] == {1: "shm", 2: "collective"}
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)

    def test_point_to_point_resync_of_a_newcomer_on_the_same_host(self, group):
        report, got = resync_newcomer(group)
        assert got["checksum"] == expected_checksum(1)
        assert report["routes"] == {2: "shm"} and report["committed"] == [2]
        assert_bit_exact(group.members[2], 1)


class TestFaults:
    def test_sender_killed_mid_bucket_nothing_committed_no_segment_left_next_sync_succeeds(self, group):
        planned(group, [1, 2])
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
            # the fault landed mid-stream: the sender died with buckets still to send (the ready
            # signals it queued just before the SIGKILL may not have left the process)
            assert err["op"].startswith("bucket ") and err["op"].endswith("/8"), err
            assert "same host) died during bucket" in err["message"], err
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        for r in rollouts:
            assert committed_checksum(r) == expected_checksum(1)  # nothing committed
        assert our_segments(group) == []
        group.heal()
        group.form()
        group.members[0].call("load", seed=4, weights_version=2)
        assert planned(group, [1, 2])["committed"] == [1, 2]
        for r in group.members[1:]:
            assert committed_checksum(r) == expected_checksum(4)

    def test_reader_killed_mid_read_ends_the_transfer_for_all_at_once(self, group):
        planned(group, [1, 2])
        trainer, survivor, doomed = group.members
        trainer.call("load", seed=5, weights_version=2)
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
        assert our_segments(group) == []  # the sender unlinked on its way out
        assert trainer.call("segment_names") == []

    def test_a_reader_lost_before_it_attached_leaves_no_segment_named_while_the_sender_lives(self, group):
        """The transfer fails in the window between the sender naming its fresh segments and
        every reader mapping them (after which the names go): nobody else will unlink them, so
        the sender, alive, must do it on its way out."""
        trainer, survivor, doomed = group.members
        survivor.start("receive_planned", timeout_s=SYNC_S)
        doomed.kill()  # before it said hello: it never maps the segments
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        assert info.value.isinstance("TransportError"), info.value.info
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        assert trainer.alive
        assert trainer.call("segment_names") == []
        assert our_segments(group) == []
        kind, _ = survivor.outcome(SYNC_S)
        assert kind == "err"

    def test_collective_ranks_get_every_bucket_in_chunks_bit_exact(self, group):
        # 10,000-byte chunks: several per 64 KiB bucket, their ends off every tensor's boundary
        group.members[0].call("set_net_chunk", nbytes=10_000)
        try:
            report = planned(group, [])
        finally:
            group.members[0].call("set_net_chunk", nbytes=None)
        assert report["routes"] == {1: "collective", 2: "collective"} and report["committed"] == [1, 2]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)

    def test_sender_killed_mid_chunks_the_collective_ranks_keep_their_version(self, group):
        planned(group, [])
        trainer, *rollouts = group.members
        trainer.call("load", seed=11, weights_version=2)
        trainer.call("set_net_chunk", nbytes=10_000)  # the process dies: nothing to set back
        t0 = time.monotonic()
        for r in rollouts:
            r.start("receive_planned", timeout_s=SYNC_S)
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[], kill_at=3)  # after bucket 3 of 8
        assert trainer.outcome()[0] == "died"
        for r in rollouts:
            with pytest.raises(RemoteError) as info:
                r.result(SYNC_S)
            assert info.value.isinstance("PeerLost") and info.value.info["peer"] == 0, info.value.info
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        for r in rollouts:
            assert committed_checksum(r) == expected_checksum(1)
        group.heal()
        group.form()
        group.members[0].call("load", seed=12, weights_version=2)
        assert planned(group, [])["committed"] == [1, 2]
        for r in group.members[1:]:
            assert committed_checksum(r) == expected_checksum(12)

    def test_a_collective_rank_killed_mid_chunks_gives_the_sender_a_typed_error(self, group):
        planned(group, [])
        trainer, survivor, doomed = group.members
        trainer.call("load", seed=13, weights_version=2)
        trainer.call("set_net_chunk", nbytes=10_000)
        survivor.start("receive_planned", timeout_s=SYNC_S)
        doomed.start("receive_planned", timeout_s=SYNC_S, kill_at=2)  # after bucket 2 of 8
        t0 = time.monotonic()
        try:
            with pytest.raises(RemoteError) as info:
                trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[])
        finally:
            trainer.call("set_net_chunk", nbytes=None)
        assert info.value.isinstance("PeerLost") and info.value.info["peer"] == 2, info.value.info
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        assert doomed.outcome()[0] == "died"
        kind, err = survivor.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("TransportError"), err
        assert committed_checksum(survivor) == expected_checksum(1)

    def test_corrupted_segment_is_caught_by_the_checksum_and_the_previous_version_kept(self, group):
        pair = group.members[:2]
        group.form(pair)
        planned(group, [1], members=pair)
        trainer, reader = pair
        trainer.call("load", seed=6, weights_version=2)
        reader.call("corrupt_next_bucket")  # it reads the segment with one byte flipped
        reader.start("receive_planned", timeout_s=SYNC_S)
        report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1])
        with pytest.raises(RemoteError) as info:
            reader.result()
        assert info.value.isinstance("ChecksumMismatch"), info.value.info
        assert "bucket 1/" in info.value.info["message"] and "kept weights version 1" in info.value.info["message"]
        assert report["rejected"] == {1: "ChecksumMismatch"} and report["committed"] == []
        assert committed_checksum(reader) == expected_checksum(1)

    def test_a_slot_tampered_right_after_the_writers_copy_is_refused_and_the_next_sync_succeeds(self, group):
        # The writer's seal covers what it copied from, not what the slot holds afterwards: a
        # write into the slot after the copy is never blessed (issue 25).
        trainer, *readers = group.members
        planned(group, [1, 2])
        trainer.call("load", seed=11, weights_version=2)
        trainer.call("tamper_slot_after_copy")
        for r in readers:
            r.start("receive_planned", timeout_s=SYNC_S)
        report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        for r in readers:
            with pytest.raises(RemoteError) as info:
                r.result()
            assert info.value.isinstance("ChecksumMismatch"), info.value.info
            assert "kept weights version 1" in info.value.info["message"]
        assert report["committed"] == [] and report["rejected"] == {1: "ChecksumMismatch", 2: "ChecksumMismatch"}
        # the seal is the trainer's own bytes, not the tampered slot's
        assert report["checksum"] == expected_checksum(11)
        for r in readers:
            assert committed_checksum(r) == expected_checksum(1)
        trainer.call("load", seed=12, weights_version=3)
        report = planned(group, [1, 2])
        assert report["committed"] == [1, 2]
        for r in readers:
            assert_bit_exact(r, 12)
            assert committed_checksum(r) == expected_checksum(12) == report["checksum"]

    def test_a_damaged_segment_seen_by_one_reader_leaves_the_others_bytes_as_sent(self, group):
        a_readers_damaged_copy_is_its_own(group)

    def test_two_readers_damaged_at_the_same_byte_both_reject(self, group):
        # Two flips of one shared byte would cancel out; each reader's damage is its own.
        trainer, *readers = group.members
        planned(group, [1, 2])
        trainer.call("load", seed=8, weights_version=2)
        for r in readers:
            r.call("corrupt_next_bucket")
            r.start("receive_planned", timeout_s=SYNC_S)
        report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        for r in readers:
            with pytest.raises(RemoteError) as info:
                r.result()
            assert info.value.isinstance("ChecksumMismatch"), info.value.info
            assert committed_checksum(r) == expected_checksum(1)
        assert report["rejected"] == {1: "ChecksumMismatch", 2: "ChecksumMismatch"}

    def test_a_segment_of_an_older_group_version_is_never_read(self, group):
        trainer, *rollouts = group.members
        planned(group, [1, 2])
        old = group.version
        group.form()
        for r in rollouts:
            r.start("receive_planned", timeout_s=SYNC_S)
        names = trainer.call("offer_stale_segments", stale_version=old, timeout_s=SYNC_S)
        assert all(f"-v{old}-" in n for n in names)
        try:
            for r in rollouts:
                with pytest.raises(RemoteError) as info:
                    r.result(SYNC_S)
                err = info.value.info
                assert info.value.isinstance("StaleGroupVersion"), err
                assert (err["got"], err["current"]) == (old, group.version) and names[0] in err["peer"], err
                assert committed_checksum(r) == expected_checksum(1)  # never the 0x5A bytes of the old slot
        finally:
            trainer.call("drop_stale_segments")
        assert our_segments(group) == []


class TestNoSharedMemory:
    def test_required_shared_memory_that_is_unavailable_is_a_typed_error(self, group):
        trainer, *rollouts = group.members
        trainer.call("set_shm_dir", path="/nonexistent-ftstate-shm")
        try:
            for r in rollouts:
                r.start("receive_planned", timeout_s=SYNC_S)
            with pytest.raises(RemoteError) as info:
                trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], require_shm=True)
            assert info.value.isinstance("SharedMemoryUnavailable"), info.value.info
            assert info.value.info["message"].startswith("shared memory unavailable: cannot create "
                                                         "/nonexistent-ftstate-shm/ftstate-"), info.value.info
            for r in rollouts:  # released at once by the aborted communicator
                kind, err = r.outcome(SYNC_S)
                assert kind == "err" and err.isinstance("TransportError"), err
                assert committed_checksum(r) == expected_checksum(1) or committed_checksum(r) is None
        finally:
            trainer.call("set_shm_dir", path="/dev/shm")

    def test_with_auto_the_collective_carries_the_sync_and_the_report_says_why(self, group):
        trainer = group.members[0]
        trainer.call("set_shm_dir", path="/nonexistent-ftstate-shm")
        try:
            report = planned(group, [1, 2])
        finally:
            trainer.call("set_shm_dir", path="/dev/shm")
        assert report["routes"] == {1: "collective", 2: "collective"}
        assert "/nonexistent-ftstate-shm/ftstate-" in report["shm_fallback"]
        for r in group.members[1:]:
            assert_bit_exact(r, 1)


class TestRelay:
    """Rank 1 relays to rank 2 as if both were on a node of their own (the plan's ``relays``)."""

    def test_the_relay_hands_every_bucket_on_through_its_nodes_shared_memory(self, group):
        report = planned(group, [], relays={1: [2]})
        assert report["routes"] == {1: "collective", 2: "relay"} and report["shm_fallback"] is None
        assert report["committed"] == [1, 2] and report["rejected"] == {}
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)
            assert committed_checksum(rollout) == expected_checksum(1) == report["checksum"]
        assert our_segments(group) == []
        group.members[0].call("load", seed=2, weights_version=2)  # the relay's slots are reused
        assert planned(group, [], relays={1: [2]})["committed"] == [1, 2]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 2)

    def test_a_member_that_reads_the_senders_slots_and_a_relays_in_turn_keeps_both_mapped(self, group):
        for seed, (same_host, relays) in enumerate([([1, 2], None), ([], {1: [2]}), ([1, 2], None),
                                                    ([], {1: [2]})], start=1):
            group.members[0].call("load", seed=seed, weights_version=seed)
            report = planned(group, same_host, relays=relays)
            assert report["committed"] == [1, 2], report
            assert committed_checksum(group.members[2]) == expected_checksum(seed)
        assert our_segments(group) == []

    def test_a_relay_that_sent_its_peer_point_to_point_in_the_same_group_version_still_relays(self, group):
        """One process writes slots of two kinds: as its node's relay, and as the sender of a
        newcomer's resync. Its peer keeps a mapping of each; it once kept one per process, so the
        relay's next offer named slots the peer no longer had and the sync hung to its deadline."""
        trainer, relay, peer = group.members
        trainer.call("load", seed=3, weights_version=2)
        assert planned(group, [], relays={1: [2]})["committed"] == [1, 2]
        peer.call("reset_receiver")
        peer.start("receive_planned", timeout_s=SYNC_S, src=1, point_to_point=True)
        assert relay.call("send_to_planned", peer=2, timeout_s=SYNC_S, source="committed")["routes"] == {2: "shm"}
        assert peer.result()["checksum"] == expected_checksum(3)
        trainer.call("load", seed=4, weights_version=3)
        report = planned(group, [], relays={1: [2]})
        assert report["routes"] == {1: "collective", 2: "relay"} and report["committed"] == [1, 2]
        for r in (relay, peer):
            assert_bit_exact(r, 4)

    def test_a_peer_that_cannot_map_the_relays_slots_ends_the_transfer_at_once(self, group):
        """A peer that fails before it reads (here: the relay's kept slots are unknown to it)
        still says so to the relay, so nobody waits for the sync deadline."""
        trainer, relay, peer = group.members
        assert planned(group, [], relays={1: [2]})["committed"] == [1, 2]
        peer.call("forget_slot_mappings")
        trainer.call("load", seed=5, weights_version=2)
        t0 = time.monotonic()
        for r in (relay, peer):
            r.start("receive_planned", timeout_s=SYNC_S)
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[], relays={1: [2]})
        outcomes = [w.outcome(SYNC_S + 5) for w in (trainer, relay, peer)]
        assert time.monotonic() - t0 < SYNC_S, outcomes  # under the timeout_s that waiting for the peer would last out
        kind, err = outcomes[2]
        assert kind == "err" and err.isinstance("ManifestError") and err.info["field"] == "segments", outcomes
        assert not any(k == "err" and e.isinstance("SyncTimeout") for k, e in outcomes), outcomes
        assert committed_checksum(peer) == expected_checksum(1)

    def test_a_peer_verifies_against_the_senders_seal_not_the_relay(self, group):
        planned(group, [], relays={1: [2]})
        group.members[0].call("load", seed=2, weights_version=2)
        group.members[1].call("corrupt_next_bucket")  # the relay hands on a damaged bucket
        report = planned_tolerant(group, relays={1: [2]})
        assert report["rejected"] == {1: "ChecksumMismatch", 2: "ChecksumMismatch"}, report
        for rollout in group.members[1:]:
            assert committed_checksum(rollout) == expected_checksum(1)

    def test_a_relay_killed_mid_bucket_its_peer_abandons_at_once_nothing_left(self, group):
        planned(group, [], relays={1: [2]})
        trainer, relay, peer = group.members
        trainer.call("load", seed=3, weights_version=2)
        t0 = time.monotonic()
        peer.start("receive_planned", timeout_s=SYNC_S)
        relay.start("receive_planned", timeout_s=SYNC_S, kill_at=3)  # after handing on bucket 3 of 8
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[], relays={1: [2]})
        kind, err = peer.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("PeerLost") and err.info["peer"] == 1, err
        assert err.info["op"].startswith("bucket ") and "same host) died" in err.info["message"], err.info
        assert relay.outcome()[0] == "died"
        kind, err = trainer.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("TransportError"), err
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        assert committed_checksum(peer) == expected_checksum(1)  # nothing committed
        assert our_segments(group) == []
        group.heal()
        group.form()
        group.members[0].call("load", seed=4, weights_version=2)
        assert planned(group, [], relays={1: [2]})["committed"] == [1, 2]
        for r in group.members[1:]:
            assert committed_checksum(r) == expected_checksum(4)

    def test_a_peer_killed_mid_read_ends_the_relays_transfer_at_once(self, group):
        planned(group, [], relays={1: [2]})
        trainer, relay, peer = group.members
        trainer.call("load", seed=5, weights_version=2)
        t0 = time.monotonic()
        relay.start("receive_planned", timeout_s=SYNC_S)
        peer.start("receive_planned", timeout_s=SYNC_S, kill_at=2)  # after reading bucket 2 of 8
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[], relays={1: [2]})
        kind, err = relay.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("PeerLost") and err.info["peer"] == 2, err
        assert peer.outcome()[0] == "died"
        kind, err = trainer.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("TransportError"), err
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        assert committed_checksum(relay) == expected_checksum(1)
        assert our_segments(group) == []

    def test_a_relay_without_shared_memory_falls_back_to_the_collective_with_auto(self, group):
        relay = group.members[1]
        relay.call("set_shm_dir", path="/nonexistent-ftstate-shm")
        try:
            report = planned(group, [], relays={1: [2]})
        finally:
            relay.call("set_shm_dir", path="/dev/shm")
        assert report["routes"] == {1: "collective", 2: "collective"}
        assert report["shm_fallback"].startswith("relay rank 1: shared memory unavailable"), report
        for r in group.members[1:]:
            assert_bit_exact(r, 1)

    def test_a_relay_without_shared_memory_fails_the_transfer_with_require(self, group):
        trainer, relay, peer = group.members
        relay.call("set_shm_dir", path="/nonexistent-ftstate-shm")
        try:
            for r in (relay, peer):
                r.start("receive_planned", timeout_s=SYNC_S)
            with pytest.raises(RemoteError) as info:
                trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[], relays={1: [2]},
                             require_shm=True)
            assert info.value.isinstance("SharedMemoryUnavailable"), info.value.info
            for r in (relay, peer):
                kind, err = r.outcome(SYNC_S)
                assert kind == "err" and err.isinstance("SharedMemoryUnavailable"), err
        finally:
            relay.call("set_shm_dir", path="/dev/shm")
        assert our_segments(group) == []


def planned_tolerant(pool, *, relays) -> dict:
    """:func:`planned`, where receivers may reject (their ChecksumMismatch is in the report)."""
    trainer, *rollouts = pool.members
    for r in rollouts:
        r.start("receive_planned", timeout_s=SYNC_S)
    report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[], relays=relays)
    for r in rollouts:
        kind, err = r.outcome(SYNC_S)
        assert kind == "ok" or err.isinstance("ChecksumMismatch"), err
    return report


def test_the_module_leaves_no_segment_named(pool):
    assert our_segments(pool) == []
    assert GROUP == "weights"
