"""The gloo backend: a torch ``ProcessGroupGloo`` per group version, with no default process group."""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, BarrierOptions

from ftstate.core.errors import (
    PeerLost,
    RendezvousTimeout,
    StaleGroupVersion,
    TransportError,
)
from ftstate.transport import auth
from ftstate.transport.base import Communicator, Pending
from ftstate.transport.signedstore import SignedStore
from ftstate.transport.store import (
    StoreAddress,
    connect_store,
    join_version,
    read_current_version,
    version_prefix,
)

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger("ftstate.transport")


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


#: How often a thread waiting on a collective checks whether the version was abandoned: a
#: gloo operation cannot be cancelled and a peer's death does not always reach it.
#: Collectives only: a timed-out point-to-point wait makes gloo close the pair.
ABANDON_POLL_S = 0.05

#: What c10d says when a wait's own timeout (not the operation's) expires.
_WAIT_EXPIRED = "Operation timed out!"

#: Process groups of abandoned versions, kept from destruction (see GlooCommunicator.abandon),
#: with the receive that closed each one's connections and its one-element buffer.
_ABANDONED_GROUPS: list[object] = []

#: The tag of the receive that :meth:`GlooCommunicator.abandon` posts and lets time out, so
#: that gloo closes the version's connections; no message is ever sent with it.
_CLOSING_TAG = 0x7FFF_FFF0
#: How long that receive is waited on before it times out.
_CLOSING_WAIT_S = 0.001


class _GlooPending(Pending):
    __slots__ = ("_comm", "_op", "_peer", "_timeout_s", "_wait_timeout", "_work")

    def __init__(
        self, comm: GlooCommunicator, work: object, op: str, timeout_s: float, wait_timeout: bool,
        peer: int | None = None,
    ) -> None:
        self._comm = comm
        self._peer = peer  # the other end of a send / receive
        self._work = work
        self._op = op
        self._timeout_s = timeout_s
        self._wait_timeout = wait_timeout

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        try:
            if self._wait_timeout:
                # One wait: a point-to-point wait that times out closes the connections (see
                # ABANDON_POLL_S); abandoning the version closes them, which ends this one.
                work.wait(_delta(self._timeout_s))  # type: ignore[attr-defined]
                return
            while True:  # the operation's own timeout bounds this loop
                try:
                    work.wait(_delta(ABANDON_POLL_S))  # type: ignore[attr-defined]
                    return
                except RuntimeError as exc:
                    if _WAIT_EXPIRED not in str(exc):
                        raise
                comm = self._comm
                if comm.aborted:
                    raise comm.aborted_error()
        except RuntimeError as exc:  # DistError and gloo's errors are RuntimeErrors
            del work
            comm = self._comm
            if comm.aborted:  # the version was abandoned: this is its echo
                raise comm.aborted_error() from exc
            raise comm.translate(exc, self._op, self._timeout_s, self._peer) from exc


