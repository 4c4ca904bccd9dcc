"""The nccl backend: NCCL through cupy's ``cupy.cuda.nccl``, one communicator per group version."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from ftstate.core.errors import BackendUnavailable, ManifestError, RendezvousTimeout, TransportError
from ftstate.transport import auth
from ftstate.transport.base import Communicator, Pending
from ftstate.transport.store import (
    StoreAddress,
    connect_store,
    join_version,
    read_current_version,
    version_prefix,
)

if TYPE_CHECKING:
    from torch.distributed import Store

_INSTALL = "install the GPU extra: pip install 'ftstate[gpu]' (cupy for your CUDA version, e.g. cupy-cuda12x)"
_POLL_S = 0.0002


def load_nccl() -> Any:
    """Import ``cupy.cuda.nccl`` and check a GPU is visible; :class:`BackendUnavailable` otherwise."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailable(f"the nccl backend needs cupy, which cannot be imported here ({exc}); {_INSTALL}") from exc
    if not getattr(nccl, "available", True):
        # cupy imports its NCCL wrapper even where the NCCL library cannot be loaded (it only
        # warns and sets ``available = False``): the wrapper then has no NcclCommunicator.
        missing = "the nccl backend needs the NCCL library, which cupy cannot load here"
        fix = "install the NCCL wheel for cupy's CUDA version (e.g. nvidia-nccl-cu12)"
        try:
            import cupy_backends.cuda.libs.nccl  # noqa: F401 - raises the ImportError naming the library
        except ImportError as exc:
            raise BackendUnavailable(f"{missing} ({exc}); {fix}") from exc
        raise BackendUnavailable(f"{missing} (cupy.cuda.nccl.available is False); {fix}")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError when no driver/GPU is present
        raise BackendUnavailable(f"the nccl backend needs a CUDA GPU, and none is usable here ({exc})") from exc
    if count < 1:
        raise BackendUnavailable("the nccl backend needs a CUDA GPU, and none is visible here")
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "the nccl backend moves torch CUDA tensors, but this torch build has no CUDA "
            "(install a CUDA build of torch)"
        )
    return nccl


def unique_id_bytes(uid: Any) -> bytes:
    """The NCCL unique id as plain bytes, as it travels through the store: cupy >= 14 returns
    bytes, cupy 13 a tuple of C ``char`` values (negative where ``char`` is signed)."""
    return bytes(b & 0xFF for b in uid)


def new_communicator(nccl: Any, world_size: int, uid: bytes, rank: int) -> Any:
    """``nccl.NcclCommunicator(world_size, id, rank)`` (``ncclCommInitRank``: blocks until every
    rank called it), with the id as this cupy takes it: bytes (cupy >= 14), or a tuple of C
    ``char`` values (cupy 13: signed on x86, unsigned on Arm). Either refusal (TypeError, then
    OverflowError) comes from converting the argument, before NCCL is called."""
    try:
        return nccl.NcclCommunicator(world_size, uid, rank)
    except TypeError:
        pass
    try:
        return nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in uid), rank)
    except OverflowError:
        return nccl.NcclCommunicator(world_size, tuple(uid), rank)


class _NcclPending(Pending):
    __slots__ = ("_comm", "_deadline", "_event", "_op", "_timeout_s")

    def __init__(self, comm: NcclCommunicator, event: torch.cuda.Event, op: str, timeout_s: float) -> None:
        self._comm = comm
        self._event = event
        self._op = op
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def wait(self) -> None:
        event, self._event = self._event, None
        if event is None:
            return
        while not event.query():
            try:
                self._comm._check_async_error()
            except Exception as exc:
                raise self._comm.translate(exc, self._op, self._timeout_s) from exc
            if time.monotonic() > self._deadline:
                raise self._comm.translate(TimeoutError("timed out"), self._op, self._timeout_s)
            time.sleep(_POLL_S)


