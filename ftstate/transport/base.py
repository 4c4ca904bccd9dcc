"""The communicator interface: one group version, its members, and the byte-moving primitives."""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING, Literal

from ftstate.core.errors import CommunicatorAborted, PeerLost, SyncTimeout, TransportError

if TYPE_CHECKING:
    import torch


log = logging.getLogger("ftstate.transport")

Backend = Literal["gloo", "nccl"]

# Substrings of gloo/NCCL messages that mean "the other side went away".
_PEER_GONE = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "read error",
    "write error",
    "connection refused",
    "remote process exited",
    "aborted",
    "ncclremoteerror",
    "ncclsystemerror",
)
_TIMED_OUT = ("timed out", "timeout")


class Pending(abc.ABC):
    """A primitive in flight. :meth:`wait` returns when it completed or raises the ftstate error."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class Communicator(abc.ABC):
    """One version of a named group; see docs/concepts.md."""

    backend: Backend
    group: str
    version: int
    rank: int
    world_size: int
    timeout_s: float

    def __init__(self) -> None:
        self._abort_reason: str | None = None

    # -- identity ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    @property
    def member(self) -> str:
        return f"rank {self.rank} of group {self.group!r} v{self.version}"

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    def aborted_error(self) -> CommunicatorAborted:
        """What a wait on this aborted (or abandoned) communicator raises, naming the reason."""
        return CommunicatorAborted(self.group, self.version, self.rank, self._abort_reason or "aborted")

    def __repr__(self) -> str:
        state = f", aborted: {self._abort_reason}" if self._abort_reason else ""
        return (
            f"<{type(self).__name__} group={self.group!r} version={self.version} "
            f"rank={self.rank}/{self.world_size}{state}>"
        )

    # -- primitives (timeouts in seconds; each bounds that one operation) -------------------

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, *, timeout_s: float | None = None) -> Pending:
        """Broadcast ``tensor`` (contiguous, on :attr:`device`) from ``root``; ``timeout_s`` bounds it."""

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, *, tag: int, timeout_s: float | None = None) -> Pending:
        """Send ``tensor`` to ``peer`` only. ``timeout_s``: bound on this send; default :attr:`timeout_s`."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int, *, tag: int, timeout_s: float | None = None) -> Pending:
        """Receive into ``tensor`` from ``peer``. ``timeout_s``: bound on this receive; default :attr:`timeout_s`."""

    @abc.abstractmethod
    def allgather(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> list[torch.Tensor]:
        """Every member's copy of a small ``tensor``, by rank; ``timeout_s`` bounds the exchange."""

    @abc.abstractmethod
    def barrier(self, *, timeout_s: float | None = None) -> None:
        """Return once every member reached the barrier. ``timeout_s``: default :attr:`timeout_s`."""

    @abc.abstractmethod
    def current_version(self) -> int:
        """The group's current version as published in the store (>= :attr:`version`)."""

    @abc.abstractmethod
    def _abort_backend(self) -> None:
        """Tear the backend down so that peers blocked on this member fail now."""

    # -- lifecycle --------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise StaleGroupVersion (the group moved on) or CommunicatorAborted unless a transfer can start."""
        from ftstate.core.errors import StaleGroupVersion

        if self._abort_reason is not None:
            raise self.aborted_error()
        current = self.current_version()
        if current > self.version:
            raise StaleGroupVersion(self.group, got=self.version, current=current, peer=f"rank {self.rank}")

    def abort(self, reason: str = "abandoned") -> None:
        """Abandon this version: tear down the backend (idempotent). Peers blocked on this
        member fail at once rather than at their timeouts."""
        if not self._give_up(reason, "communicator aborted"):
            return
        try:
            self._abort_backend()
        except Exception:  # teardown of a broken backend must not mask the error being handled
            log.debug("backend teardown failed", exc_info=True)

    def abandon(self, reason: str) -> None:
        """Give up this version from another thread: blocked waits end with CommunicatorAborted.
        No teardown, unlike :meth:`abort`: tearing gloo down under a stuck operation blocks the caller."""
        self._give_up(reason, "communicator abandoned")

    def _give_up(self, reason: str, message: str) -> bool:
        """Mark this version given up for ``reason`` and log it once; False when it already was."""
        if self._abort_reason is not None:
            return False
        self._abort_reason = reason
        log.info(message, extra={"group": self.group, "group_version": self.version, "rank": self.rank,
                                 "reason": reason})
        return True

    def close(self) -> None:
        """Release the communicator after normal use (same teardown as :meth:`abort`)."""
        self.abort("closed")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- error translation (used by the backends) --------------------------------------

    def translate(self, exc: BaseException, op: str, timeout_s: float, peer: int | None = None) -> Exception:
        """The ftstate error for a backend exception raised by ``op``; aborts the communicator.
        ``peer``: the rank on the other end of a point-to-point ``op``, named by a :class:`PeerLost`."""
        text = str(exc)
        low = text.lower()
        first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        if any(s in low for s in _TIMED_OUT):
            err: Exception = SyncTimeout(
                f"{op} on group {self.group!r}",
                key="sync_timeout_s",
                seconds=timeout_s,
                member=f"rank {self.rank}",
                group_version=self.version,
            )
            self.abort(f"{op} timed out after {timeout_s:g}s")
        elif any(s in low for s in _PEER_GONE):
            err = PeerLost(
                f"{self.member}: a peer was lost during {op}: {first_line}",
                group=self.group, group_version=self.version, rank=self.rank, op=op, peer=peer,
            )
            self.abort(f"peer lost during {op}")
        else:
            err = TransportError(f"{self.member}: {op} failed: {first_line}")
            self.abort(f"{op} failed")
        return err


__all__ = ["Backend", "Communicator", "Pending"]
