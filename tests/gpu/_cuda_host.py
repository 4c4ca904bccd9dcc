"""CUDA IPC for a gloo group on one GPU, for tests/gpu/test_cuda_ipc.py (imported by its workers).

NCCL refuses two ranks on one GPU, so the GPU test's members form a gloo group (device
``cpu``) and install this as the ``cpu`` device's memory: the route's slots are then real
CUDA allocations on ``cuda:0``, exported and opened with :class:`~ftstate.transport.cudaipc.CudaIpc`
(only the device is fixed to ``cuda:0``), and its copies go host -> GPU slot -> host.
"""

from __future__ import annotations

import torch

from ftstate.transport.cudaipc import CudaIpc

GPU = torch.device("cuda", 0)


class CudaForHostWeights(CudaIpc):
    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return super().alloc(nbytes, GPU)

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        return super().open(handle, GPU)

    def synchronize(self, device: torch.device) -> None:
        super().synchronize(GPU)
