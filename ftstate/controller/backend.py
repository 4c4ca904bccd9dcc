"""The seam between the controller and its cluster: the one interface through which it starts, places, calls
and kills worker actors (docs/concepts.md, "The cluster seam"). Implemented by
:class:`~ftstate.controller.ray.backend.RayBackend` and :class:`~ftstate.simulation.cluster.SimulatedCluster`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any, Protocol

from ftstate.core.config import RolePlacement
from ftstate.core.protocol import Beat, Request


class _Quiet:
    """The type of :data:`QUIET` (one object: compared with ``is``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "QUIET"


#: A node agent's heartbeat reply when the caller named an earlier reply and nothing changed since.
QUIET = _Quiet()

#: :data:`QUIET` on the wire (an object's identity does not survive pickling).
QUIET_WIRE = "quiet"


class AgentMemory:
    """What a node's agent keeps to answer :data:`QUIET`: its newest reply, its members and mark. Quiet only
    when the caller names that very reply, for the same members, and every answer equals it."""

    __slots__ = ("answers", "handles", "mark")

    def __init__(self) -> None:
        self.mark: int | None = None
        self.handles: list[Any] | None = None
        self.answers: list[Any] | None = None

    def reply(self, handles: list[Any], answers: list[Any], mark: int | None, since: int | None) -> Any:
        """This round's reply to send: :data:`QUIET_WIRE` or the ``answers``, kept under ``mark``."""
        quiet = since is not None and since == self.mark and handles == self.handles and answers == self.answers
        if mark is not None:
            self.mark, self.handles, self.answers = mark, handles, answers
        return QUIET_WIRE if quiet else answers


class ActorDied(Exception):
    """The actor's process is gone (SIGKILL, OOM, its node lost)."""


class ActorUnreachable(Exception):
    """The actor did not answer for now; the watchdog decides from repeated evidence whether it is lost."""


class CallTimedOut(Exception):
    """The call's own ``timeout`` passed without an answer (the call was cancelled)."""


class RemoteError(Exception):
    """The method raised inside the worker: ``cause`` is its exception, ``text`` the remote traceback."""

    def __init__(self, cause: BaseException, text: str) -> None:
        super().__init__(text)
        self.cause = cause
        self.text = text


class Pool(Protocol):
    """Worker slots of one role (or the spares); ``colocated``: spares placed on a node meant to be avoided.
    """

    name: str
    slots: int

    def describe(self) -> str: ...
    async def ready(self) -> None: ...
    @property
    def placed(self) -> bool: ...
    def slot_nodes(self) -> dict[int, str]: ...
    def take(self, avoid_nodes: Collection[str] = (), *, strict: bool = False) -> int: ...
    def has_free_slot(self) -> bool: ...
    def give_back(self, slot: int) -> None: ...
    def remove(self) -> None: ...


class ClusterBackend(abc.ABC):
    """What the controller needs of a cluster; a call ends in its result or this module's exceptions."""

    # -- the cluster -----------------------------------------------------------------------

    @abc.abstractmethod
    def connect(self, address: str | None) -> bool:
        """Join the cluster at ``address`` (None: start one); True when this call started it."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the cluster this backend started."""

    @abc.abstractmethod
    def node_address(self) -> str:
        """The address of the controller's node."""

    @abc.abstractmethod
    def node_id(self) -> str | None:
        """The id of the controller's node (several nodes may share an address)."""

    @abc.abstractmethod
    def nodes(self) -> list[dict[str, Any]]:
        """The alive nodes as ``{node_id, address, resources, labels}``."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """What runs the members (library name → version), for the ``run_start`` record."""

    # -- placement -------------------------------------------------------------------------

    @abc.abstractmethod
    def resource_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                      placement: RolePlacement) -> Pool:
        """``slots`` worker slots placed by ``placement``'s strategy; raises
        :class:`~ftstate.core.errors.PlacementUnsatisfiable` for what no state of the cluster could place."""

    @abc.abstractmethod
    def spare_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                   placement: RolePlacement) -> Pool:
        """Up to ``slots`` spare slots, each placed when taken, off the nodes it is told to avoid."""

    # -- actors ----------------------------------------------------------------------------

    @abc.abstractmethod
    def start_actor(self, *, name: str, run_id: str, pool: Pool, slot: int, role: str, user_class: type,
                    args: Sequence[Any], kwargs: Mapping[str, Any], host: Mapping[str, Any]) -> Any:
        """Start member ``name``'s worker host in ``slot`` of ``pool``, constructing ``user_class`` there."""

    @abc.abstractmethod
    async def call(self, handle: Any, req: Request, timeout: float | None) -> Any:
        """Send ``req`` to the worker actor and await the reply; raises one of this module's exceptions."""

    @abc.abstractmethod
    async def call_helper(self, handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
        """Call ``method(*args)`` on one of ftstate's helper actors (not a worker); raises as :meth:`call`."""

    @abc.abstractmethod
    def kill(self, handle: Any, *, pid: int | None, node: str | None) -> None:
        """Kill the actor now (``pid`` / ``node``: where it said it runs)."""

    @abc.abstractmethod
    async def heartbeats(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                         timeout: float, *, mark: int | None = None, since: int | None = None) -> Any:
        """One heartbeat (``args[i]``) of each of ``handles`` on ``node_id``, asked in one call of its agent:
        entry i is member i's answer or the exception its own :meth:`call` would raise. The agent's reply is
        bounded by two ``timeout``; raises (:class:`CallTimedOut` at once while the agent starts) when it
        cannot answer, and the caller asks each member directly. ``mark`` numbers this call; ``since`` names
        an earlier reply, answered with :data:`QUIET` when nothing changed."""

    def heartbeats_future(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                          timeout: float, *, mark: int | None = None, since: int | None = None) -> asyncio.Future[Any]:
        """:meth:`heartbeats` started now, as a future (a round waits on every node with callbacks, not
        tasks); this default runs it in a task."""
        return asyncio.ensure_future(self.heartbeats(node_id, handles, args, timeout, mark=mark, since=since))

    @abc.abstractmethod
    def calls(self, node_id: str, handles: Sequence[Any],
              requests: Sequence[Request]) -> AsyncIterator[list[tuple[int, Any]]]:
        """``requests[i]`` to each of ``handles`` on ``node_id`` through its agent; yields ``(i, outcome)``
        lists as members end. Unbounded (the caller's deadline bounds it); raises :class:`CallTimedOut` before
        anything when the agent is not up, so the caller calls each member directly."""

    @abc.abstractmethod
    def close(self) -> None:
        """The run ends: what the backend started besides the members (node agents) goes."""

    @abc.abstractmethod
    def start_node_agent(self, name: str, node_id: str) -> Any:
        """Start node ``node_id``'s node-copy agent, pinned there, asking for no CPU; raises when it cannot
        (the caller falls back to private staging)."""

    # -- maintenance ------------------------------------------------------------------------

    @abc.abstractmethod
    def start_node_watcher(self, node_id: str, options: Mapping[str, Any]) -> Any:
        """Start a maintenance watcher actor pinned to node ``node_id``, asking for no CPU."""

    @abc.abstractmethod
    async def draining_nodes(self, timeout: float) -> Mapping[str, int]:
        """The nodes the cluster is draining, ``{node_id: deadline_ms}`` (0: none), within ``timeout`` s."""

    # -- the rendezvous store --------------------------------------------------------------

    @abc.abstractmethod
    def rendezvous_store(self, host: str) -> Any:
        """The store group versions are formed on, served by the controller."""


__all__ = ["ActorDied", "ActorUnreachable", "CallTimedOut", "ClusterBackend", "Pool", "RemoteError"]
