"""Attacks on the transport of an authenticated run, from real processes on loopback.

Every member of the pool gets the run's secret (as a WorkerHost does from Ray). What is
checked, each with its record and a next sync in which every rollout holds the trainer's bytes:
a manifest sent into the gloo stream by a member without the secret (refused before it is
decoded: ``ManifestError`` field ``tag``, recorded as forged on the ``gloo`` channel); signals
sent into a transfer's zmq channel by a separate process (an identity squat as ``r1``, an
untagged ``failed`` claiming rank 1, a ``hello`` claiming rank 2 with a wrong tag): dropped and
recorded, the transfer completes; ``integrity: keyed`` moves the bytes bit-exact and refuses a
slot tampered after the writer's copy.
"""

from __future__ import annotations

import os

import pytest

from tests.integration._transport_workers import RemoteError
from tests.integration.test_transport_shm import (
    SYNC_S,
    assert_bit_exact,
    committed_checksum,
    every_reader_refuses_bucket_1,
    expected_checksum,
    planned,
)

SECRET = os.urandom(32)

#: Run in a separate process against a transfer's signal endpoint (argv[1]).
SIGNAL_ATTACK = r"""
import sys, time, msgpack, zmq
ctx = zmq.Context()
squat = ctx.socket(zmq.DEALER)
squat.setsockopt(zmq.IDENTITY, b"r1")           # the identity the genuine rank 1 used to take
squat.setsockopt(zmq.LINGER, 2000)
squat.connect(sys.argv[1])
squat.send(msgpack.packb({"kind": "failed", "rank": 1, "seq": 10**6, "reason": "forged"}))
squat.send(msgpack.packb({"kind": "hello", "rank": 2, "seq": 10**6, "pid": 1}) + b"\0" * 16)
squat.send(msgpack.packb({"kind": "released", "rank": 1, "seq": 10**6, "bucket": 0}) + b"\1" * 16)
time.sleep(0.3)
squat.close()
ctx.term()
"""


@pytest.fixture
def secured(pool):
    from ftstate.transport import auth

    auth.install("test-run", SECRET)  # this process hosts the pool's store, as the controller does
    pool.heal()
    for w in [*pool.members, pool.spare]:
        w.call("secure", secret=SECRET)
    pool.form()
    for w in pool.members:
        w.call("forged")  # what the previous test left behind is not this test's
    pool.members[0].call("load", seed=1, weights_version=1)
    try:
        yield pool
    finally:
        for w in [*pool.members, pool.spare]:
            if w.alive:
                w.call("secure", secret=None)
        auth.uninstall()


def next_sync_is_whole(pool, seed: int, weights_version: int) -> None:
    pool.members[0].call("load", seed=seed, weights_version=weights_version)
    report = planned(pool, [1, 2])
    assert report["committed"] == [1, 2]
    for r in pool.members[1:]:
        assert_bit_exact(r, seed)
        assert committed_checksum(r) == expected_checksum(seed) == report["checksum"]


