"""The same-host route's device slots with real CUDA IPC between processes on one GPU.

Skipped where ``torch.cuda.is_available()`` is false (this project's CPU machines): it is
what a lent GPU runs. tests/integration/test_transport_cudaipc.py runs the same transfer on
CPU with a stand-in for GPU memory; this file checks what the stand-in cannot: that
:class:`~ftstate.transport.cudaipc.CudaIpc` exports a CUDA allocation, that another process
opens it on its own device index and sees (and writes) the same bytes once synchronized, and
that the full transfer (sender + 2 readers, gloo for the manifest, seal and vote, the slots on
``cuda:0``) is bit-exact, reuses its slots and survives a SIGKILLed sender with nothing committed.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: CUDA IPC between two processes on one GPU (none on this machine)",
)

CUDA_HOST = "tests.gpu._cuda_host:CudaForHostWeights"


def _reader(conn) -> None:
    """Another process: open the handle on its own device, check the writer's bytes, write its own."""
    from ftstate.transport.cudaipc import CudaIpc

    memory = CudaIpc()
    handle, nbytes = conn.recv()
    t = memory.open(handle, torch.device("cuda", 0))
    want = (torch.arange(nbytes, device=t.device) % 251).to(torch.uint8)
    ok = t.numel() >= nbytes and bool(torch.equal(t[:nbytes], want))
    t[:nbytes].copy_((torch.arange(nbytes, device=t.device) % 13).to(torch.uint8))
    memory.synchronize(t.device)
    memory.release(t)
    del t
    conn.send(ok)
    conn.recv()  # the writer has checked: the reader may go


def test_another_process_opens_the_allocation_and_sees_the_same_bytes():
    from ftstate.transport.cudaipc import CudaIpc

    memory = CudaIpc()
    nbytes = 3 << 20
    gpu = torch.device("cuda", 0)
    t = memory.alloc(nbytes, gpu)
    t.copy_((torch.arange(nbytes, device=gpu) % 251).to(torch.uint8))
    memory.synchronize(gpu)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,), daemon=True)
    proc.start()
    try:
        conn.send((memory.export(t), nbytes))
        assert conn.poll(60) and conn.recv() is True, "the reader saw other bytes than the writer's"
        assert torch.equal(t, (torch.arange(nbytes, device=gpu) % 13).to(torch.uint8))  # and wrote into ours
        conn.send("done")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    memory.release(t)


@pytest.fixture(scope="module")
def pool():
    from tests.integration._transport_workers import Pool

    p = Pool(size=3)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def group(pool):
    pool.heal()
    for w in pool.members:
        w.call("install_device_memory", device_type="cpu", factory=CUDA_HOST, timeout=60)
    pool.form()
    pool.members[0].call("load", seed=1, weights_version=1)
    return pool


def test_two_readers_get_the_state_bit_exact_through_cuda_ipc_slots_and_reuse_them(group):
    from tests.integration.test_transport_shm import (
        assert_bit_exact,
        committed_checksum,
        expected_checksum,
        our_segments,
        planned,
    )

    report = planned(group, [1, 2], timeout_s=60)
    assert report["routes"] == {1: "shm", 2: "shm"} and report["shm_fallback"] is None, report
    assert report["committed"] == [1, 2] and report["rejected"] == {}
    for rollout in group.members[1:]:
        assert_bit_exact(rollout, 1)
        assert committed_checksum(rollout) == expected_checksum(1) == report["checksum"]
    group.members[0].call("load", seed=2, weights_version=2)
    assert planned(group, [1, 2], timeout_s=60)["committed"] == [1, 2]
    for rollout in group.members[1:]:
        assert_bit_exact(rollout, 2)
    assert our_segments(group) == []


def test_a_sender_killed_mid_bucket_leaves_nothing_committed(group):
    from tests.integration._transport_workers import RemoteError
    from tests.integration.test_transport_shm import (
        committed_checksum,
        expected_checksum,
        our_segments,
        planned,
    )

    planned(group, [1, 2], timeout_s=60)
    trainer, *rollouts = group.members
    trainer.call("load", seed=3, weights_version=2)
    for r in rollouts:
        r.start("receive_planned", timeout_s=30)
    t0 = time.monotonic()
    trainer.start("broadcast_planned", timeout_s=30, same_host=[1, 2], kill_at=3)
    assert trainer.outcome(60)[0] == "died"
    for r in rollouts:
        with pytest.raises(RemoteError) as info:
            r.result(30)
        assert info.value.isinstance("PeerLost") and info.value.info["peer"] == 0, info.value.info
        assert committed_checksum(r) == expected_checksum(1)
    assert time.monotonic() - t0 < 30
    assert our_segments(group) == []


def test_the_route_proves_the_sync_with_nh64_through_cuda_ipc_slots(group):
    # The members' weights are host tensors here (the group is gloo on ``cpu``), counted as device
    # memory for the choice of function, so the whole route runs with nh64 over real CUDA IPC
    # slots; hashing on the GPU itself, across two processes, is benchmarks/device_sync.py's check.
    from tests.integration.test_transport_cudaipc import nh64_checksum, planned_with_readers
    from tests.integration.test_transport_shm import assert_bit_exact, committed_checksum

    for w in group.members:
        w.call("use_device_digest", on=True)
    try:
        report, got = planned_with_readers(group, [1, 2])
        assert report["committed"] == [1, 2] and report["checksum"] == nh64_checksum(1)
        assert report["host_bytes"] == 0 and [g["host_bytes"] for g in got] == [0, 0]
        for rollout in group.members[1:]:
            assert_bit_exact(rollout, 1)
            assert committed_checksum(rollout) == nh64_checksum(1)
    finally:
        for w in group.members:
            w.call("use_device_digest", on=False)