class NcclCommunicator(Communicator):
    """A formed NCCL group version. Build with :meth:`join` (or ``create_communicator("nccl", ...)``)."""

    backend = "nccl"

    def __init__(
        self, *, nccl: Any, comm: Any, store: Store, group: str, version: int, rank: int, world_size: int,
        timeout_s: float, device: torch.device,
    ) -> None:
        super().__init__()
        self._nccl = nccl
        self._comm = comm
        self._store = store
        self.group = group
        self.version = version
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def join(
        cls,
        *,
        store_addr: StoreAddress | str | tuple[str, int],
        group: str,
        version: int,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> NcclCommunicator:
        """Rendezvous and initialise NCCL on the current CUDA device."""
        nccl = load_nccl()
        deadline = time.monotonic() + timeout_s
        device = torch.device("cuda", torch.cuda.current_device())
        store = connect_store(store_addr, timeout_s)
        join_version(store, group, version, rank, world_size, timeout_s)
        key = f"{version_prefix(group, version)}/nccl/unique_id"
        if rank == 0:
            store.set(key, auth.sign(f"store {key}", "", 0, "run", msgpack.packb(unique_id_bytes(nccl.get_unique_id()))))
        remaining = deadline - time.monotonic()

        def timeout(what: str, exc: BaseException | None = None) -> RendezvousTimeout:
            err = RendezvousTimeout(
                f"{what} of group {group!r} version {version}", key="init_timeout_s", seconds=timeout_s,
                member=f"rank {rank}", group_version=version,
            )
            err.__cause__ = exc
            return err

        import datetime

        try:
            store.wait([key], datetime.timedelta(seconds=max(remaining, 0.001)))
        except RuntimeError as exc:
            raise timeout("NCCL unique id exchange (rank 0 did not publish it)", exc) from exc
        raw = store.get(key)
        opened = auth.verify(f"store {key}", "", 0, "run", raw, record_as="store", key=key)  # a forgery is recorded there
        try:
            if opened is None:
                raise ValueError("its tag does not verify")
            uid = msgpack.unpackb(opened)
            # NCCL's id is 128 bytes; bounded, whatever the build says
            if not isinstance(uid, bytes) or not 0 < len(uid) <= 1024:
                raise ValueError("not the id's bytes")
        except Exception as exc:  # a planted or truncated value: typed, naming the key
            raise ManifestError(f"store value {key!r}: expected the NCCL unique id (bytes), got "
                                f"{raw[:40]!r}", field=key, peer=f"store key {key}") from exc
        box: dict[str, Any] = {}

        def init() -> None:
            try:
                import cupy

                with cupy.cuda.Device(device.index):
                    box["comm"] = new_communicator(nccl, world_size, uid, rank)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread and re-raised there
                box["error"] = exc

        worker = threading.Thread(target=init, name=f"ftstate-nccl-init-{group}-v{version}", daemon=True)
        worker.start()
        worker.join(max(deadline - time.monotonic(), 0.001))
        if worker.is_alive():
            raise timeout("NCCL communicator initialisation (a member registered but never initialised)")
        if "error" in box:
            raise TransportError(f"rank {rank}: NCCL initialisation of group {group!r} v{version} failed: {box['error']}") from box["error"]
        return cls(
            nccl=nccl, comm=box["comm"], store=store, group=group, version=version, rank=rank,
            world_size=world_size, timeout_s=timeout_s, device=device,
        )

    # -- primitives -------------------------------------------------------------------

    def _live(self, op: str) -> Any:
        if self._comm is None or self._abort_reason is not None:
            raise TransportError(
                f"{self.member}: cannot {op}: communicator was aborted ({self._abort_reason}); form a new group version"
            )
        return self._comm

    def _check_async_error(self) -> None:
        if self._comm is not None:
            self._comm.check_async_error()

    def _enqueue(self, op: str, timeout_s: float | None, launch: Any, *tensors: torch.Tensor) -> _NcclPending:
        t = self.timeout_s if timeout_s is None else timeout_s
        comm = self._live(op)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(self._stream):
                launch(comm, self._stream.cuda_stream)
                for x in tensors:
                    x.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)
        except Exception as exc:
            raise self.translate(exc, op, t) from exc
        return _NcclPending(self, event, op, t)

    def broadcast(self, tensor: torch.Tensor, root: int, *, timeout_s: float | None = None) -> Pending:
        n = self._nccl
        return self._enqueue(
            f"broadcast from rank {root}", timeout_s,
            lambda c, s: c.bcast(tensor.data_ptr(), tensor.numel() * tensor.element_size(), n.NCCL_UINT8, root, s),
            tensor,
        )

    def send(self, tensor: torch.Tensor, peer: int, *, tag: int, timeout_s: float | None = None) -> Pending:
        n = self._nccl  # NCCL orders point-to-point messages per peer; the tag is not needed
        return self._enqueue(
            f"send to rank {peer}", timeout_s,
            lambda c, s: c.send(tensor.data_ptr(), tensor.numel() * tensor.element_size(), n.NCCL_UINT8, peer, s),
            tensor,
        )

    def recv(self, tensor: torch.Tensor, peer: int, *, tag: int, timeout_s: float | None = None) -> Pending:
        n = self._nccl
        return self._enqueue(
            f"receive from rank {peer}", timeout_s,
            lambda c, s: c.recv(tensor.data_ptr(), tensor.numel() * tensor.element_size(), n.NCCL_UINT8, peer, s),
            tensor,
        )

    def allgather(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> list[torch.Tensor]:
        n = self._nccl
        src = tensor.to(self._device).contiguous()
        out = torch.empty((self.world_size, *src.shape), dtype=src.dtype, device=self._device)
        nbytes = src.numel() * src.element_size()
        self._enqueue(
            "allgather", timeout_s,
            lambda c, s: c.allGather(src.data_ptr(), out.data_ptr(), nbytes, n.NCCL_UINT8, s),
            src, out,
        ).wait()
        return [row.to(tensor.device) for row in out]

    def barrier(self, *, timeout_s: float | None = None) -> None:
        self.allgather(torch.zeros(1, dtype=torch.int64), timeout_s=timeout_s)

    def current_version(self) -> int:
        current = read_current_version(self._store, self.group)
        return self.version if current is None else current

    def _abort_backend(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()


__all__ = ["NcclCommunicator", "load_nccl", "new_communicator", "unique_id_bytes"]
