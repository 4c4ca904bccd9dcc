"""Device memory for the same-host route (ftstate.transport.cudaipc), without a GPU.

What runs here: the handle format (the arguments torch's ``reduce_tensor`` gives for a CUDA
tensor, packed as msgpack and unpacked with the reader's own device index in place of the
writer's), its validation, which memory serves which device, and the route's refusal of a
device with none. The CUDA calls themselves (export, open in another process, synchronize)
need a GPU: tests/gpu/test_cuda_ipc.py.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import msgpack
import pytest
import torch

from ftstate.core.errors import ManifestError, SharedMemoryUnavailable
from ftstate.transport import cudaipc
from ftstate.transport.routes import slots


def fake_reduce_args(device: int = 3) -> tuple:
    """What ``reduce_tensor`` returns (after the rebuild function) for a 1 MiB uint8 CUDA tensor
    on ``device``: no CUDA here, so the handles are made-up bytes."""
    return (torch.Tensor, torch.Size([1 << 20]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
            device, b"\x01cudaIpcMemHandle", 2 << 20, 4096, False, b"/torch_ref_counter", 7, b"\x02event", True)


@pytest.fixture(autouse=True)
def defaults():
    yield
    for kind in ("cpu", "cuda", "xpu"):
        cudaipc.uninstall(kind)


class TestHandles:
    def test_the_rebuild_arguments_follow_torchs_rebuild_cuda_tensor(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        names = list(inspect.signature(rebuild_cuda_tensor).parameters)
        assert names[6] == "storage_device"  # the index verl, vLLM and OpenRLHF replace
        assert len(names) == len(fake_reduce_args()) == 6 + len(cudaipc._STORAGE)

    def test_a_handle_is_msgpack_and_opens_on_the_readers_own_device(self):
        handle = cudaipc.pack_rebuild_args(fake_reduce_args(device=3))
        assert isinstance(handle, bytes) and msgpack.unpackb(handle)["kind"] == "cuda-ipc"
        size, stride, offset, device, *rest = cudaipc.unpack_rebuild_args(handle, 0)
        assert (size, stride, offset, device) == ((1 << 20,), (1,), 0, 0)  # the writer's index 3 is gone
        assert rest == [b"\x01cudaIpcMemHandle", 2 << 20, 4096, False, b"/torch_ref_counter", 7, b"\x02event", True]

    def test_an_event_handle_may_be_absent(self):
        args = (*fake_reduce_args()[:13], None, False)
        assert cudaipc.unpack_rebuild_args(cudaipc.pack_rebuild_args(args), 1)[-2:] == (None, False)

    @pytest.mark.parametrize("handle", [
        b"\xc1not msgpack",
        msgpack.packb({"kind": "file", "name": "x"}),
        msgpack.packb({**msgpack.unpackb(cudaipc.pack_rebuild_args(fake_reduce_args())), "handle": "text"}),
        msgpack.packb({**msgpack.unpackb(cudaipc.pack_rebuild_args(fake_reduce_args())), "offset": True}),
        msgpack.packb({**msgpack.unpackb(cudaipc.pack_rebuild_args(fake_reduce_args())), "size": ["1"]}),
        "not bytes",
    ])
    def test_a_malformed_handle_is_a_manifest_error_naming_handles(self, handle):
        with pytest.raises(ManifestError, match="malformed device handle") as info:
            cudaipc.unpack_rebuild_args(handle, 0)
        assert info.value.field == "handles"


    def test_open_calls_torchs_rebuild_with_the_writers_arguments_on_the_readers_device(self, monkeypatch):
        # The CUDA call itself cannot run here: rebuild_cuda_tensor is replaced by a recorder,
        # to check what CudaIpc.open hands it (tests/gpu runs the real one).
        import torch.multiprocessing.reductions as reductions

        calls = []
        monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: calls.append(args) or "opened")
        handle = cudaipc.pack_rebuild_args(fake_reduce_args(device=3))
        assert cudaipc.CudaIpc().open(handle, torch.device("cuda", 2)) == "opened"
        assert calls == [fake_reduce_args(device=2)]  # the writer's device index 3 replaced by 2

    def test_export_refuses_what_it_did_not_allocate(self):
        with pytest.raises(ValueError, match="uint8 CUDA tensors"):
            cudaipc.CudaIpc().export(torch.zeros(4, dtype=torch.uint8))


class TestWhichMemory:
    def test_cuda_gets_cuda_ipc_and_the_host_gets_dev_shm(self):
        assert isinstance(cudaipc.device_memory_for(torch.device("cuda", 1)), cudaipc.CudaIpc)
        assert cudaipc.device_memory_for(torch.device("cpu")) is None
        assert isinstance(cudaipc.CudaIpc(), cudaipc.DeviceMemory)

    def test_an_installed_memory_replaces_the_default_until_uninstalled(self):
        standin = object()
        cudaipc.install("cpu", standin)  # type: ignore[arg-type]
        assert cudaipc.device_memory_for(torch.device("cpu")) is standin
        cudaipc.uninstall("cpu")
        assert cudaipc.device_memory_for(torch.device("cpu")) is None

    @pytest.mark.parametrize("device", [torch.device("cuda", 0), torch.device("xpu", 0)])
    def test_a_device_without_memory_others_can_map_is_shared_memory_unavailable(self, device):
        cudaipc.install("cuda", None)  # as if CUDA IPC were refused on this host
        comm = SimpleNamespace(device=device)
        with pytest.raises(SharedMemoryUnavailable, match=f"no device memory other processes can map is known "
                                                          f"for '{device.type}'"):
            slots.slot_memory(comm, 1024)  # type: ignore[arg-type]

    def test_a_relay_on_a_device_cannot_make_its_slots(self):
        comm = SimpleNamespace(device=torch.device("cuda", 0))
        with pytest.raises(SharedMemoryUnavailable, match="these slots hold host memory"):
            slots.require_host_memory(comm, 1024)  # type: ignore[arg-type]

    def test_the_host_takes_slots_in_dev_shm(self):
        comm = SimpleNamespace(device=torch.device("cpu"))
        assert slots.slot_memory(comm, 1024) is None  # type: ignore[arg-type]
