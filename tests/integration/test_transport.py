"""The transport with real processes: gloo groups of spawned members on 127.0.0.1.

One pool of member processes serves the whole module (importing torch costs ~2.5 s a
process here); a prewarmed spare stands in whenever a scenario needs "a fresh process
taking a dead member's rank". Every test forms its own group version first, so tests do
not depend on each other's order. Rank 0 is the trainer (the sender), ranks 1..n-1 are
rollouts. Timeouts are a few seconds; failures must arrive well before them.
"""

from __future__ import annotations

import time

import pytest

from tests.integration._transport_workers import GROUP, RemoteError, make_state
from tests.timing import SLACK_S

SYNC_S = 10.0  # sync_timeout_s in these tests: a typed error must come much sooner


@pytest.fixture
def group(pool):
    """All members alive, a fresh group version formed, trainer holding weights seed 1 (v1)."""
    pool.heal()
    pool.form()
    trainer = pool.members[0]
    trainer.call("load", seed=1, weights_version=1)
    return pool


def expected_checksum(seed: int) -> str:
    from ftstate.transport import state_checksum

    return state_checksum(make_state(seed))


def broadcast(pool, *, timeout_s: float = SYNC_S) -> dict:
    """Trainer broadcasts, every rollout receives; returns the trainer's report."""
    trainer, *rollouts = pool.members
    for r in rollouts:
        r.start("receive", timeout_s=timeout_s)
    report = trainer.call("broadcast", timeout_s=timeout_s)
    for r in rollouts:
        r.result()
    return report


def committed_checksum(worker) -> str | None:
    info = worker.call("committed")
    if info is None:
        return None
    assert info["checksum"] == info["recomputed"], "committed checksum must match the bytes held"
    return info["checksum"]


class TestRoundTrip:
    def test_state_of_mixed_dtypes_arrives_bit_exact_including_chunked_tensors(self, group):
        report = broadcast(group)
        assert report["committed"] == [1, 2] and report["rejected"] == {}
        # 64 KiB buckets: the two large tensors in 3 and 4 chunks, the small ones packed in one
        assert report["buckets"] == 3 + 4 + 1
        want = make_state(1)
        for rollout in group.members[1:]:
            got = rollout.call("committed_bytes")
            assert list(got) == list(want)
            for name, t in want.items():
                from ftstate.transport.checksum import byte_view, dtype_name

                assert got[name] == (dtype_name(t.dtype), list(t.shape), bytes(byte_view(t).numpy())), name
            assert committed_checksum(rollout) == expected_checksum(1) == report["checksum"]

    def test_a_second_sync_replaces_the_first(self, group):
        broadcast(group)
        group.members[0].call("load", seed=2, weights_version=2)
        broadcast(group)
        for rollout in group.members[1:]:
            info = rollout.call("committed")
            assert (info["weights_version"], info["checksum"]) == (2, expected_checksum(2))


class TestChecksum:
    def test_corrupted_bucket_raises_checksum_mismatch_and_previous_version_is_kept(self, group):
        broadcast(group)
        trainer, ok, bad = group.members
        trainer.call("load", seed=3, weights_version=2)
        bad.call("corrupt_next_bucket")
        ok.start("receive", timeout_s=SYNC_S)
        bad.start("receive", timeout_s=SYNC_S)
        report = trainer.call("broadcast", timeout_s=SYNC_S)
        assert ok.result()["checksum"] == expected_checksum(3)
        with pytest.raises(RemoteError) as info:
            bad.result()
        assert info.value.isinstance("ChecksumMismatch")
        assert "bucket 1/" in info.value.info["message"] and "kept weights version 1" in info.value.info["message"]
        assert committed_checksum(bad) == expected_checksum(1)
        # the sender learns who rejected the update; the group is still usable
        assert report["committed"] == [1] and report["rejected"] == {2: "ChecksumMismatch"}
        broadcast(group)
        assert committed_checksum(bad) == expected_checksum(3)


