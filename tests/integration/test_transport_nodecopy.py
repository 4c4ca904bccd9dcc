"""The node copy with real processes: one full-size copy per node, verified in place, kept for newcomers.

Same pool of spawned members as test_transport_shm.py (rank 0 writes, ranks 1..2 read). The
"owner" of the node copies here is this test process (the runtime's is the node agent,
tests/integration/test_runtime_nodecopy.py). What is checked: readers commit views into one
node copy (no private staging, no spare kept); the copy stays named while committed and a
later version replaces it; a damaged bucket at one reader unlinks the new copy while every
reader keeps a valid state; a sender SIGKILLed mid-bucket leaves nothing committed and the
failed copy unlinked; a newcomer adopts the committed copy with no transfer at all, and one
that is gone or not the version asked for is a typed error.
"""

from __future__ import annotations

import os

import pytest

from ftstate.transport import nodecopy
from tests.integration._transport_workers import RemoteError
from tests.integration.test_transport_shm import (
    SYNC_S,
    assert_bit_exact,
    committed_checksum,
    expected_checksum,
    fresh_group,
)
from tests.timing import SLACK_S

OWNER = os.getpid()


@pytest.fixture
def group(pool):
    yield fresh_group(pool)
    nodecopy.unlink_names(nodecopy.copies_of(OWNER))  # what a test that failed left


def in_place(pool, *, members=None, timeout_s: float = SYNC_S, spare: bool = False) -> dict:
    trainer, *rollouts = pool.members if members is None else members
    for r in rollouts:
        r.start("receive_planned", timeout_s=timeout_s)
    report = trainer.call("broadcast_planned", timeout_s=timeout_s, same_host=[1, 2], node_copy_owner=OWNER,
                          node_copy_spare=spare)
    for r in rollouts:
        r.result()
    return report


class TestOneCopyPerNode:
    def test_readers_commit_views_into_one_node_copy_and_keep_no_private_staging(self, group):
        report = in_place(group)
        assert report["committed"] == [1, 2] and report["shm_fallback"] is None
        assert nodecopy.copies_of(OWNER) == [report["node_copy"]]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)
            assert committed_checksum(rollout) == expected_checksum(1)
            info = rollout.call("committed")
            assert info["node"] == report["node_copy"] and not info["spare"]

    def test_a_later_version_replaces_the_copy_and_the_first_is_unlinked(self, group):
        first = in_place(group)["node_copy"]
        group.members[0].call("load", seed=2, weights_version=2)
        second = in_place(group)["node_copy"]
        assert second != first and nodecopy.copies_of(OWNER) == [second]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 2)

    def test_a_damaged_bucket_at_one_reader_unlinks_the_new_copy(self, group):
        trainer, damaged, clean = group.members
        kept = in_place(group)["node_copy"]
        trainer.call("load", seed=7, weights_version=2)
        damaged.call("corrupt_next_bucket")
        damaged.start("receive_planned", timeout_s=SYNC_S)
        clean.start("receive_planned", timeout_s=SYNC_S)
        report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], node_copy_owner=OWNER)
        with pytest.raises(RemoteError) as info:
            damaged.result()
        assert info.value.isinstance("ChecksumMismatch"), info.value.info
        clean.result()
        assert report["rejected"] == {1: "ChecksumMismatch"}
        # the damage was in what the reader hashed, never in the copy the other one verified
        assert committed_checksum(damaged) == expected_checksum(1)
        assert committed_checksum(clean) == expected_checksum(7)
        assert nodecopy.copies_of(OWNER) == [kept] and report["node_copy"] is None

    def test_sender_killed_mid_bucket_commits_nothing_and_unlinks_the_failed_copy(self, group):
        kept = in_place(group)["node_copy"]
        trainer, *rollouts = group.members
        trainer.call("load", seed=3, weights_version=2)
        for r in rollouts:
            r.start("receive_planned", timeout_s=SYNC_S)
        trainer.start("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], node_copy_owner=OWNER, kill_at=3)
        assert trainer.outcome()[0] == "died"
        for r in rollouts:
            with pytest.raises(RemoteError) as info:
                r.result(SYNC_S)
            assert info.value.isinstance("PeerLost"), info.value.info
            assert committed_checksum(r) == expected_checksum(1)
        # the committed copy survives its writer; the failed one went with the readers' failure
        assert nodecopy.copies_of(OWNER) == [kept]


def inode(name: str) -> int:
    return os.stat(nodecopy.SHM_DIR / name).st_ino


class TestSpare:
    def test_the_previous_copy_is_kept_and_rewritten_as_the_next_one(self, group):
        trainer = group.members[0]
        first = in_place(group, spare=True)
        assert nodecopy.copies_of(OWNER) == [first["node_copy"]] and first["node_spare"] is None
        trainer.call("load", seed=2, weights_version=2)
        second = in_place(group, spare=True)
        assert second["node_spare"] == first["node_copy"]
        assert sorted(nodecopy.copies_of(OWNER)) == sorted([first["node_copy"], second["node_copy"]])
        was = inode(first["node_copy"])
        trainer.call("load", seed=3, weights_version=3)
        third = in_place(group, spare=True)
        assert inode(third["node_copy"]) == was and third["node_spare"] == second["node_copy"]
        assert sorted(nodecopy.copies_of(OWNER)) == sorted([second["node_copy"], third["node_copy"]])
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 3)
            assert rollout.call("committed")["node"] == third["node_copy"]

    def test_a_rejected_rewrite_of_the_spare_unlinks_it_and_the_committed_copy_stays(self, group):
        trainer, damaged, clean = group.members
        in_place(group, spare=True)
        trainer.call("load", seed=2, weights_version=2)
        kept = in_place(group, spare=True)["node_copy"]
        trainer.call("load", seed=7, weights_version=3)
        damaged.call("corrupt_next_bucket")
        damaged.start("receive_planned", timeout_s=SYNC_S)
        clean.start("receive_planned", timeout_s=SYNC_S)
        report = trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[1, 2], node_copy_owner=OWNER,
                              node_copy_spare=True)
        with pytest.raises(RemoteError):
            damaged.result()
        clean.result()
        assert report["rejected"] == {1: "ChecksumMismatch"} and nodecopy.copies_of(OWNER) == [kept]
        assert committed_checksum(damaged) == expected_checksum(2)
        # the next sync makes a new copy (the spare went with the rejected version) and goes through
        trainer.call("load", seed=4, weights_version=4)
        assert in_place(group, spare=True)["committed"] == [1, 2]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 4)


