"""The backend factory: join a group version with the backend a config names."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ftstate.core.errors import BackendUnavailable
from ftstate.transport.base import Backend, Communicator
from ftstate.transport.store import StoreAddress

#: The backends :func:`create_communicator` knows, by the name the config uses.
BACKENDS = ("gloo", "nccl")


def create_communicator(
    backend: Backend,
    *,
    store_addr: StoreAddress | str | tuple[str, int],
    group: str,
    version: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    device_host: str = "127.0.0.1",
) -> Communicator:
    """Join version ``version`` of group ``group`` as ``rank`` of ``world_size`` and return its communicator.

    ``timeout_s`` (``init_timeout_s``) bounds the whole rendezvous, else RendezvousTimeout naming
    the missing rank, and is the default bound of later primitives. ``device_host``: the address
    gloo binds. Raises BackendUnavailable for a backend that cannot load here, never falling back.
    """
    join: Callable[..., Communicator]
    if backend == "gloo":
        from ftstate.transport.gloo import GlooCommunicator

        join = functools.partial(GlooCommunicator.join, device_host=device_host)
    elif backend == "nccl":
        from ftstate.transport.nccl import NcclCommunicator

        join = NcclCommunicator.join
    else:
        raise BackendUnavailable(f"unknown transport backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return join(store_addr=store_addr, group=group, version=version, rank=rank, world_size=world_size,
                timeout_s=timeout_s)


__all__ = ["BACKENDS", "create_communicator"]
