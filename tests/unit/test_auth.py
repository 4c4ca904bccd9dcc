"""The run's secret and the MACs of the control plane (ftstate.transport.auth), on real sockets.

Tags are bound to the run, channel, group, version and sender; a zmq signal that does not
verify, a replayed one and an identity squat are dropped and recorded; values planted in the
rendezvous store by a separate process without the secret are recorded and never obeyed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from ftstate.transport import auth
from ftstate.transport.signals import Channel


@pytest.fixture
def key():
    auth.install("run-a", os.urandom(32))
    auth.drain_forged()
    try:
        yield auth.current()
    finally:
        auth.uninstall()


def recv_within(chan: Channel, seconds: float = 2.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        msg = chan.recv(0.05)
        if msg is not None:
            return msg
    return None


class TestTags:
    def test_a_tag_is_bound_to_every_part_of_its_context(self, key):
        base = ("gloo", "weights", 3, 0, b"payload")
        tags = {auth.tag(*base)}
        for i, other in enumerate(("signal", "other", 4, 1, b"payloae")):
            ctx = list(base)
            ctx[i] = other
            tags.add(auth.tag(*ctx))
        tags.add(auth.tag(*base, key=auth.RunKey("run-b", key.secret)))
        assert len(tags) == 7

    def test_a_message_that_does_not_verify_is_dropped_and_recorded(self, key):
        signed = auth.sign("gloo", "weights", 3, 0, b"hello")
        assert auth.verify("gloo", "weights", 3, 0, signed) == b"hello"
        assert auth.verify("gloo", "weights", 3, 1, signed) is None  # another claimed sender
        assert auth.verify("gloo", "weights", 2, 0, signed) is None  # a replay into another version
        forged = auth.drain_forged()
        assert [f["claimed_sender"] for f in forged] == ["1", "0"] and forged[0]["channel"] == "gloo"
        assert auth.drain_forged() == []

    def test_the_secret_never_appears_in_a_repr(self, key):
        assert key.secret.hex() not in repr(key) and str(key.secret) not in repr(key)


class TestVotes:
    def test_a_vote_whose_tag_does_not_verify_counts_as_forged_never_as_a_commit(self, key):
        import types

        from ftstate.transport.stream import VOTE_COMMIT, VOTE_FORGED, signed_vote, vote_value

        comm = types.SimpleNamespace(group="weights", version=2)
        good = signed_vote(comm, 1, VOTE_COMMIT, 7)
        assert vote_value(comm, 1, good, 7) == VOTE_COMMIT
        assert vote_value(comm, 2, good, 7) == VOTE_FORGED  # rank 1's vote presented as rank 2's
        forged = good.clone()
        forged[1] ^= 1
        assert vote_value(comm, 1, forged, 7) == VOTE_FORGED
        assert [f["channel"] for f in auth.drain_forged()] == ["vote", "vote"]

    def test_a_vote_of_another_transfer_in_the_same_group_version_counts_as_forged(self, key):
        """A commit recorded in one transfer and played back in the next one of the same group
        version (same ranks, same weights version even) is not that transfer's commit."""
        import types

        from ftstate.transport.stream import VOTE_COMMIT, VOTE_FORGED, signed_vote, vote_value

        comm = types.SimpleNamespace(group="weights", version=2)
        recorded = signed_vote(comm, 1, VOTE_COMMIT, transfer=0x1111)
        assert vote_value(comm, 1, recorded, 0x1111) == VOTE_COMMIT
        assert vote_value(comm, 1, recorded, 0x2222) == VOTE_FORGED
        [record] = auth.drain_forged()
        assert record["channel"] == "vote" and record["claimed_sender"] == "1"