def relayed(pool, *, kill_at: int | None = None) -> dict:
    """Rank 1 relays to rank 2 (as if both were on a node of their own) through a node copy."""
    trainer, relay, peer = pool.members
    relay.start("receive_planned", timeout_s=SYNC_S, node_copy_owner=OWNER)
    peer.start("receive_planned", timeout_s=SYNC_S, kill_at=kill_at)
    return trainer.call("broadcast_planned", timeout_s=SYNC_S, same_host=[], relays={1: [2]})


class TestRelay:
    def test_the_relay_receives_into_a_node_copy_its_peer_verifies_in_place(self, group):
        trainer, relay, peer = group.members
        report = relayed(group)
        assert report["routes"] == {1: "collective", 2: "relay"} and report["committed"] == [1, 2]
        got_relay, got_peer = relay.result(), peer.result()
        assert got_relay["node"] == got_peer["node"] and nodecopy.copies_of(OWNER) == [got_relay["node"]]
        for rollout in (relay, peer):
            assert_bit_exact(rollout, 1)
            assert not rollout.call("committed")["spare"]
        trainer.call("load", seed=2, weights_version=2)
        relayed(group)
        second = relay.result()["node"]
        assert peer.result()["node"] == second != got_relay["node"] and nodecopy.copies_of(OWNER) == [second]
        for rollout in (relay, peer):
            assert_bit_exact(rollout, 2)

    def test_a_peer_killed_mid_read_unlinks_the_relays_new_copy_and_keeps_the_committed_one(self, group):
        trainer, relay, peer = group.members
        relayed(group)
        kept = relay.result()["node"]
        peer.result()
        trainer.call("load", seed=3, weights_version=2)
        with pytest.raises(RemoteError):
            relayed(group, kill_at=2)
        assert peer.outcome()[0] == "died"
        with pytest.raises(RemoteError):
            relay.result(SYNC_S)
        assert committed_checksum(relay) == expected_checksum(1) and nodecopy.copies_of(OWNER) == [kept]


