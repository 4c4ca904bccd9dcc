"""The nccl backend (``ftstate.transport.nccl``) through the real ``cupy.cuda.nccl``, on one GPU.

Skipped where ``torch.cuda.is_available()`` is false or cupy cannot be imported (this project's
CPU machines: there tests/integration/test_transport_nccl.py checks, with cupy mocked, that
asking for nccl without cupy or a GPU is a BackendUnavailable). NCCL refuses two ranks on one
GPU, so what one GPU can check is a world of one, through the project's own code path:

* asking for ``nccl`` where cupy imports is no BackendUnavailable: ``create_communicator``
  forms the communicator, rank 0's NCCL unique id having gone through the versioned store
  (``{group}/v{N}/nccl/unique_id``, msgpack bytes, signed when the run authenticates: cupy 14,
  the GPU machine's, takes the id as bytes where cupy 13 took a tuple of C chars);
* the primitives on real CUDA tensors (broadcast, allgather, barrier) on the backend's own
  stream, awaited through its event polling;
* the transfer code (``Sender.broadcast``: manifest, buckets, seal, commit vote, with the
  buckets hashed off the device) sends a mixed state of CUDA tensors, chunked across buckets,
  and its checksum is the host state's, with the run's authentication off and on;
* an aborted communicator (``ncclCommAbort``) refuses further work, typed, and a new group
  version formed after it works; a version fenced by a newer one refuses to send;
* an NCCL initialisation that never completes (a member registered in the store but never
  called ``ncclCommInitRank``) ends as a RendezvousTimeout at ``init_timeout_s``, in a process
  of its own (the helper thread stays blocked in NCCL until that process exits).

What this file does **not** prove: that NCCL moves a byte between ranks. At a world of one a
broadcast is a no-op on the root's own buffer and nobody receives, votes or commits, so the
names below say "at world one" and the transfer test checks the sender's side only (manifest,
bucketing, hashing off the device, the vote with nobody). The transfer claims between processes
on one GPU are carried by ``test_cuda_ipc.py`` (two reader processes get the state bit-exact
through CUDA IPC slots; a sender killed mid-bucket commits nothing). What two ranks would need:
two GPUs (NCCL refuses two ranks on one device), then the same tests at world 2 with a receiver
per rank: a broadcast received bit-exact, a damaged bucket refused by the receiver's checksum,
a peer killed mid-transfer ending the version on both sides (docs/benchmarks.md says the same).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import time

import pytest
import torch


def _missing() -> str | None:
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (none on this machine)")
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a cupy for another CUDA failing at import
        missing.append(f"cupy (pip install 'ftstate[gpu]'; here: {type(exc).__name__}: {exc})")
    return "needs " + " and ".join(missing) if missing else None


_REASON = _missing()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

BACKEND = "nccl"
INIT_S = 60.0
SYNC_S = 60.0
MiB = 1 << 20
_groups = itertools.count(1)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


@pytest.fixture(scope="module")
def store():
    from ftstate.transport import StoreServer

    server = StoreServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def group() -> str:
    return f"nccl1-{os.getpid()}-{next(_groups)}"


def form(store, group: str, version: int, *, timeout_s: float = INIT_S):
    from ftstate.transport import create_communicator

    return create_communicator(BACKEND, store_addr=store.address, group=group, version=version, rank=0,
                               world_size=1, timeout_s=timeout_s)


def state_on(device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The transport tests' mixed state (float32, bf16, int64, bool, 0-dim, empty, chunked
    tensors) and a 3 MiB bf16 tensor, on ``device``."""
    from tests.integration._transport_workers import make_state

    state = make_state(seed)
    g = torch.Generator().manual_seed(seed)
    state["layers.2.mlp.bf16"] = torch.randn(3 * MiB // 2, generator=g).to(torch.bfloat16)
    return {n: t.to(device) for n, t in state.items()}


def host_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in state.items()}


def test_asking_for_nccl_where_cupy_imports_forms_a_communicator_through_the_store(store, group):
    import msgpack

    from ftstate.transport.nccl import NcclCommunicator, load_nccl
    from ftstate.transport.store import version_prefix

    nccl = load_nccl()  # BackendUnavailable here would mean cupy imports but cannot serve
    assert getattr(nccl, "available", True), "cupy imported cupy.cuda.nccl without the NCCL library"
    print(f"NCCL {nccl.get_version()} through cupy")
    comm = form(store, group, 1)
    try:
        assert isinstance(comm, NcclCommunicator) and comm.backend == "nccl"
        assert (comm.rank, comm.world_size, comm.version) == (0, 1, 1)
        assert comm.device == torch.device("cuda", torch.cuda.current_device())
        key = f"{version_prefix(group, 1)}/nccl/unique_id"
        raw = store.store.get(key)
        uid = msgpack.unpackb(raw)
        assert isinstance(uid, bytes) and len(uid) == 128, (len(raw), raw[:40])  # NCCL_UNIQUE_ID_BYTES
        assert store.current_version(group) == 1 and store.arrived(group, 1) == [0]
        comm.check_usable()
    finally:
        comm.close()
    assert comm.aborted


def test_the_primitives_run_on_real_cuda_tensors_at_world_one_where_a_broadcast_moves_no_bytes(store, group):
    comm = form(store, group, 1)
    try:
        dev = comm.device
        t = torch.arange(5 * MiB, device=dev, dtype=torch.int32)
        want = t.clone()
        comm.broadcast(t, 0).wait()
        assert torch.equal(t, want)
        rows = comm.allgather(torch.tensor([7, 8, 9], dtype=torch.int64))
        assert len(rows) == 1 and rows[0].device.type == "cpu" and rows[0].tolist() == [7, 8, 9]
        comm.barrier()
        assert comm.current_version() == 1
    finally:
        comm.close()


