"""gloo's own rendezvous values, planted in the run's store by a process outside the run.

gloo rendezvouses through ftstate's store: each rank writes its listening address under
``{group}/v{N}/gloo/0/{rank}`` and the others connect to what they read there. With the run
authenticated, torch's backend is handed :class:`~ftstate.transport.signedstore.SignedStore`
(every authenticated group in this suite forms through it). The planter here is a separate
process without the run's secret writing a raw ``TCPStore`` value under a rank's gloo key, as
the issue's store rewrite did; the genuine member's store client is a real ``TCPStore`` too.

- A value planted before the genuine member's: refused (one ``forged_message`` record, channel
  ``store``, naming the key, though it is read again while waiting), and the genuine value,
  written after it, is what the backend gets.
- A value planted with no genuine one coming: the read ends at the rendezvous deadline with
  ``RendezvousTimeout`` naming the key, never with the planted bytes.
- A gloo group of two real member processes formed through the wrapper moves weights with the
  sender's checksum.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from ftstate.core.errors import RendezvousTimeout
from ftstate.transport import auth
from ftstate.transport.signedstore import SignedStore
from ftstate.transport.store import StoreServer, connect_store
from tests.timing import SLACK_S

SECRET = b"k" * 32
KEY = "g/v1/gloo/0/1"

#: The planter: a process with no part in the run writes under a rank's gloo key.
PLANT = r"""
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=10), use_libuv=True)
s.set(sys.argv[3], b"\x02\x00\x00\x00 an address of the planter's own")
"""


@pytest.fixture
def server():
    auth.install("gloo-plant", SECRET)  # this process is a member of the run (it has the secret)
    auth.drain_forged()
    s = StoreServer("127.0.0.1")
    try:
        yield s
    finally:
        s.close()
        auth.uninstall()


def plant(server: StoreServer) -> None:
    subprocess.run([sys.executable, "-c", PLANT, server.address.host, str(server.address.port), KEY],
                   check=True, timeout=60)


def signed_store(server: StoreServer, seconds: float) -> SignedStore:
    return SignedStore(connect_store(server.address, 10.0), deadline=time.monotonic() + seconds,
                       what="gloo rendezvous of group 'g' version 1, rank 0", init_timeout_s=seconds)


def test_a_value_planted_before_the_members_is_refused_and_the_members_is_read(server):
    plant(server)
    reader = signed_store(server, 30.0)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(reader.get(KEY)))
    t.start()
    end = time.monotonic() + 30
    forged: list[dict] = []
    while not forged and time.monotonic() < end:  # the reader has seen the planted value
        forged += auth.drain_forged()
        time.sleep(0.01)
    time.sleep(0.1)  # it keeps reading it meanwhile
    assert got == []  # the planted bytes were not handed to the backend
    signed_store(server, 10.0).set(KEY, b"the genuine rank 1's address")
    t.join(10)
    assert got == [b"the genuine rank 1's address"]
    forged += auth.drain_forged()
    assert [(r["channel"], r["key"], r["problem"]) for r in forged] == [("store", KEY, "tag does not verify")]


def test_a_planted_value_no_member_replaces_ends_the_read_at_the_rendezvous_deadline(server):
    plant(server)
    timeout = 0.5
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=f"store key '{KEY}' was planted") as caught:
        signed_store(server, timeout).get(KEY)
    # the deadline plus scheduling: without it the read waits on the planted value for ever
    assert timeout <= time.monotonic() - t0 < timeout + SLACK_S
    assert caught.value.key == "init_timeout_s"
    assert [r["key"] for r in auth.drain_forged()] == [KEY]


GROUP = r"""
import sys, torch
from ftstate.transport import Receiver, Sender, auth, create_communicator, state_checksum
auth.install("gloo-plant", b"k" * 32)
rank = int(sys.argv[2])
comm = create_communicator("gloo", store_addr=sys.argv[1], group="g", version=1, rank=rank, world_size=2,
                           timeout_s=30.0)
assert type(comm._backend_store).__name__ == "SignedStore"
weights = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
if rank == 0:
    Sender().send_to(comm, 1, weights, weights_version=1, timeout_s=30.0)
    print(state_checksum(weights))
else:
    print(Receiver().receive_from(comm, 0, timeout_s=30.0).state_checksum)
comm.close()
"""


def test_a_gloo_group_formed_through_the_tagged_store_moves_the_weights(server):
    members = [subprocess.Popen([sys.executable, "-c", GROUP, str(server.address), str(r)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    said = [m.communicate(timeout=120) for m in members]
    assert [m.returncode for m in members] == [0, 0], said
    sent, received = (out.strip() for out, _ in said)
    assert sent == received and len(sent) == 16
    # what gloo wrote under its keys carries the run's tag: a plain read gets more than an address
    raw = connect_store(server.address, 10.0).get("g/v1/gloo/0/0")
    assert auth.verify("store g/v1/gloo/0/0", "", 0, "run", raw, record=False) is not None