class TestRendezvous:
    def test_rank_that_never_joins_times_out_naming_it_and_the_next_version_forms(self, pool):
        pool.heal()
        a, b, absent = pool.members
        version = pool.next_version()
        timeout = 2.0
        t0 = time.monotonic()
        for rank, w in enumerate((a, b)):
            w.start("form", version=version, rank=rank, world_size=3, timeout_s=timeout)
        errors = []
        for w in (a, b):
            with pytest.raises(RemoteError) as info:
                w.result(timeout + 10)
            errors.append(info.value)
        elapsed = time.monotonic() - t0
        assert timeout <= elapsed < timeout + SLACK_S  # the deadline plus scheduling; without it they wait for rank 2 for ever
        for err in errors:
            assert err.isinstance("RendezvousTimeout") and err.isinstance("DeadlineExceeded")
            assert err.info["missing"] == ["rank 2"] and err.info["arrived"] == ["rank 0", "rank 1"]
            assert err.info["key"] == "init_timeout_s" and err.info["group_version"] == version
            assert f"group {GROUP!r} version {version}" in err.info["message"] and "2s" in err.info["message"]
        assert pool.server.arrived(GROUP, version) == [0, 1]
        # the next version forms with everyone and carries weights
        pool.form()
        a.call("load", seed=4, weights_version=1)
        broadcast(pool)
        assert committed_checksum(absent) == expected_checksum(4)


class TestMemberDeath:
    def test_receiver_killed_mid_broadcast_gives_the_sender_a_typed_error(self, group):
        broadcast(group)
        trainer, survivor, doomed = group.members
        trainer.call("load", seed=5, weights_version=2)
        survivor.start("receive", timeout_s=SYNC_S)
        doomed.start("receive", timeout_s=SYNC_S, kill_at=2)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            trainer.call("broadcast", timeout_s=SYNC_S)
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        assert info.value.isinstance("PeerLost"), info.value.info
        lost = info.value.info  # structured: which communicator, which rank, doing what
        assert (lost["group"], lost["group_version"], lost["rank"]) == (GROUP, group.version, 0), lost
        assert lost["op"].startswith(("bucket", "seal", "commit vote")), lost
        assert doomed.outcome()[0] == "died"
        # the other receiver is released at once too, with its previous version intact
        kind, err = survivor.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("TransportError"), err
        assert committed_checksum(survivor) == expected_checksum(1)

    def test_replaced_member_joins_the_next_version_and_gets_correct_weights(self, group):
        broadcast(group)
        dead = group.members[2]
        dead.kill()
        fresh = group.replace(2)  # a new process takes the dead member's rank
        assert fresh.pid != dead.pid
        group.form()
        group.members[0].call("load", seed=6, weights_version=2)
        report = broadcast(group)
        assert report["committed"] == [1, 2]
        assert committed_checksum(fresh) == expected_checksum(6)

    def test_sender_killed_mid_broadcast_leaves_receivers_on_the_previous_version(self, group):
        broadcast(group)
        trainer, *rollouts = group.members
        trainer.call("load", seed=7, weights_version=2)
        t0 = time.monotonic()
        for r in rollouts:
            r.start("receive", timeout_s=SYNC_S)
        trainer.start("broadcast", timeout_s=SYNC_S, kill_at=2)
        assert trainer.outcome()[0] == "died"
        for r in rollouts:
            with pytest.raises(RemoteError) as info:
                r.result(SYNC_S)
            assert info.value.isinstance("PeerLost"), info.value.info
            # a receiver knows who it lost: the broadcast's sender
            assert info.value.info["peer"] == 0 and info.value.info["group"] == GROUP, info.value.info
        assert time.monotonic() - t0 < SYNC_S  # under the transfers' timeout_s: a wait for the dead lasts it out
        for r in rollouts:
            assert committed_checksum(r) == expected_checksum(1)


class TestDeadline:
    def test_a_member_that_never_takes_part_costs_the_sync_deadline_not_a_hang(self, group):
        broadcast(group)
        trainer, waiting, _absent = group.members  # `_absent` is alive but never calls receive
        trainer.call("load", seed=9, weights_version=2)
        deadline = 2.0
        t0 = time.monotonic()
        waiting.start("receive", timeout_s=SYNC_S)
        with pytest.raises(RemoteError) as info:
            trainer.call("broadcast", timeout_s=deadline)
        assert deadline <= time.monotonic() - t0 < deadline + SLACK_S  # the deadline, plus scheduling
        assert info.value.isinstance("SyncTimeout"), info.value.info
        assert info.value.info["key"] == "sync_timeout_s" and info.value.info["seconds"] == deadline
        # the trainer gave up on this group version, which releases the waiting rollout at once
        kind, err = waiting.outcome(SYNC_S)
        assert kind == "err" and err.isinstance("TransportError"), err
        # released with the trainer's deadline, long before its own (SYNC_S), which it would otherwise wait out
        assert time.monotonic() - t0 < deadline + SLACK_S < SYNC_S
        assert committed_checksum(waiting) == expected_checksum(1)