class GlooCommunicator(Communicator):
    """A formed gloo group version. Build with :meth:`join` (or ``create_communicator("gloo", ...)``)."""

    backend = "gloo"

    def __init__(
        self,
        *,
        pg: dist.ProcessGroupGloo,
        store: Store,
        group: str,
        version: int,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        super().__init__()
        self._pg: dist.ProcessGroupGloo | None = pg
        self._store = store
        self._backend_store: Store = store
        self.group = group
        self.version = version
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

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
        device_host: str = "127.0.0.1",
    ) -> GlooCommunicator:
        """Rendezvous and connect; see :func:`ftstate.transport.create_communicator`."""
        deadline = time.monotonic() + timeout_s
        store = connect_store(store_addr, timeout_s)
        join_version(store, group, version, rank, world_size, timeout_s)
        remaining = max(deadline - time.monotonic(), 0.001)
        prefix = version_prefix(group, version)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _delta(remaining)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
        # gloo's own rendezvous values (each rank's address) tagged like ftstate's: no rank connects
        # to an address someone outside the run planted (ftstate.transport.signedstore)
        backend_store = SignedStore(store, deadline=deadline, what=f"gloo rendezvous of group {group!r} version "
                                    f"{version}, rank {rank}", init_timeout_s=timeout_s) if auth.enabled() else store
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{prefix}/gloo", backend_store), rank, world_size, opts
            )
        except RuntimeError as exc:
            raise RendezvousTimeout(
                f"connecting the gloo mesh of group {group!r} version {version} "
                f"(a member left after registering: {str(exc).strip().splitlines()[0]})",
                key="init_timeout_s",
                seconds=timeout_s,
                member=f"rank {rank}",
                group_version=version,
            ) from exc
        # From here on the group's default bound is the full timeout, not what was left of it.
        pg._set_default_timeout(_delta(timeout_s))
        comm = cls(
            pg=pg, store=store, group=group, version=version, rank=rank, world_size=world_size, timeout_s=timeout_s
        )
        comm._backend_store = backend_store  # the Python store gloo calls into lives as long as its group
        remaining = deadline - time.monotonic()
        try:
            comm.barrier(timeout_s=max(remaining, 0.001))
        except (PeerLost, TransportError, TimeoutError) as exc:
            raise RendezvousTimeout(
                f"first barrier of group {group!r} version {version} ({exc})",
                key="init_timeout_s",
                seconds=timeout_s,
                member=f"rank {rank}",
                group_version=version,
            ) from exc
        log.info(
            "group version formed",
            extra={"group": group, "group_version": version, "rank": rank, "world_size": world_size,
                   "backend": "gloo", "seconds": round(timeout_s - remaining, 4)},
        )
        return comm

    # -- primitives -------------------------------------------------------------------

    @property
    def process_group(self) -> dist.ProcessGroupGloo:
        """The torch process group of this version (handed to a trainer's ``setup``; its
        collectives are called directly: ``pg.allreduce([t]).wait()``)."""
        return self._live_pg("hand out its process group")

    def _live_pg(self, op: str) -> dist.ProcessGroupGloo:
        if self._pg is None or self._abort_reason is not None:
            raise TransportError(
                f"{self.member}: cannot {op}: communicator was aborted ({self._abort_reason}); "
                "form a new group version"
            )
        return self._pg

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def broadcast(self, tensor: torch.Tensor, root: int, *, timeout_s: float | None = None) -> Pending:
        t = self._timeout(timeout_s)
        op = f"broadcast from rank {root}"
        pg = self._live_pg(op)
        try:
            work = pg.broadcast(tensor, root, _delta(t))
        except RuntimeError as exc:
            raise self.translate(exc, op, t) from exc
        return _GlooPending(self, work, op, t, wait_timeout=False)

    def send(self, tensor: torch.Tensor, peer: int, *, tag: int, timeout_s: float | None = None) -> Pending:
        return self._point_to_point("send", f"send to rank {peer}", tensor, peer, tag, timeout_s)

    def recv(self, tensor: torch.Tensor, peer: int, *, tag: int, timeout_s: float | None = None) -> Pending:
        return self._point_to_point("recv", f"receive from rank {peer}", tensor, peer, tag, timeout_s)

    def _point_to_point(self, method: str, op: str, tensor: torch.Tensor, peer: int, tag: int,
                        timeout_s: float | None) -> Pending:
        t = self._timeout(timeout_s)
        pg = self._live_pg(op)
        try:
            work = getattr(pg, method)([tensor], peer, tag)
        except RuntimeError as exc:
            raise self.translate(exc, op, t, peer) from exc
        return _GlooPending(self, work, op, t, wait_timeout=True, peer=peer)

    def allgather(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> list[torch.Tensor]:
        t = self._timeout(timeout_s)
        op = "allgather"
        pg = self._live_pg(op)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        opts = AllgatherOptions()
        opts.timeout = _delta(t)
        try:
            work = pg.allgather([out], [tensor], opts)
        except RuntimeError as exc:
            raise self.translate(exc, op, t) from exc
        _GlooPending(self, work, op, t, wait_timeout=False).wait()
        return out

    def barrier(self, *, timeout_s: float | None = None) -> None:
        t = self._timeout(timeout_s)
        op = "barrier"
        pg = self._live_pg(op)
        opts = BarrierOptions()
        opts.timeout = _delta(t)
        try:
            work = pg.barrier(opts)
        except RuntimeError as exc:
            raise self.translate(exc, op, t) from exc
        _GlooPending(self, work, op, t, wait_timeout=False).wait()

    def current_version(self) -> int:
        try:
            current = read_current_version(self._store, self.group)
        except RuntimeError as exc:
            raise PeerLost(
                f"{self.member}: the controller's store is unreachable: {exc}",
                group=self.group, group_version=self.version, rank=self.rank, op="read the current version",
            ) from exc
        return self.version if current is None else current

    def abandon(self, reason: str) -> None:
        """:meth:`Communicator.abandon`, and this version's connections closed (by provoking a
        timed-out receive), so point-to-point waits here and at the peers end at once instead of
        at sync_timeout_s: CommunicatorAborted here, PeerLost naming this member there."""
        first = self._abort_reason is None
        super().abandon(reason)
        pg = self._pg
        if pg is not None and first:
            # Never destroyed: its destructor joins threads stuck until sync_timeout_s, in
            # whatever thread drops the last reference. One small object per abandoned version.
            _ABANDONED_GROUPS.append(pg)
            self._close_connections(pg)

    def _close_connections(self, pg: dist.ProcessGroupGloo) -> None:
        """Have gloo close every connection of ``pg``: a receive from a peer on a tag nobody
        sends, whose wait times out. A connection already closed (its peer died) refuses the
        receive or fails it at once: the next peer is tried."""
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            probe = torch.empty(1)
            try:
                work = pg.recv([probe], peer, _CLOSING_TAG)
                _ABANDONED_GROUPS.append((work, probe))  # gloo may still refer to them
                work.wait(_delta(_CLOSING_WAIT_S))  # type: ignore[attr-defined]
            except RuntimeError as exc:
                if "timed out" in str(exc).lower():
                    return  # gloo closed the connections
                continue
            return  # pragma: no cover - nobody sends on the tag; nothing left to close then

    def _abort_backend(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.abort()
            del pg  # the last reference: destroying the group closes its sockets


# Re-exported for callers that catch the fencing error next to the backend.
__all__ = ["GlooCommunicator", "StaleGroupVersion"]