class TestSignals:
    def test_a_replayed_signal_is_dropped_and_recorded(self, key):
        router = Channel.bind(group="weights", version=1, rank=0)
        reader = Channel.connect(router.endpoint, 1, group="weights", version=1, writer=0)
        raw = zmq.Context.instance().socket(zmq.DEALER)  # what a recording attacker resends
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(router.endpoint)
        try:
            reader.send({"kind": "hello", "rank": 1, "pid": os.getpid()})
            assert recv_within(router)["from"] == 1
            reader.send({"kind": "released", "bucket": 0})
            assert recv_within(router)["kind"] == "released"
            # the attacker replays the genuine 'released' (same bytes, same tag) on its own connection,
            # and the genuine reader's own sequence number 2 again
            body = msgpack.packb({"kind": "released", "bucket": 0, "rank": 1, "seq": 2})
            raw.send(auth.sign(f"signal {router.endpoint}", "weights", 1, 1, body))
            assert recv_within(router, 0.5) is None
            forged = auth.drain_forged()
            assert forged and forged[0]["channel"] == "signal" and forged[0]["claimed_sender"] == "1"
            assert "replay" in forged[0]["problem"]
        finally:
            for c in (router, reader):
                c.close()
            raw.close()

    def test_an_identity_squat_gets_nothing_and_the_genuine_reader_is_heard(self, key):
        router = Channel.bind(group="weights", version=1, rank=0)
        squat = zmq.Context.instance().socket(zmq.DEALER)
        squat.setsockopt(zmq.LINGER, 0)
        squat.setsockopt(zmq.IDENTITY, b"r1")  # connects first, as rank 1's old identity
        squat.connect(router.endpoint)
        squat.send(msgpack.packb({"kind": "hello", "rank": 1, "seq": 1, "pid": 1}) + b"\0" * auth.TAG_BYTES)
        reader = Channel.connect(router.endpoint, 1, group="weights", version=1, writer=0)
        try:
            assert recv_within(router, 0.5) is None  # the squat's hello: dropped
            reader.send({"kind": "hello", "rank": 1, "pid": os.getpid()})
            assert recv_within(router)["from"] == 1
            router.send({"kind": "ready", "bucket": 0, "slot": 0, "upto": 1}, to=1)
            assert recv_within(reader)["kind"] == "ready"
            assert not squat.poll(200)  # the squat got nothing
            [forged] = auth.drain_forged()
            assert forged["claimed_sender"] == "1" and forged["problem"] == "tag does not verify"
        finally:
            for c in (router, reader):
                c.close()
            squat.close()


PLANT = r"""
import sys, datetime
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
s = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5), use_libuv=True)
for item in sys.argv[3:]:
    k, _, v = item.partition("=")
    s.set(k, v.encode())
"""


def plant(address, **values: str) -> None:
    """Set store values from a separate process that has no secret (as another uid would)."""
    subprocess.run([sys.executable, "-c", PLANT, address.host, str(address.port),
                    *(f"{k.replace('__', '/')}={v}" for k, v in values.items())], check=True, timeout=60)


class TestStore:
    def test_values_planted_without_the_secret_are_recorded_and_never_obeyed(self, key):
        from ftstate.transport.store import (
            StoreServer,
            connect_store,
            join_version,
            read_current_version,
            roster,
        )

        with StoreServer("127.0.0.1") as server:
            store = connect_store(server.address, 5.0)
            assert server.fence("g", 1) == 1
            # the attack of issue 25: current_version raised to 9; plus an identity squat on
            # version 2's rank 0 and a planted roster entry
            plant(server.address, g__current_version="9", g__v2__joined__0="squat", g__v2__roster="5,")
            assert read_current_version(store, "g") is None  # fences nobody
            join_version(store, "g", 2, 0, 1, 5.0)  # replaces both and forms
            assert read_current_version(store, "g") == 2
            assert roster(store, "g", 2) == [0]
            forged = auth.drain_forged()
            assert {f["key"] for f in forged} >= {"g/current_version", "g/v2/joined/0", "g/v2/roster"}
            assert all(f["channel"] == "store" for f in forged)


def test_a_signal_to_a_reader_whose_connection_is_gone_names_that_peer_lost():
    """Seen in CI: a reader SIGKILLed mid-read, and the sender's next 'ready' to it failed with
    ZMQ's "Host unreachable" (ROUTER_MANDATORY: the identity's connection is gone) as a bare
    TransportError, before the reader's death was seen another way. It is that peer lost."""
    from ftstate.core.errors import PeerLost

    router = Channel.bind(group="weights", version=3, rank=0)
    reader = Channel.connect(router.endpoint, 2, group="weights", version=3, writer=0)
    try:
        reader.send({"kind": "hello", "rank": 2, "pid": os.getpid()})
        assert recv_within(router)["from"] == 2
        reader.close()  # as its process's death closes it
        deadline = time.monotonic() + 5.0
        with pytest.raises(PeerLost) as info:
            while time.monotonic() < deadline:  # the router learns of the disconnect asynchronously
                router.send({"kind": "ready", "bucket": 4, "slot": 0, "upto": 1}, to=2)
                time.sleep(0.01)
        assert info.value.peer == 2 and info.value.op.startswith("bucket ") and info.value.group_version == 3
    finally:
        router.close()
