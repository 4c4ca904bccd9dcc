"""Choosing the nccl backend where it cannot load.

NCCL needs cupy and a CUDA GPU; this machine has neither, so NCCL itself cannot run here
(its data path is exercised only on a GPU machine). What can be checked here is the
promise that matters on every other machine: asking for nccl without cupy or without a
GPU is a clear BackendUnavailable saying what to install, raised before any rendezvous,
with the underlying error attached, never a silent fallback to gloo. cupy's absence is
forced with a mocked import so the test means the same wherever it runs.
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
