"""Choosing the nccl backend where it cannot load.

NCCL needs cupy and a CUDA GPU; this machine has neither, so NCCL itself cannot run here
(its data path is exercised only on a GPU machine). What can be checked here is the
promise that matters on every other machine: asking for nccl without cupy or without a
GPU is a clear BackendUnavailable saying what to install, raised before any rendezvous,
with the underlying error attached, never a silent fallback to gloo. cupy's absence is
forced with a mocked import so the test means the same wherever it runs. Also here: the
NCCL unique id travels through the store as bytes and reaches cupy as its version takes it
(bytes from cupy 14 on, a tuple of C chars in cupy 13), checked against stand-ins of both.
"""

from __future__ import annotations

import sys
import types

import pytest

from ftstate.core.errors import BackendUnavailable, TransportError
from ftstate.transport import create_communicator

ARGS = {"store_addr": "127.0.0.1:1", "group": "weights", "version": 1, "rank": 0, "world_size": 2, "timeout_s": 1.0}


def test_nccl_without_cupy_is_backend_unavailable_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    with pytest.raises(BackendUnavailable, match=r"pip install 'ftstate\[gpu\]'") as info:
        create_communicator("nccl", **ARGS)
    assert isinstance(info.value.__cause__, ImportError)
    assert isinstance(info.value, TransportError)


def test_nccl_with_cupy_but_no_gpu_is_backend_unavailable(monkeypatch):
    class NoDevice(RuntimeError):
        pass

    def no_gpu() -> int:
        raise NoDevice("cudaErrorNoDevice: no CUDA-capable device is detected")

    runtime = types.SimpleNamespace(getDeviceCount=no_gpu)
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = runtime
    cuda.nccl = types.ModuleType("cupy.cuda.nccl")
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", cuda.nccl)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU") as info:
        create_communicator("nccl", **ARGS)
    assert isinstance(info.value.__cause__, NoDevice)


def test_nccl_with_cupy_but_without_the_nccl_library_is_backend_unavailable(monkeypatch):
    """cupy imports ``cupy.cuda.nccl`` even where libnccl cannot be loaded: it only warns and
    sets ``available = False``, and the wrapper has no NcclCommunicator."""
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = runtime
    cuda.nccl = types.ModuleType("cupy.cuda.nccl")
    cuda.nccl.available = False
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", cuda.nccl)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nccl", None)  # its import raises ImportError
    with pytest.raises(BackendUnavailable, match="needs the NCCL library") as info:
        create_communicator("nccl", **ARGS)
    assert isinstance(info.value.__cause__, ImportError)


class _Cupy14Communicator:
    """cupy >= 14: ``NcclCommunicator(ndev, bytes commId, rank)``."""

    def __init__(self, ndev: int, comm_id: object, rank: int) -> None:
        if not isinstance(comm_id, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
        self.comm_id = comm_id


class _Cupy13Communicator:
    """cupy 13: ``NcclCommunicator(ndev, tuple commId, rank)``, each item a C char (signed on
    x86: Cython refuses 128..255 with OverflowError, unsigned: refuses negatives)."""

    signed = True

    def __init__(self, ndev: int, comm_id: object, rank: int) -> None:
        if not isinstance(comm_id, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(comm_id).__name__})")
        lo, hi = (-128, 127) if self.signed else (0, 255)
        if any(not lo <= b <= hi for b in comm_id):
            raise OverflowError("value too large to convert to char")
        self.comm_id = comm_id


class _Cupy13UnsignedChar(_Cupy13Communicator):
    signed = False


@pytest.mark.parametrize("cls", [_Cupy14Communicator, _Cupy13Communicator, _Cupy13UnsignedChar])
def test_the_unique_id_travels_as_bytes_and_reaches_each_cupy_as_it_takes_it(cls):
    from ftstate.transport.nccl import new_communicator, unique_id_bytes

    uid14 = bytes(range(256))[::2]  # 128 bytes, half of them above 127
    uid13 = tuple(b - 256 if b > 127 else b for b in uid14)  # what cupy 13 returns on x86
    assert unique_id_bytes(uid14) == unique_id_bytes(uid13) == uid14
    comm = new_communicator(types.SimpleNamespace(NcclCommunicator=cls), 2, uid14, 0)
    got = comm.comm_id
    assert unique_id_bytes(got) == uid14 and isinstance(got, bytes if cls is _Cupy14Communicator else tuple)


def test_an_unknown_backend_is_refused_not_replaced():
    with pytest.raises(BackendUnavailable, match="unknown transport backend 'mpi'"):
        create_communicator("mpi", **ARGS)  # type: ignore[arg-type]


def test_importing_the_transport_package_is_cheap():
    """``import ftstate.transport`` loads no torch and no backend until a name is used."""
    import subprocess

    code = (
        "import sys, ftstate.transport as t; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'ftstate.transport.gloo' not in sys.modules; "
        "t.state_checksum; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