class TestNewcomer:
    def test_a_newcomer_adopts_the_committed_copy_without_a_transfer(self, group):
        report = in_place(group)
        newcomer = group.members[2]
        newcomer.call("reset_receiver")
        got = newcomer.call("adopt", name=report["node_copy"], owner=OWNER, weights_version=1,
                            checksum=expected_checksum(1))
        assert got == {"weights_version": 1, "checksum": expected_checksum(1), "node": report["node_copy"]}
        assert_bit_exact(newcomer, 1)

    def test_a_copy_of_a_version_proved_with_nh64_is_adopted_against_either_functions_checksum(self, group):
        # the sender's weights counted as device memory: the version is proved with nh64, read in
        # place on the node with it; a newcomer proves the copy with the function of the checksum
        # it is handed (the version's nh64 one, or an xxh3 one of the same state)
        from tests.integration.test_transport_cudaipc import nh64_checksum

        for w in group.members:
            w.call("use_device_digest", on=True)
        try:
            report = in_place(group)
        finally:
            for w in group.members:
                w.call("use_device_digest", on=False)
        assert report["checksum"] == nh64_checksum(1) and report["committed"] == [1, 2]
        newcomer = group.members[2]
        for checksum in (nh64_checksum(1), expected_checksum(1)):
            newcomer.call("reset_receiver")
            got = newcomer.call("adopt", name=report["node_copy"], owner=OWNER, weights_version=1, checksum=checksum)
            assert got["checksum"] == checksum
        assert_bit_exact(newcomer, 1)

    def test_a_copy_that_is_gone_or_of_another_version_is_refused_and_nothing_is_adopted(self, group):
        report = in_place(group)
        newcomer = group.members[2]
        newcomer.call("reset_receiver")
        with pytest.raises(RemoteError, match="holds weights version 1, expected 2") as info:
            newcomer.call("adopt", name=report["node_copy"], owner=OWNER, weights_version=2,
                          checksum=expected_checksum(1))
        assert info.value.isinstance("ManifestError")
        with pytest.raises(RemoteError, match="expected the committed") as info:
            newcomer.call("adopt", name=report["node_copy"], owner=OWNER, weights_version=1,
                          checksum=expected_checksum(2))
        assert info.value.isinstance("ChecksumMismatch")
        nodecopy.unlink_names([report["node_copy"]])
        with pytest.raises(RemoteError, match="cannot be opened") as info:
            newcomer.call("adopt", name=report["node_copy"], owner=OWNER, weights_version=1,
                          checksum=expected_checksum(1))
        assert newcomer.call("committed") is None