class TestAuthenticated:
    def test_an_authenticated_run_moves_the_bytes_as_before(self, secured):
        next_sync_is_whole(secured, 2, 2)
        assert all(w.call("forged") == [] for w in secured.members)

    def test_the_relay_route_and_point_to_point_carry_tags_too(self, secured):
        for keyed in ("xxh3", "keyed"):
            for w in secured.members:
                w.call("secure", secret=SECRET, integrity=keyed)
            secured.members[0].call("load", seed=3, weights_version=2)
            report = planned(secured, [], relays={1: [2]})
            assert report["routes"] == {1: "collective", 2: "relay"} and report["committed"] == [1, 2]
            for r in secured.members[1:]:
                assert_bit_exact(r, 3)
            _trainer, source, newcomer = secured.members
            newcomer.call("reset_receiver")
            newcomer.start("receive_planned", timeout_s=SYNC_S, src=1, point_to_point=True)
            assert source.call("send_to_planned", peer=2, timeout_s=SYNC_S, source="committed")["committed"] == [2]
            assert newcomer.result()["checksum"] == expected_checksum(3)
        assert all(w.call("forged") == [] for w in secured.members)
        for w in secured.members:
            w.call("secure", secret=SECRET)

    def test_a_manifest_from_a_member_without_the_secret_is_refused_before_it_is_decoded(self, secured):
        trainer, *readers = secured.members
        planned(secured, [1, 2])
        trainer.call("secure", secret=os.urandom(32))  # in the gloo stream, but not of the run
        trainer.call("load", seed=5, weights_version=2)
        for r in readers:
            r.start("receive_planned", timeout_s=SYNC_S)
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        for r in readers:
            with pytest.raises(RemoteError) as info:
                r.result()
            assert info.value.isinstance("ManifestError") and info.value.info["field"] == "tag", info.value.info
            assert info.value.info["peer"] == "rank 0"
            [record] = r.call("forged")
            assert record["channel"] == "gloo" and record["claimed_sender"] == "0"
            assert committed_checksum(r) == expected_checksum(1)
        trainer.outcome(SYNC_S + 5)  # its transfer ends when the readers abort
        trainer.call("secure", secret=SECRET)
        secured.form()
        next_sync_is_whole(secured, 6, 3)

    def test_a_recorded_seal_played_back_in_a_later_transfer_of_the_group_version_is_refused(self, secured):
        """Two transfers of the same weights in one group version; the second closes with the
        first one's seal, byte for byte (its tag verifies: it is genuine). Its transfer id is not
        the manifest's, so every reader refuses it and keeps what it held."""
        trainer, *readers = secured.members
        trainer.call("load", seed=9, weights_version=2)
        trainer.call("replay_seal_next")
        assert planned(secured, [1, 2])["committed"] == [1, 2]  # the transfer it records
        for r in readers:
            r.call("reset_receiver")
            r.start("receive_planned", timeout_s=SYNC_S)
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
        for r in readers:
            with pytest.raises(RemoteError) as info:
                r.result()
            assert info.value.isinstance("ManifestError") and info.value.info["field"] == "transfer", info.value.info
            assert r.call("committed") is None  # nothing staged was committed
        trainer.outcome(SYNC_S + 5)  # its transfer ends when the readers abort
        secured.form()
        next_sync_is_whole(secured, 10, 3)

    def test_signals_from_a_process_outside_the_run_are_dropped_and_recorded(self, secured):
        trainer = secured.members[0]
        planned(secured, [1, 2])
        trainer.call("load", seed=7, weights_version=2)
        trainer.call("attack_signals_at_first_copy", script=SIGNAL_ATTACK)
        report = planned(secured, [1, 2])
        assert report["committed"] == [1, 2] and report["rejected"] == {}
        for r in secured.members[1:]:
            assert committed_checksum(r) == expected_checksum(7)
        records = trainer.call("forged")
        assert records and all(r["channel"] == "signal" for r in records), records
        assert {"1", "2"} <= {r["claimed_sender"] for r in records}, records
        next_sync_is_whole(secured, 8, 3)

    def test_a_keyed_reader_refuses_one_damaged_byte_from_its_slot_and_from_gloo(self, secured):
        """A keyed receiver hashes each byte once, keyed only, and takes its per-tensor checksums
        from the seal: the keyed bucket digest alone stands between a damaged byte and a commit.
        One byte flipped in what a reader copies from its slot (rank 1) or in what reaches it over
        gloo (rank 2) is refused, the version before is kept, and the next sync is whole."""
        for w in secured.members:
            w.call("secure", secret=SECRET, integrity="keyed")
        try:
            planned(secured, [1])
            trainer, *readers = secured.members
            trainer.call("load", seed=12, weights_version=2)
            for r in readers:
                r.call("corrupt_next_bucket")
                r.start("receive_planned", timeout_s=SYNC_S)
            report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1])
            assert report["routes"] == {1: "shm", 2: "collective"}, report
            every_reader_refuses_bucket_1(readers)
            assert report["committed"] == []
            next_sync_is_whole(secured, 13, 3)
        finally:
            for w in secured.members:
                w.call("secure", secret=SECRET)

    def test_keyed_integrity_moves_the_bytes_and_refuses_a_tampered_slot(self, secured):
        for w in secured.members:
            w.call("secure", secret=SECRET, integrity="keyed")
        try:
            next_sync_is_whole(secured, 9, 2)
            trainer, *readers = secured.members
            trainer.call("load", seed=10, weights_version=3)
            trainer.call("tamper_slot_after_copy")
            for r in readers:
                r.start("receive_planned", timeout_s=SYNC_S)
            report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2])
            for r in readers:
                with pytest.raises(RemoteError) as info:
                    r.result()
                assert info.value.isinstance("ChecksumMismatch")
            assert report["committed"] == []
            next_sync_is_whole(secured, 11, 4)
        finally:
            for w in secured.members:
                w.call("secure", secret=SECRET)
