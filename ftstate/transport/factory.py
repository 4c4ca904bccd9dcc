"""The backend factory: join a group version with the backend a config names.

Kept apart from :mod:`ftstate.transport.base` so that the interface never imports its own
implementations: each backend module imports the base, and only this module knows them
all. Backends are imported when chosen, so asking for ``gloo`` never loads cupy and asking
for ``nccl`` where cupy or a GPU is missing is a :class:`~ftstate.core.errors.BackendUnavailable`,
never a silent fallback.
"""

from __future__ import annotations

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

    ``store_addr``: the controller's :class:`~ftstate.transport.store.StoreServer`
    (``StoreAddress``, ``"host:port"`` or ``(host, port)``).
    ``timeout_s``: the group's ``init_timeout_s``: bounds the whole rendezvous (every
    rank registered, the backend connected, the first barrier passed) and is the default
    bound of each later primitive. A rank that does not arrive in time makes every
    member that did raise :class:`~ftstate.core.errors.RendezvousTimeout` naming it.
    ``device_host``: the address this member's gloo device binds and announces
    (loopback here; the node's address on a real cluster). Unused by nccl.

    Raises :class:`~ftstate.core.errors.BackendUnavailable` for an unknown backend or one that
    cannot load here (nccl without cupy or without a GPU), never silently falling back.
    """
    if backend == "gloo":
        from ftstate.transport.gloo import GlooCommunicator

        return GlooCommunicator.join(
            store_addr=store_addr,
            group=group,
            version=version,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            device_host=device_host,
        )
    if backend == "nccl":
        from ftstate.transport.nccl import NcclCommunicator

        return NcclCommunicator.join(
            store_addr=store_addr,
            group=group,
            version=version,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
        )
    raise BackendUnavailable(f"unknown transport backend {backend!r}; expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "create_communicator"]