class TestPointToPoint:
    """Another node's newcomer: the copy's owner (this process, as a node agent) serves it once
    over a socket on loopback; the newcomer proves it by checksum like any transfer."""

    def test_a_newcomer_elsewhere_receives_the_committed_copy_from_its_owner_and_proves_it(self, group):
        report = in_place(group)
        newcomer = group.members[2]
        newcomer.call("reset_receiver")
        served = nodecopy.serve(report["node_copy"], host="127.0.0.1", timeout_s=SYNC_S)
        got = newcomer.call("fetch", served=served, name=report["node_copy"], owner=OWNER, weights_version=1,
                            checksum=expected_checksum(1), timeout_s=SYNC_S)
        # its own buffer (the copy stays on its node), hashed by the newcomer itself
        assert got == {"weights_version": 1, "checksum": expected_checksum(1), "node": None}
        assert_bit_exact(newcomer, 1)

    def test_bytes_that_are_not_the_committed_version_or_a_wrong_token_commit_nothing(self, group):
        report = in_place(group)
        newcomer = group.members[2]
        newcomer.call("reset_receiver")
        served = nodecopy.serve(report["node_copy"], host="127.0.0.1", timeout_s=SYNC_S)
        with pytest.raises(RemoteError, match="expected the committed") as info:
            newcomer.call("fetch", served=served, name=report["node_copy"], owner=OWNER, weights_version=1,
                          checksum=expected_checksum(2), timeout_s=SYNC_S)
        assert info.value.isinstance("ChecksumMismatch")
        served = nodecopy.serve(report["node_copy"], host="127.0.0.1", timeout_s=SYNC_S)
        with pytest.raises(RemoteError, match="peer closed after 0 of 8 bytes") as info:
            newcomer.call("fetch", served={**served, "token": "0" * 32}, name=report["node_copy"], owner=OWNER,
                          weights_version=1, checksum=expected_checksum(1), timeout_s=SYNC_S)
        assert info.value.isinstance("TransportError")
        assert newcomer.call("committed") is None

    def test_an_agent_that_never_sends_is_a_sync_timeout_within_its_bound(self, group):
        import socket
        import time

        report = in_place(group)
        newcomer = group.members[2]
        with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts (the kernel does), never sends
            served = {"host": "127.0.0.1", "port": mute.getsockname()[1], "token": "0" * 32, "nbytes": 1 << 20}
            timeout = 0.5
            t0 = time.monotonic()
            with pytest.raises(RemoteError, match=r"timed out after 0.5s \(sync_timeout_s\)") as info:
                newcomer.call("fetch", served=served, name=report["node_copy"], owner=OWNER, weights_version=1,
                              checksum=expected_checksum(1), timeout_s=timeout)
            assert time.monotonic() - t0 < timeout + SLACK_S  # its bound plus scheduling; a mute agent is forever
        assert info.value.isinstance("SyncTimeout")

    def test_a_copy_larger_than_the_sockets_buffers_arrives_whole(self):
        """Tens of MiB: far beyond what the kernel buffers, so the agent's send waits on the
        newcomer many times over (a send that gave up at the first full buffer was caught here)."""
        import torch

        from benchmarks.nodecopy_p2p import _node_copy
        from ftstate.transport import Receiver, state_checksum

        g = torch.Generator().manual_seed(7)
        weights = {"a": torch.randn(6 << 20, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16)}
        node = _node_copy(weights, 4 << 20)  # 24 MiB, owned by this process
        try:
            served = nodecopy.serve(node.name, host="127.0.0.1", timeout_s=SYNC_S)
            got = nodecopy.fetch(Receiver(), served, name=node.name, group="bench-p2p", owner=OWNER,
                                 weights_version=1, checksum=state_checksum(weights), timeout_s=SYNC_S)
            assert got.state_checksum == state_checksum(weights) and got._node is None
            assert all(torch.equal(got.tensors[k], v) for k, v in weights.items())
        finally:
            node.unlink()
            node.close()

    def test_a_prewarmed_newcomer_receives_into_its_reserved_staging_and_keeps_it_when_a_fetch_fails(self):
        """A spare reserved (and touched) its staging while it waited; the copy lands in those
        very pages (no fresh memory on the resync's path), and a fetch that fails (the wrong
        version's checksum) leaves the receiver its committed version and the spare."""
        import torch

        from benchmarks.nodecopy_p2p import _node_copy
        from ftstate.core.errors import ChecksumMismatch
        from ftstate.transport import Receiver, state_checksum

        weights = {"a": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(77, dtype=torch.bfloat16)}
        node = _node_copy(weights, 4 << 20)
        try:
            newcomer = Receiver()
            newcomer.reserve(16 << 20, torch.device("cpu"))
            reserved = newcomer._spare[0].data_ptr()
            served = nodecopy.serve(node.name, host="127.0.0.1", timeout_s=SYNC_S)
            with pytest.raises(ChecksumMismatch, match="kept what this member held"):
                nodecopy.fetch(newcomer, served, name=node.name, group="bench-p2p", owner=OWNER, weights_version=1,
                               checksum="0" * 16, timeout_s=SYNC_S)
            assert newcomer.committed is None and newcomer._spare[0].data_ptr() == reserved
            served = nodecopy.serve(node.name, host="127.0.0.1", timeout_s=SYNC_S)
            got = nodecopy.fetch(newcomer, served, name=node.name, group="bench-p2p", owner=OWNER,
                                 weights_version=1, checksum=state_checksum(weights), timeout_s=SYNC_S)
            assert got._flat.data_ptr() == reserved  # the reserved pages, not a fresh buffer
            assert got.state_checksum == state_checksum(weights)
            assert all(torch.equal(got.tensors[k], v) for k, v in weights.items())
        finally:
            node.unlink()
            node.close()