class TestFencing:
    def test_a_member_still_on_an_older_version_is_fenced(self, group):
        old = group.version
        broadcast(group)
        group.form()  # version old+1; the members keep their old communicators around
        trainer, r1, _ = group.members
        with pytest.raises(RemoteError) as info:
            trainer.call("broadcast", timeout_s=SYNC_S, version=old)
        assert info.value.isinstance("StaleGroupVersion")
        assert (info.value.info["got"], info.value.info["current"]) == (old, old + 1)
        with pytest.raises(RemoteError) as info:
            r1.call("receive", timeout_s=SYNC_S, version=old)
        assert info.value.isinstance("StaleGroupVersion")
        # joining the abandoned version is refused too
        with pytest.raises(RemoteError) as info:
            r1.call("form", version=old, rank=1, world_size=3, timeout_s=2.0)
        assert info.value.isinstance("StaleGroupVersion")

    def test_a_manifest_stamped_with_an_older_version_is_never_applied(self, group):
        broadcast(group)
        trainer, *rollouts = group.members
        trainer.call("load", seed=8, weights_version=2)
        for r in rollouts:
            r.start("receive", timeout_s=SYNC_S)
        trainer.start("send_stale_manifest", stamped_version=group.version - 1, timeout_s=SYNC_S)
        for r in rollouts:
            with pytest.raises(RemoteError) as info:
                r.result(SYNC_S)
            assert info.value.isinstance("StaleGroupVersion"), info.value.info
            assert committed_checksum(r) == expected_checksum(1)
        # the receivers dropped that group version at once, so the stale sender may see them go
        kind, err = trainer.outcome(SYNC_S)
        assert kind == "ok" or err.isinstance("PeerLost"), err

    def test_the_controller_can_fence_a_version(self, group):
        group.server.fence(GROUP, group.version + 1)
        with pytest.raises(RemoteError) as info:
            group.members[0].call("broadcast", timeout_s=SYNC_S)
        assert info.value.isinstance("StaleGroupVersion")
        assert group.server.current_version(GROUP) == group.version + 1
        group.version += 1  # the fenced number is spent; the next fixture forms above it


class TestPointToPoint:
    def test_trainer_and_surviving_rollout_send_current_weights_to_a_newcomer_only(self, group):
        broadcast(group)
        group.replace(2)  # the newcomer: a fresh process holding nothing
        group.form()
        trainer, rollout, newcomer = group.members
        assert newcomer.call("committed") is None
        newcomer.start("receive_from", peer=0, timeout_s=SYNC_S)
        report = trainer.call("send_to", peer=2, timeout_s=SYNC_S)  # the other rollout is not involved
        assert report["committed"] == [2]
        assert newcomer.result()["checksum"] == expected_checksum(1)
        # and from a surviving rollout that holds the current version
        newcomer.call("reset_receiver")
        newcomer.start("receive_from", peer=1, timeout_s=SYNC_S)
        report = rollout.call("send_to", peer=2, timeout_s=SYNC_S, source="committed")
        assert report["committed"] == [2]
        got = newcomer.result()
        assert (got["weights_version"], got["checksum"]) == (1, expected_checksum(1))
        assert committed_checksum(newcomer) == committed_checksum(rollout)

    def test_reverse_sync_from_a_rollout_to_a_new_trainer_on_a_two_member_group(self, group):
        broadcast(group)
        new_trainer = group.replace(0)  # the trainer died; a fresh process takes rank 0
        rollout = group.members[1]
        version = group.next_version()
        for rank, w in enumerate((new_trainer, rollout)):
            w.start("form", version=version, rank=rank, world_size=2, timeout_s=SYNC_S, group="recovery")
        for w in (new_trainer, rollout):
            w.result()
        new_trainer.start("receive_from", peer=1, timeout_s=SYNC_S)
        report = rollout.call("send_to", peer=0, timeout_s=SYNC_S, source="committed")
        assert report["committed"] == [0]
        assert new_trainer.result()["checksum"] == expected_checksum(1)
        assert committed_checksum(new_trainer) == committed_checksum(rollout) == expected_checksum(1)
