"""A stand-in for GPU memory, for the tests of the same-host route's device slots.

This machine has no GPU, so :class:`HostStandIn` takes the place of GPU memory (and of
:class:`~ftstate.transport.cudaipc.CudaIpc`) behind the same
:class:`~ftstate.transport.cudaipc.DeviceMemory` interface: its memory is a named
``/dev/shm`` file, its handle is that file's name, and another process "opens" the handle by
mapping the file. Installed as the device memory of the ``cpu`` device in every member
process, it makes the route take its device-slot path (export, open in another process,
copy, synchronize, hash, release) on CPU. Mocked is only what cannot run here: the CUDA
calls, which tests/gpu/test_cuda_ipc.py runs on a GPU.

Its files are named like ftstate's segments (``ftstate-devmem-v0-p<pid>-g<n>-s0``), so a
test that looks for anything a member left in ``/dev/shm`` sees them, and so
:func:`~ftstate.transport.shm.sweep_orphans` removes those of a SIGKILLed writer, as the
route's cleanup does for its own segments. A real CUDA allocation names nothing and goes
with its process.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from ftstate.core.errors import ManifestError
from ftstate.transport import shm


class HostStandIn:
    """:class:`~ftstate.transport.cudaipc.DeviceMemory` over named ``/dev/shm`` files (tests only).

    ``tamper_next``: the next :meth:`synchronize` flips the first byte of every slot this
    process allocated, as a damaged device slot would be, after the writer's copy and before
    it announces the bucket."""

    def __init__(self) -> None:
        self._generation = itertools.count(1)
        self._owned: dict[int, tuple[str, torch.Tensor]] = {}  # data_ptr -> (file name, tensor) allocated here
        self.tamper_next = False
        self.counts = {"alloc": 0, "export": 0, "open": 0, "unlink": 0, "synchronize": 0, "release": 0}

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        assert device.type == "cpu", device
        self.counts["alloc"] += 1
        name = shm.segment_name("devmem", 0, os.getpid(), next(self._generation), 0)
        path = shm.SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        finally:
            os.close(fd)
        t = torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        self._owned[t.data_ptr()] = (name, t)
        return t

    def export(self, t: torch.Tensor) -> bytes:
        self.counts["export"] += 1
        return self._owned[t.data_ptr()][0].encode()

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        self.counts["open"] += 1
        name = handle.decode(errors="replace")
        if shm.parse_name(name) is None:
            raise ManifestError(f"malformed device handle: {handle!r:.60}", field="handles")
        path = shm.SHM_DIR / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ManifestError(f"device handle {name!r}: {exc.strerror}", field="handles") from exc
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def unlink(self, t: torch.Tensor) -> None:
        self.counts["unlink"] += 1
        if t.data_ptr() in self._owned:
            shm.unlink_names([self._owned[t.data_ptr()][0]])

    def synchronize(self, device: torch.device) -> None:
        self.counts["synchronize"] += 1
        if self.tamper_next and self._owned:
            self.tamper_next = False
            for _name, t in self._owned.values():
                t[:1].bitwise_xor_(0xFF)

    def release(self, t: torch.Tensor) -> None:
        self.counts["release"] += 1
        owned = self._owned.pop(t.data_ptr(), None)
        if owned is not None:
            shm.unlink_names([owned[0]])

    def stats(self) -> dict[str, Any]:
        return dict(self.counts)


class NoRoomStandIn(HostStandIn):
    """A stand-in whose memory is full: every allocation fails as ``torch.cuda.OutOfMemoryError``
    (a RuntimeError) would."""

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.counts["alloc"] += 1
        raise RuntimeError(f"out of memory (stand-in): tried to allocate {nbytes} bytes")
