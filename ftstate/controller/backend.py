"""The seam between the controller and the cluster it runs on: the one interface through
which it starts, places, calls and kills worker actors and learns what the cluster holds.

The controller's parts (the launcher, the calls, the formation, the runtime) never import
Ray; they are handed a :class:`ClusterBackend` and ask it. Two implementations stand behind
it, chosen by whoever builds the :class:`~ftstate.controller.runtime.Runtime` (a factory
outside the controller, as httpx chooses a transport), never by a branch inside it:

- :class:`~ftstate.controller.ray_backend.RayBackend`, the default: Ray actors in placement
  groups (:mod:`~ftstate.controller.placement`), on the cluster
  :mod:`~ftstate.controller.cluster` joins or starts;
- :class:`~ftstate.simulation.cluster.SimulatedCluster`: simulated members that answer after
  modelled delays in the event loop's virtual time (:mod:`ftstate.simulation`).

What a call can end in, whatever answers it (:meth:`ClusterBackend.call`): the method's
result; :class:`ActorDied` (the process is gone); :class:`ActorUnreachable` (no answer for
now: a lost node's raylet, a network partition); :class:`RemoteError` (the method raised in
the worker: the worker's own exception and its traceback as text); :class:`CallTimedOut`
(the call's own ``timeout`` passed). :mod:`~ftstate.controller.calls` turns these into
ftstate's errors and the members' ``died`` events, in one place for both backends.

The maintenance watchers reach the cluster here too: a watcher actor per node
(:meth:`ClusterBackend.start_node_watcher`) and the nodes the cluster is draining
(:meth:`ClusterBackend.draining_nodes`), so a simulated cluster can serve notices.

A resource pool (:meth:`ClusterBackend.resource_pool`, :meth:`ClusterBackend.spare_pool`)
is what the launcher takes worker slots from; its interface is :class:`Pool`.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from ftstate.core.config import RolePlacement


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
    async def call(self, handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
        """Call ``method(*args)`` on the actor and await its answer; raises one of the
        module's exceptions (see the module docstring)."""

    @abc.abstractmethod
    def kill(self, handle: Any, *, pid: int | None, node: str | None) -> None:
        """Kill the actor now (``pid`` / ``node``: where it said it runs)."""

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
