"""Receiver and sender semantics on real gloo groups whose members are threads of this process.

gloo needs no separate processes (its work runs in its own threads, outside the GIL), so
the properties that do not involve a process dying are checked here, fast: buffer
recycling never touches weights the caller still holds, initial weights, odd tensors
(non-contiguous, empty state), resending a committed state, and argument checks.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ftstate.core.errors import ChecksumMismatch, CommunicatorAborted, TransportError
from ftstate.transport import Receiver, Sender, StoreServer, create_communicator, state_checksum
from tests.timing import SLACK_S

BUCKET = 64 * 1024
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def server():
    s = StoreServer("127.0.0.1")
    yield s
    s.close()


def run(*jobs: Callable[[], Any], timeout: float = 30) -> list[Any]:
    """Run the jobs in threads; their results in order, or the first exception raised."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)

    def call(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test below
            errors[i] = exc

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a member hung"
    for e in errors:
        if e is not None:
            raise e
    return results


def form(server: StoreServer, world: int) -> list[Any]:
    version = next(_versions)
    return run(
        *[
            (lambda r=r: create_communicator(
                "gloo", store_addr=server.address, group="threads", version=version, rank=r,
                world_size=world, timeout_s=10,
            ))
            for r in range(world)
        ]
    )


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(200, 100, generator=g),  # 80 KB: chunked
        "b": torch.randn(10, generator=g).to(torch.bfloat16),
        "i": torch.arange(seed, seed + 5),
    }


def sync(comms, sender: Sender, receiver: Receiver, weights, version: int):
    report, got = run(
        lambda: sender.broadcast(comms[0], weights, weights_version=version, timeout_s=10),
        lambda: receiver.receive_broadcast(comms[1], timeout_s=10),
    )
    return report, got


def test_weights_the_caller_still_holds_are_never_overwritten_by_later_syncs(server):
    comms = form(server, 2)
    sender, receiver = Sender(bucket_size=BUCKET), Receiver()
    _, held = sync(comms, sender, receiver, state(1), 1)
    snapshot = {k: v.clone() for k, v in held.tensors.items()}
    for v in range(2, 6):  # enough syncs for any recycling to come round to the held buffer
        _, latest = sync(comms, sender, receiver, state(v), v)
        assert state_checksum(latest.tensors) == state_checksum(state(v))
    assert all(torch.equal(held.tensors[k], snapshot[k]) for k in snapshot)
    assert state_checksum(held.tensors) == held.state_checksum == state_checksum(state(1))


def test_staging_buffers_are_recycled_once_released(server):
    comms = form(server, 2)
    sender, receiver = Sender(bucket_size=BUCKET), Receiver()
    storages = set()
    for v in range(1, 6):
        _, got = sync(comms, sender, receiver, state(v), v)
        storages.add(got._flat.untyped_storage().data_ptr())
        del got
    assert len(storages) <= 2  # the committed buffer and one spare, alternating


def test_a_reserved_staging_buffer_is_the_one_the_next_transfer_fills(server):
    """A spare reserves (and touches) its staging buffer ahead of time; the transfer writes
    into that very buffer, bit-exact; one too small is replaced, not overrun."""
    comms = form(server, 2)
    sender, receiver = Sender(bucket_size=BUCKET), Receiver()
    nbytes = sum(t.numel() * t.element_size() for t in state(1).values())
    receiver.reserve(nbytes + 4096, torch.device("cpu"))
    reserved = receiver._spare[0].untyped_storage().data_ptr()
    _, got = sync(comms, sender, receiver, state(1), 1)
    assert got._flat.untyped_storage().data_ptr() == reserved
    assert state_checksum(got.tensors) == state_checksum(state(1))
    small = Receiver()
    small.reserve(16, torch.device("cpu"))
    too_small = small._spare[0].untyped_storage().data_ptr()
    _, got = sync(comms, sender, small, state(2), 2)
    assert got._flat.untyped_storage().data_ptr() != too_small
    assert state_checksum(got.tensors) == state_checksum(state(2))


