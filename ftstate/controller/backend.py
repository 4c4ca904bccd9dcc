"""The seam between the controller and the cluster it runs on: the one interface through
which it starts, places, calls and kills worker actors and learns what the cluster holds.

The controller's parts (the launcher, the calls, the formation, the runtime) never import
Ray; they are handed a :class:`ClusterBackend` and ask it. Two implementations stand behind
it, chosen by whoever builds the :class:`~ftstate.controller.runtime.Runtime` (a factory
outside the controller, as httpx chooses a transport), never by a branch inside it:

- :class:`~ftstate.controller.ray.backend.RayBackend`, the default: Ray actors in placement
  groups (:mod:`~ftstate.controller.ray.placement`), on the cluster
  :mod:`~ftstate.controller.ray.cluster` joins or starts;
- :class:`~ftstate.simulation.cluster.SimulatedCluster`: simulated members that answer after
  modelled delays in the event loop's virtual time (:mod:`ftstate.simulation`).

What a call can end in, whatever answers it (:meth:`ClusterBackend.call`): the method's
result; :class:`ActorDied` (the process is gone); :class:`ActorUnreachable` (no answer for
now: a lost node's raylet, a network partition); :class:`RemoteError` (the method raised in
the worker: the worker's own exception and its traceback as text); :class:`CallTimedOut`
(the call's own ``timeout`` passed). :mod:`~ftstate.controller.calls` turns these into
ftstate's errors and the members' ``died`` events, in one place for both backends.

Heartbeats are asked per node (:meth:`ClusterBackend.heartbeats`): the node's agent calls the
worker hosts where they run and answers for all of them in one reply, each member's answer or
the outcome its own call would have had; one call per node and interval instead of one per
member is what keeps a watchdog round cheap at thousands of members (docs/benchmarks.md,
"Controller at scale"). The agent is an accelerator: when it cannot answer, the watchdog asks
each member directly. A sync's calls to the members of a node go through the same agent
(:meth:`ClusterBackend.calls`): it calls them there and streams each member's outcome back as
it ends, so that a member that fails is heard of at once, not when its node's batch ends.
A round whose answers are all the same as those of an earlier reply the controller names is
answered with :data:`QUIET` alone (the agent compares, the controller judges nothing it
already judged): a quiet node's round costs the controller one call, not its members' answers.

The maintenance watchers reach the cluster here too: a watcher actor per node
(:meth:`ClusterBackend.start_node_watcher`) and the nodes the cluster is draining
(:meth:`ClusterBackend.draining_nodes`), so a simulated cluster can serve notices.

A resource pool (:meth:`ClusterBackend.resource_pool`, :meth:`ClusterBackend.spare_pool`)
is what the launcher takes worker slots from; its interface is :class:`Pool`.
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


#: A node agent's reply to :meth:`ClusterBackend.heartbeats` when the caller named an earlier
#: reply (``since``) and every member's answer now is equal to its answer there.
QUIET = _Quiet()

#: How an agent's process says :data:`QUIET` over the wire (an object's identity does not
#: survive pickling); the backend hands :data:`QUIET` on.
QUIET_WIRE = "quiet"


class AgentMemory:
    """What a node's agent keeps to answer :data:`QUIET` (:meth:`ClusterBackend.heartbeats`):
    its newest reply, the members it was for, and that call's mark. Both agents use it, the
    Ray actor's and the simulation's, so the rule is one: quiet only when the caller names
    the very reply kept, for the same members, and every answer now equals the one there."""

    __slots__ = ("answers", "handles", "mark")

    def __init__(self) -> None:
        self.mark: int | None = None
        self.handles: list[Any] | None = None
        self.answers: list[Any] | None = None

    def reply(self, handles: list[Any], answers: list[Any], mark: int | None, since: int | None) -> Any:
        """What to send back for this round's ``answers`` (of ``handles``): :data:`QUIET_WIRE`
        or the answers; kept under ``mark`` (a call without one leaves what is kept alone)."""
        quiet = since is not None and since == self.mark and handles == self.handles and answers == self.answers
        if mark is not None:
            self.mark, self.handles, self.answers = mark, handles, answers
        return QUIET_WIRE if quiet else answers


class ActorDied(Exception):
    """The actor's process is gone (SIGKILL, OOM, its node lost). The message: the backend's
    own first line about it."""


class ActorUnreachable(Exception):
    """The actor did not answer for now (its node's raylet is gone, the network is cut); the
    heartbeat watchdog decides from repeated evidence whether it is lost."""


class CallTimedOut(Exception):
    """The call's own ``timeout`` passed without an answer (the call was cancelled)."""


class RemoteError(Exception):
    """The method raised inside the worker. cause: the worker's own exception (an ftstate
    error, or the user's); text: the remote traceback as the backend reports it."""

    def __init__(self, cause: BaseException, text: str) -> None:
        super().__init__(text)
        self.cause = cause
        self.text = text


class Pool(Protocol):
    """Worker slots of one role (or the spares), as the launcher uses them. name: the pool's
    name; slots: how many; colocated: spare slots placed on a node they were meant to avoid."""

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
    """What the controller needs of a cluster (see the module docstring)."""

    # -- the cluster -----------------------------------------------------------------------

    @abc.abstractmethod
    def connect(self, address: str | None) -> bool:
        """Join the cluster at ``address`` (None: one of this process's own). Returns True
        when this call started it (the caller shuts it down at close)."""

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
        """``slots`` worker slots placed by ``placement``'s strategy; refuses at once
        (:class:`~ftstate.core.errors.PlacementUnsatisfiable`) what no state of the cluster could place."""

    @abc.abstractmethod
    def spare_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                   placement: RolePlacement) -> Pool:
        """Up to ``slots`` spare slots, each placed when taken, off the nodes it is told to avoid."""

    # -- actors ----------------------------------------------------------------------------

    @abc.abstractmethod
    def start_actor(self, *, name: str, run_id: str, pool: Pool, slot: int, role: str, user_class: type,
                    args: Sequence[Any], kwargs: Mapping[str, Any], host: Mapping[str, Any]) -> Any:
        """Start the worker host of member ``name`` in ``slot`` of ``pool`` (its constructor
        runs there: ``user_class(*args, **kwargs)``); ``host``: the host's own settings
        (backend, bucket bytes, secret…). Returns the handle calls are made on."""

    @abc.abstractmethod
    async def call(self, handle: Any, req: Request, timeout: float | None) -> Any:
        """Send ``req`` to the worker actor (its :class:`~ftstate.core.protocol.WorkerAPI` method
        ``req.method``) and await the reply; raises one of the module's exceptions (see the
        module docstring)."""

    @abc.abstractmethod
    async def call_helper(self, handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
        """Call ``method(*args)`` on one of ftstate's own helper actors (a node's copy agent, a
        maintenance watcher: not a worker) and await its answer; raises as :meth:`call`."""

    @abc.abstractmethod
    def kill(self, handle: Any, *, pid: int | None, node: str | None) -> None:
        """Kill the actor now (``pid`` / ``node``: where it said it runs)."""

    @abc.abstractmethod
    async def heartbeats(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                         timeout: float, *, mark: int | None = None, since: int | None = None) -> Any:
        """One heartbeat (``args[i]``) of each of ``handles`` (actors on node ``node_id``), asked
        in one call of that node's agent (started on first use; until it is up this raises
        :class:`CallTimedOut` at once, never waiting for it), which calls them there and
        answers for all: entry i is member i's answer, or the exception its own :meth:`call`
        would have raised (:class:`ActorDied`, :class:`ActorUnreachable`, :class:`RemoteError`,
        :class:`CallTimedOut` after ``timeout``). The agent's own reply is bounded by two
        ``timeout``: one for the members' answers, one for its round trip; when it does not
        come (the agent is starting, gone, or its node unreachable) this raises one of the
        module's exceptions, and the caller asks each member directly.

        ``mark``: this call's number, unique among the caller's calls of this agent; the agent
        keeps its last reply under it (one, the newest). ``since``: the mark of an earlier
        reply the caller received; when the agent still keeps that reply, for the same members,
        and every answer now is equal to the one there, it replies :data:`QUIET` instead of
        the list (and keeps it under ``mark``). The agent's answers come from the members
        either way: only what travels back, and what the caller reads, is less."""

    def heartbeats_future(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                          timeout: float, *, mark: int | None = None, since: int | None = None) -> asyncio.Future[Any]:
        """:meth:`heartbeats`, started now, as a future of its outcome: what a watchdog round
        waits on for every node at once, with a callback each, not a task each. This default
        runs :meth:`heartbeats` in a task; a backend whose agent's reply already is a future
        (the simulation's) hands that back, settled as :meth:`heartbeats` would return or raise."""
        return asyncio.ensure_future(self.heartbeats(node_id, handles, args, timeout, mark=mark, since=since))

    @abc.abstractmethod
    def calls(self, node_id: str, handles: Sequence[Any],
              requests: Sequence[Request]) -> AsyncIterator[list[tuple[int, Any]]]:
        """``requests[i]`` to each of ``handles`` (actors on node ``node_id``), asked in
        one call of that node's agent (the one :meth:`heartbeats` uses), which calls them there;
        yields each member's outcome as it ends, in lists of ``(i, outcome)`` of those that ended
        together: the method's result, or the exception its own :meth:`call` would have raised
        (:class:`ActorDied`, :class:`ActorUnreachable`, :class:`RemoteError`). Unbounded, as
        :meth:`call` without a timeout (the caller's state deadline bounds it); cancelling the
        iteration cancels the agent's call. Raises :class:`CallTimedOut` before yielding anything,
        and before any member was called, when the agent is not up (never waited for: the caller
        calls each member directly); any other exception of the iteration (the agent died, its
        node does not answer) leaves the members not yet yielded without an outcome."""

    @abc.abstractmethod
    def close(self) -> None:
        """The run ends: what the backend started for it besides the members (the node agents
        of :meth:`heartbeats`) goes."""

    @abc.abstractmethod
    def start_node_agent(self, name: str, node_id: str) -> Any:
        """Start the node-copy agent of node ``node_id`` (a
        :class:`~ftstate.controller.nodecopies.NodeAgent` given the node's address), named
        ``name``, pinned there and asking for no CPU. Returns a handle for :meth:`call` and
        :meth:`kill`; raises when the cluster cannot have one there (the caller falls back to
        private staging)."""

    # -- maintenance ------------------------------------------------------------------------

    @abc.abstractmethod
    def start_node_watcher(self, node_id: str, options: Mapping[str, Any]) -> Any:
        """Start a :class:`~ftstate.controller.maintenance.node_actor.NodeWatcherActor` pinned to
        node ``node_id``, asking for no CPU (``options``: its constructor's keyword arguments).
        Returns a handle for :meth:`call` (``describe``, ``poll``, ``acknowledge``) and :meth:`kill`."""

    @abc.abstractmethod
    async def draining_nodes(self, timeout: float) -> Mapping[str, int]:
        """The nodes the cluster is draining, ``{node_id: deadline_ms}`` (0: no deadline), asked
        once within ``timeout`` seconds (the ``ray`` maintenance source); raises on failure."""

    # -- the rendezvous store --------------------------------------------------------------

    @abc.abstractmethod
    def rendezvous_store(self, host: str) -> Any:
        """The store group versions are formed on (``address``, ``arrived(group, version)``,
        ``fence(group, version)``, ``close()``), served by the controller."""


__all__ = ["ActorDied", "ActorUnreachable", "CallTimedOut", "ClusterBackend", "Pool", "RemoteError"]