@pytest.mark.parametrize("authenticated", [False, True], ids=["plain", "authenticated"])
def test_the_senders_side_of_a_transfer_of_cuda_tensors_at_world_one(store, group, authenticated):
    from ftstate.transport import Sender, auth, state_checksum

    if authenticated:
        auth.install(f"nccl-one-gpu-{group}", auth.new_secret())
    try:
        comm = form(store, group, 1)
        try:
            state = state_on(comm.device, seed=1)
            before = host_copy(state)
            sender = Sender(bucket_size=1 * MiB)
            report = sender.broadcast(comm, state, weights_version=7, timeout_s=SYNC_S)
            assert report.ok and report.committed == () and report.rejected == {}  # nobody else to commit
            assert report.weights_version == 7 and report.group_version == 1
            assert report.num_buckets >= 4, report
            assert report.state_checksum == state_checksum(before)  # hashed off the device, bit for bit
            assert all(torch.equal(t.cpu(), before[n]) for n, t in state.items()), "the sender's tensors changed"
            # the same sender again (its packing buffers kept), a new version of the weights
            state2 = state_on(comm.device, seed=2)
            again = sender.broadcast(comm, state2, weights_version=8, timeout_s=SYNC_S)
            assert again.state_checksum == state_checksum(host_copy(state2)) != report.state_checksum
            assert not comm.aborted
        finally:
            comm.close()
    finally:
        if authenticated:
            assert auth.drain_forged() == []
            auth.uninstall()


def test_an_aborted_communicator_refuses_work_and_a_new_version_forms_after_it(store, group):
    from ftstate.core.errors import CommunicatorAborted, TransportError
    from ftstate.transport import Sender

    v1 = form(store, group, 1)
    dev = v1.device
    v1.broadcast(torch.ones(1024, device=dev), 0).wait()
    v1.abort("a peer was lost (test)")  # ncclCommAbort, never destroy
    v1.abort("again")  # idempotent
    assert v1.aborted
    with pytest.raises(TransportError, match="aborted"):
        v1.broadcast(torch.ones(1024, device=dev), 0)
    with pytest.raises(CommunicatorAborted):
        v1.check_usable()
    with pytest.raises(CommunicatorAborted):
        Sender(bucket_size=1 * MiB).broadcast(v1, state_on(dev, seed=3), weights_version=1, timeout_s=SYNC_S)

    t0 = time.monotonic()
    v2 = form(store, group, 2)
    formed_s = time.monotonic() - t0
    try:
        assert store.current_version(group) == 2 and v2.version == 2
        t = torch.full((2 * MiB,), 3.0, device=dev)
        v2.broadcast(t, 0).wait()
        assert bool((t == 3.0).all())
        state = state_on(dev, seed=4)
        report = Sender(bucket_size=1 * MiB).broadcast(v2, state, weights_version=2, timeout_s=SYNC_S)
        assert report.ok and report.group_version == 2
        print(f"version 2 formed {formed_s:.3f} s after version 1 was aborted")
    finally:
        v2.close()


def test_a_version_fenced_by_a_newer_one_refuses_to_send(store, group):
    from ftstate.core.errors import StaleGroupVersion
    from ftstate.transport import Sender

    v1 = form(store, group, 1)
    try:
        store.fence(group, 2)  # the controller abandoned v1 (a member died): v2 is the group's now
        with pytest.raises(StaleGroupVersion):
            v1.check_usable()
        with pytest.raises(StaleGroupVersion):
            Sender(bucket_size=1 * MiB).broadcast(v1, state_on(v1.device, seed=5), weights_version=1,
                                                  timeout_s=SYNC_S)
        with pytest.raises(StaleGroupVersion):
            form(store, group, 1)  # nobody can join v1 any more
    finally:
        v1.abort("fenced")
    v2 = form(store, group, 2)
    try:
        v2.check_usable()
        v2.barrier()
    finally:
        v2.close()


def _init_never_completes(addr: str, group: str, timeout_s: float, conn) -> None:
    """Another process: rank 1 registers in the store but never initialises NCCL; rank 0's
    ``create_communicator`` must end in ``timeout_s`` with a RendezvousTimeout."""
    import threading

    from ftstate.transport import create_communicator
    from ftstate.transport.store import connect_store, join_version

    result: dict = {}
    try:
        peer = threading.Thread(target=join_version, daemon=True,
                                args=(connect_store(addr, 30), group, 1, 1, 2, 30))
        peer.start()
        t0 = time.monotonic()
        try:
            create_communicator("nccl", store_addr=addr, group=group, version=1, rank=0, world_size=2,
                                timeout_s=timeout_s)
            result = {"error": None}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = {"error": type(exc).__name__, "message": str(exc),
                      "key": getattr(exc, "key", None), "seconds": getattr(exc, "seconds", None)}
        result["elapsed"] = time.monotonic() - t0
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"setup: {type(exc).__name__}", "message": str(exc)}
    conn.send(result)
    conn.close()
    os._exit(0)  # its helper thread is still blocked in ncclCommInitRank: leave without joining it


def test_an_nccl_init_that_never_completes_is_a_rendezvous_timeout(store, group):
    timeout_s = 8.0
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_init_never_completes, args=(str(store.address), group, timeout_s, child),
                       daemon=True)
    proc.start()
    try:
        assert conn.poll(90), "the process neither returned nor raised within 90 s"
        got = conn.recv()
    finally:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    print(f"NCCL init left hanging: {got}")
    assert got["error"] == "RendezvousTimeout", got
    assert "NCCL communicator initialisation" in got["message"], got
    assert got["key"] == "init_timeout_s" and got["seconds"] == timeout_s
    assert timeout_s - 1 <= got["elapsed"] <= timeout_s + 10, got