def test_the_gaps_of_a_recycled_staging_buffer_are_zeroed_before_a_resend_from_it(server):
    """A recycled buffer holds the last transfer's bytes; the alignment gaps between tensors are
    never sent, so unless they are zeroed a resend from this buffer (to a newcomer) leaks them."""
    comms = form(server, 2)
    sender, receiver = Sender(bucket_size=BUCKET), Receiver()
    # two tensors of buckets of their own, the first ending off alignment: the gap after it is
    # in no bucket, so nothing sent ever overwrites it
    weights = {"a": torch.randn(BUCKET // 4 + 1), "b": torch.randn(BUCKET // 4 + 3), **state(1)}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    receiver.reserve(nbytes + 4096, torch.device("cpu"))
    receiver._spare[0].fill_(0xA5)  # what an earlier transfer left behind
    _, got = sync(comms, sender, receiver, weights, 1)
    end = max(e.end for e in got._entries)
    sent = torch.zeros(end, dtype=torch.bool)
    for e in got._entries:
        sent[e.offset : e.end] = True
    gaps = got._flat[:end][~sent]
    assert gaps.numel() > 0, "the state has no alignment gap: the test proves nothing"
    assert int(gaps.count_nonzero()) == 0, f"{int(gaps.count_nonzero())} stale byte(s) left in the gaps"


class _SlowReserve:
    """The receiver's reserve lock, held 0.5 s longer than the allocation takes (a reserve of a
    large buffer, page-faulting on a busy machine): what the transfer meets right after it."""

    def __init__(self, receiver: Receiver) -> None:
        self.lock, self.receiver, self.reserved = threading.Lock(), receiver, None

    def __enter__(self):
        self.lock.acquire()
        time.sleep(0.5)

    def __exit__(self, *exc):
        if self.receiver._spare is not None:
            self.reserved = self.receiver._spare[0].untyped_storage().data_ptr()
        self.lock.release()

    def acquire(self, timeout: float = -1) -> bool:
        return self.lock.acquire(timeout=timeout)

    def release(self) -> None:
        self.lock.release()


def test_a_transfer_that_arrives_during_its_reserve_fills_the_reserved_buffer(server):
    """A spare promoted while it still reserves its staging buffer: the transfer waits for that
    buffer instead of allocating a second one beside it (both page-faulted at once made the
    first failover after a sync 3-5x slower, issue 28), and lands in it bit-exact."""
    comms = form(server, 2)
    sender, receiver = Sender(bucket_size=BUCKET), Receiver()
    slow = receiver._reserving = _SlowReserve(receiver)
    nbytes = sum(t.numel() * t.element_size() for t in state(1).values())
    reserving = threading.Thread(target=receiver.reserve, args=(nbytes + 4096, torch.device("cpu")))
    reserving.start()
    deadline = time.monotonic() + 5
    while not slow.lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    _, got = sync(comms, sender, receiver, state(1), 1)
    reserving.join(timeout=5)
    assert slow.reserved is not None and got._flat.untyped_storage().data_ptr() == slow.reserved
    assert state_checksum(got.tensors) == state_checksum(state(1))


def test_a_reserve_that_never_ends_is_waited_for_only_until_the_bound(server):
    receiver = Receiver()
    receiver._reserving.acquire()  # a reserve stuck (as if its thread never came back)
    try:
        wait_s = 0.2
        t0 = time.monotonic()
        buf, _ = receiver.staging(4096, torch.device("cpu"), wait_s=wait_s)
        # its own buffer, after the bound (less the timer's grain) plus scheduling; the stuck reserve is for ever
        assert 0.75 * wait_s < time.monotonic() - t0 < wait_s + SLACK_S and buf.numel() >= 4096
    finally:
        receiver._reserving.release()


def test_initial_weights_are_committed_and_kept_on_a_rejected_update(server):
    comms = form(server, 2)
    receiver = Receiver(state(7), weights_version=7)
    assert receiver.committed.state_checksum == state_checksum(state(7))
    before = receiver.committed
    receiver.corrupt_next_bucket()
    with pytest.raises(ChecksumMismatch, match="kept weights version 7"):
        sync(comms, Sender(bucket_size=BUCKET), receiver, state(8), 8)
    assert receiver.committed is before
    with pytest.raises(ValueError, match="weights_version is required"):
        Receiver(state(1))


def test_non_contiguous_tensors_and_an_empty_state_travel(server):
    comms = form(server, 2)
    sender, receiver = Sender(bucket_size=BUCKET), Receiver()
    odd = {"t": torch.randn(300, 70).t(), "s": torch.randn(40)[::3]}
    report, got = sync(comms, sender, receiver, odd, 1)
    assert all(torch.equal(got.tensors[k], odd[k]) for k in odd)
    assert got.state_checksum == state_checksum(odd) == report.state_checksum
    report, got = sync(comms, sender, receiver, {}, 2)
    assert dict(got.tensors) == {} and report.num_buckets == 0 and report.committed == (1,)


def test_a_committed_state_is_resent_from_its_own_buffer_with_its_checksums(server):
    comms = form(server, 3)
    trainer, relay, newcomer = Sender(bucket_size=BUCKET), Receiver(), Receiver()
    _, got = run(
        lambda: trainer.broadcast(comms[0], state(3), weights_version=3, timeout_s=10),
        lambda: relay.receive_broadcast(comms[1], timeout_s=10),
        lambda: newcomer.receive_broadcast(comms[2], timeout_s=10),
    )[:2]
    fresh = Receiver()
    report, again = run(
        lambda: Sender(bucket_size=BUCKET).send_to(comms[1], 2, relay.committed, timeout_s=10),
        lambda: fresh.receive_from(comms[2], 1, timeout_s=10),
    )
    assert report.committed == (2,) and again.weights_version == 3
    assert again.state_checksum == got.state_checksum == state_checksum(state(3))
    # a byte that changed in the relay's memory since it was verified is caught downstream
    relay.committed._flat[relay.committed._entries[0].offset].bitwise_xor_(1)

    def receive_rotten() -> None:
        with pytest.raises(ChecksumMismatch, match="does not match its checksum"):
            fresh.receive_from(comms[2], 1, timeout_s=10)

    report, _ = run(
        lambda: Sender(bucket_size=BUCKET).send_to(comms[1], 2, relay.committed, timeout_s=10),
        receive_rotten,
    )
    assert report.rejected == {2: "ChecksumMismatch"}
    assert fresh.committed is again


def test_arguments_are_checked_before_anything_moves(server):
    comms = form(server, 2)
    with pytest.raises(ValueError, match="weights_version is required"):
        Sender(bucket_size=BUCKET).broadcast(comms[0], state(1), timeout_s=1)
    with pytest.raises(ValueError, match="peer must be another rank"):
        Sender(bucket_size=BUCKET).send_to(comms[0], 0, state(1), weights_version=1, timeout_s=1)
    with pytest.raises(ValueError, match="rank 1 is a receiver, got root 1"):
        Receiver().receive_broadcast(comms[1], root=1, timeout_s=1)
    with pytest.raises(ValueError, match="bucket_size must be"):
        Sender(bucket_size=10)
    for c in comms:
        c.close()
    with pytest.raises(CommunicatorAborted, match="aborted") as info:
        Sender(bucket_size=BUCKET).broadcast(comms[0], state(1), weights_version=1, timeout_s=1)
    assert isinstance(info.value, TransportError)
    assert (info.value.rank, info.value.reason) == (0, "closed")


def test_abandoning_a_version_releases_a_member_blocked_in_it(server):
    """The controller learned a participant failed, but the collective does not fail on the
    others (a peer's death does not always reach a pending gloo operation): abandoning the
    version from another thread ends the wait at once, without touching the backend."""
    import time

    comms = form(server, 2)
    receiver = Receiver()
    abandon_at, timeout = 0.3, 20.0
    threading.Timer(abandon_at, comms[1].abandon, args=("rollout-0 failed: MemberLost",)).start()
    t0 = time.monotonic()
    with pytest.raises(CommunicatorAborted) as info:
        receiver.receive_broadcast(comms[1], timeout_s=timeout)  # rank 0 never sends
    assert abandon_at <= time.monotonic() - t0 < timeout / 2  # ended by the abandonment: a wait lasts timeout out
    assert info.value.reason == "rollout-0 failed: MemberLost" and info.value.rank == 1
    assert receiver.committed is None
    with pytest.raises(CommunicatorAborted):  # the version is never used again
        receiver.receive_broadcast(comms[1], timeout_s=1)
    comms[0].close()


def test_abandoning_a_version_releases_a_member_blocked_in_a_point_to_point_receive(server):
    """The same for a route of several trainer ranks (point to point): a gloo receive cannot
    wait in slices (a timed-out wait closes the group's connections), so abandoning closes
    them: the blocked receive ends at once as the abandonment's echo, not at its own timeout
    (before: the full 20 s, the receiver busy with no progress meanwhile, which the watchdog
    takes for hung)."""
    comms = form(server, 2)
    receiver = Receiver()
    abandon_at, timeout = 0.3, 20.0
    threading.Timer(abandon_at, comms[1].abandon, args=("trainer-1 failed: MemberLost",)).start()
    t0 = time.monotonic()
    with pytest.raises(CommunicatorAborted) as info:
        receiver.receive_from(comms[1], 0, timeout_s=timeout)  # rank 0 never sends
    assert abandon_at <= time.monotonic() - t0 < timeout / 2  # ended by the abandonment: a wait lasts timeout out
    assert info.value.reason == "trainer-1 failed: MemberLost" and info.value.rank == 1
    assert receiver.committed is None
    comms[0].close()


def test_a_peer_that_abandons_releases_the_ranks_waiting_on_it(server):
    """A rank that gives a version up between two buckets leaves its peers waiting on a bucket
    that will never come (or on a receive that will never be posted): its abandonment closes
    its connections, so they fail at once with a PeerLost naming it, not at their timeouts."""
    from ftstate.core.errors import PeerLost

    comms = form(server, 3)
    receiver = Receiver()
    sender = Sender(bucket_size=BUCKET)
    timeout = 20.0
    threading.Timer(0.3, comms[0].abandon, args=("a peer of rank 0 failed",)).start()
    t0 = time.monotonic()
    outcomes = []
    for job in (lambda: receiver.receive_from(comms[1], 0, timeout_s=timeout),   # rank 0 never sends
                lambda: sender.send_to(comms[2], 0, state(1), weights_version=1, timeout_s=timeout)):  # never received
        try:
            run(job)
        except BaseException as exc:  # noqa: BLE001 - what each waiting rank got
            outcomes.append(exc)
    assert time.monotonic() - t0 < timeout / 2  # both ended by the abandonment: a wait lasts timeout out
    assert [type(e) for e in outcomes] == [PeerLost, PeerLost], outcomes
    assert all(e.peer == 0 for e in outcomes), outcomes
    for c in comms[1:]:
        c.close()
