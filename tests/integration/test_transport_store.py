"""The controller's store and the versioned rendezvous, in one process (no spawned members)."""

from __future__ import annotations

import threading
import time

import pytest

from ftstate.core.errors import RendezvousTimeout, StaleGroupVersion, TransportError
from ftstate.transport import StoreAddress, StoreServer
from ftstate.transport.store import connect_store, join_version
from tests.timing import SLACK_S


@pytest.fixture
def server():
    s = StoreServer("127.0.0.1")
    try:
        yield s
    finally:
        s.close()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            addr, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":  # LISTEN
                found.add(addr)
    return found


def test_the_store_listens_on_loopback_only(server):
    assert server.address.host == "127.0.0.1"
    assert listening_addresses(server.address.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0


def test_store_address_parses_its_forms():
    assert StoreAddress.parse("127.0.0.1:29500") == StoreAddress("127.0.0.1", 29500)
    assert StoreAddress.parse(("10.0.0.1", 1)) == StoreAddress("10.0.0.1", 1)
    with pytest.raises(ValueError, match="host:port"):
        StoreAddress.parse("nohost")


def test_fencing_only_ever_raises_the_current_version(server):
    assert server.current_version("g") is None
    assert server.fence("g", 3) == 3
    assert server.fence("g", 2) == 3
    assert server.current_version("g") == 3
    store = connect_store(server.address, 2.0)
    with pytest.raises(StaleGroupVersion, match="version 2; current version is 3"):
        join_version(store, "g", 2, 0, 1, 1.0)


def test_a_lone_member_of_a_version_of_one_forms_at_once(server):
    store = connect_store(server.address, 2.0)
    # a join bound far longer than forming takes: a member that waited for anyone would wait it out
    bound = 30.0
    t0 = time.monotonic()
    join_version(store, "solo", 1, 0, 1, bound)
    assert time.monotonic() - t0 < bound / 2
    assert server.arrived("solo", 1) == [0]


def in_thread(fn, *args) -> tuple[threading.Thread, list[BaseException | None]]:
    """Run ``fn(*args)`` in a thread; the list gets what it raised (None if nothing)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test to assert on
            outcome.append(exc)
        else:
            outcome.append(None)

    t = threading.Thread(target=run)
    t.start()
    return t, outcome


def test_a_rank_cannot_be_held_twice_in_one_version(server):
    a, b = connect_store(server.address, 2.0), connect_store(server.address, 2.0)
    t, outcome = in_thread(join_version, a, "g", 1, 0, 2, 1.0)
    time.sleep(0.2)
    with pytest.raises(TransportError, match="rank 0 of group 'g' version 1 is already held by pid"):
        join_version(b, "g", 1, 0, 2, 1.0)
    t.join()
    assert isinstance(outcome[0], RendezvousTimeout), outcome


def test_the_controller_bounds_a_rendezvous_and_names_who_is_missing(server):
    store = connect_store(server.address, 2.0)
    t, outcome = in_thread(join_version, store, "g", 7, 1, 3, 1.5)
    timeout = 1.0
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info:
        server.wait_joined("g", 7, 3, timeout_s=timeout)
    # the deadline plus scheduling: without it the controller waits for ranks 0 and 2 for ever
    assert timeout <= time.monotonic() - t0 < timeout + SLACK_S
    assert info.value.missing == ("rank 0", "rank 2") and info.value.arrived == ("rank 1",)
    assert info.value.key == "init_timeout_s" and info.value.group_version == 7
    assert "group 'g' version 7" in str(info.value) and "member controller" in str(info.value)
    t.join()
    assert isinstance(outcome[0], RendezvousTimeout), outcome


def test_group_names_with_a_slash_are_refused(server):
    with pytest.raises(ValueError, match="without '/'"):
        server.fence("a/b", 1)


def test_an_unreachable_store_is_a_rendezvous_timeout():
    closed = StoreServer("127.0.0.1")
    addr = closed.address
    closed.close()
    with pytest.raises(RendezvousTimeout, match=f"store at {addr}"):
        connect_store(addr, 0.5)


def test_fencing_a_version_releases_the_members_waiting_in_it(server):
    """A member died before arriving: the controller abandons the version, and the members
    already waiting in it are released at once, not at init_timeout_s."""
    join_s = 30.0  # their join bound (init_timeout_s): what the fence must release them long before
    waiting = [in_thread(join_version, connect_store(server.address, 2.0), "g", 3, rank, 3, join_s) for rank in (0, 1)]
    time.sleep(0.3)  # both are now blocked waiting for rank 2, which never comes
    t0 = time.monotonic()
    server.fence("g", 4)
    for t, outcome in waiting:
        t.join(timeout=join_s)
        assert not t.is_alive()
        assert isinstance(outcome[0], StaleGroupVersion), outcome
        assert (outcome[0].got, outcome[0].current) == (3, 4)
    assert time.monotonic() - t0 < join_s / 2  # released by the fence: waiting the bound out takes all of it


def test_members_that_disagree_on_the_world_size_are_refused_naming_it(server):
    first = in_thread(join_version, connect_store(server.address, 2.0), "g", 5, 0, 3, 30.0)
    time.sleep(0.2)
    with pytest.raises(TransportError, match="field 'world_size': 2, but the members already registered agreed on 3"):
        join_version(connect_store(server.address, 2.0), "g", 5, 1, 2, 1.0)
    server.fence("g", 6)  # release the first
    first[0].join(timeout=5.0)
    assert isinstance(first[1][0], StaleGroupVersion)


REPLAY = r"""
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=10), use_libuv=True)
if sys.argv[3] == "read":
    sys.stdout.write(s.get(sys.argv[4]).hex())
else:
    s.set(sys.argv[4], bytes.fromhex(sys.argv[5]))
"""


def _outsider(server, *args: str) -> str:
    """Another process with no key: reads or writes one store value, as an attacker on the host would."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REPLAY, server.address.host, str(server.address.port), *args],
                          check=True, timeout=60, capture_output=True, text=True)
    return done.stdout


def test_an_older_current_version_written_back_does_not_reopen_a_fenced_version(server):
    """Authenticated: a process outside the run copies the genuine, signed value of
    ``current_version`` at version 1, waits until the group moved to 2, and writes the old
    value back (its tag verifies: a member signed it). The store's value only ever rises, so
    a lower one is a replay: recorded as forged, and version 1 stays fenced (without the check
    a straggler of version 1 would be let back in)."""
    from ftstate.transport import auth

    auth.install("replay-test", auth.new_secret())
    auth.drain_forged()
    try:
        server.fence("g", 1)
        old = _outsider(server, "read", "g/current_version")
        server.fence("g", 2)
        _outsider(server, "write", "g/current_version", old)
        assert server.current_version("g") == 2
        store = connect_store(server.address, 2.0)
        with pytest.raises(StaleGroupVersion, match="version 1; current version is 2"):
            join_version(store, "g", 1, 0, 1, 1.0)
        forged = auth.drain_forged()
        assert forged and all(f["channel"] == "store" and f["key"] == "g/current_version" for f in forged)
        assert "replayed: version 1 is below version 2" in forged[0]["problem"]
        assert server.fence("g", 3) == 3  # the group moves on past the replayed value
    finally:
        auth.uninstall()
