"""The simulated cluster, in the controller's process: a :class:`~ftstate.controller.backend.ClusterBackend`
with simulated nodes, pools, members and store, and the faults a schedule injects. Placement follows Ray's
strategies as far as the controller can tell them apart; a lost node's members go unanswered until its death
is declared (``Costs.node_dead_s``), as measured on Ray (docs/benchmarks.md, "Node loss"). Everything runs on
the event loop's clock; docs/simulation.md describes the model."""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import random
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

from ftstate.controller.backend import ClusterBackend, Pool
from ftstate.controller.feasibility import check_feasible, label_matches
from ftstate.core.config import RolePlacement
from ftstate.core.errors import ConfigError, NoFreeSlot, PlacementUnsatisfiable, UsageError
from ftstate.core.protocol import Beat, Request
from ftstate.simulation.agentcalls import AgentBatch
from ftstate.simulation.clock import TimerQueue
from ftstate.simulation.collectives import Collective, SimulatedStore
from ftstate.simulation.costs import Costs
from ftstate.simulation.members import (
    NodeChanges,
    SimulatedLivenessAgent,
    SimulatedMember,
    SimulatedNodeWatcher,
)

#: The controller's node (it holds no worker).
HEAD = {"node_id": "head0000", "address": "10.255.255.254"}


def node_name(index: int) -> str:
    return f"n{index:07d}"


class SimulatedCluster(ClusterBackend):
    """``nodes`` simulated nodes (ids unique in their first 8 characters); ``costs``: what each step costs;
    ``seed``: the answer-time jitter's; ``per_node``: node i's extra resources and labels."""

    def __init__(self, nodes: int, *, cpus_per_node: float = 8.0, gpus_per_node: float = 0.0,
                 costs: Costs | None = None, labels: Mapping[str, str] | None = None, seed: int = 0,
                 per_node: Sequence[Mapping[str, Any]] = ()) -> None:
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ConfigError("nodes", f"{nodes!r}: expected an integer >= 1")
        if not isinstance(cpus_per_node, (int, float)) or cpus_per_node <= 0:
            raise ConfigError("cpus_per_node", f"{cpus_per_node!r}: expected a number > 0")
        if len(per_node) > nodes or any(set(extra) - {"resources", "labels"} for extra in per_node):
            raise ConfigError("per_node", f"{list(per_node)!r}: expected at most {nodes} mappings of "
                              "'resources' and 'labels'")
        self.costs = costs if costs is not None else Costs()
        #: The cluster's one source of chance (answer times): a run is a function of its seed.
        self.rng = random.Random(seed)
        #: The one context every modelled answer runs in, instead of a copy per call in flight.
        self.context = contextvars.Context()
        #: The timers of every modelled answer, detection and timeout (:class:`TimerQueue`).
        self.timers = TimerQueue(self.context)
        resources = {"CPU": float(cpus_per_node), **({"GPU": float(gpus_per_node)} if gpus_per_node else {})}
        self._nodes: dict[str, dict[str, Any]] = {}
        for i in range(nodes):
            nid = node_name(i)
            extra = per_node[i] if i < len(per_node) else {}
            self._nodes[nid] = {"node_id": nid, "address": f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
                                "resources": {**resources, **extra.get("resources", {})},
                                "labels": {**(labels or {}), **extra.get("labels", {})}}
        self._room: dict[str, dict[str, float]] = {nid: dict(n["resources"]) for nid, n in self._nodes.items()}
        self._alive_list: list[dict[str, Any]] | None = None
        self.members: dict[str, SimulatedMember] = {}
        self._by_node: dict[str, dict[str, SimulatedMember]] = {nid: {} for nid in self._nodes}
        self._changes: dict[str, NodeChanges] = {}
        #: Each node's agent (:meth:`heartbeats`), started on first use.
        self._agents: dict[str, SimulatedLivenessAgent] = {}
        #: The collectives in progress, by (what, group version, ...): a member that goes breaks those it is in.
        self.collectives: dict[tuple[Any, ...], Collective] = {}
        #: Ranks of each group version whose process went with its node (their collectives fail).
        self.gone_ranks: dict[int, set[int]] = {}
        self._stores: dict[int, SimulatedStore] = {}
        self._pids = itertools.count(1000)
        #: Nodes lost so far, in order.
        self.lost_nodes: list[str] = []
        self._lost: set[str] = set()
        #: Nodes being drained (:meth:`drain_node`), with their deadlines in epoch ms (0: none).
        self.draining: dict[str, int] = {}
        #: Poisoned nodes (:meth:`poison_node`): each kills what runs there this long after it starts.
        self.poisoned: dict[str, float] = {}
        #: A trainer step already under way when called (virtual seconds): a ``train_step`` made at that
        #: instant ends that much sooner (a replayed failure's first step).
        self.step_under_way: tuple[float, float] | None = None

    def changes_on(self, node_id: str) -> NodeChanges:
        """The count of changes its members' heartbeats would show on node ``node_id`` (:class:`NodeChanges`)."""
        changes = self._changes.get(node_id)
        if changes is None:
            changes = self._changes[node_id] = NodeChanges()
        return changes

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # -- the cluster -----------------------------------------------------------------------

    def connect(self, address: str | None) -> bool:
        return False  # nothing to start: the simulated cluster exists as built

    def shutdown(self) -> None:
        return None

    def node_address(self) -> str:
        return HEAD["address"]

    def node_id(self) -> str | None:
        return HEAD["node_id"]

    def nodes(self) -> list[dict[str, Any]]:
        if self._alive_list is None:
            self._alive_list = [n for nid, n in self._nodes.items() if nid not in self._lost]
        return self._alive_list

    def alive(self, node_id: str) -> bool:
        return node_id in self._nodes and node_id not in self._lost

    def versions(self) -> dict[str, str]:
        return {"cluster": "simulated"}

    # -- placement -------------------------------------------------------------------------

    def resource_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                      placement: RolePlacement) -> Pool:
        return SimulatedResourcePool(self, name, slots, cpus=cpus, gpus=gpus, placement=placement)

    def spare_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                   placement: RolePlacement) -> Pool:
        return SimulatedSparePool(self, name, slots, cpus=cpus, gpus=gpus, placement=placement)

    def fits(self, node_id: str, bundle: Mapping[str, float]) -> bool:
        room = self._room[node_id]
        return all(room.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v > 0)

    def reserve(self, node_id: str, bundle: Mapping[str, float], sign: float = 1.0) -> None:
        room = self._room[node_id]
        for k, v in bundle.items():
            room[k] = room.get(k, 0.0) - sign * v

    # -- actors ----------------------------------------------------------------------------

    def start_actor(self, *, name: str, run_id: str, pool: Pool, slot: int, role: str, user_class: type,
                    args: Sequence[Any], kwargs: Mapping[str, Any], host: Mapping[str, Any]) -> Any:
        node_id = pool.slot_nodes().get(slot)  # type: ignore[union-attr]
        up = node_id is not None and self.alive(node_id)
        node = self._nodes[node_id] if node_id is not None else HEAD
        # A slot with no live node waits for a placement that never comes, as in an unplaced Ray bundle.
        up_at = self.loop.time() + self.costs.start_s if up else float("inf")
        member = SimulatedMember(self, name, role, node["node_id"], node["address"], next(self._pids), up_at)
        self.members[name] = member
        if up and node_id in self.poisoned:
            self.loop.call_at(up_at + self.poisoned[node_id], member.die, f"poisoned node {node_id}")
        if node_id is not None:
            self._by_node[node_id][name] = member
        return member

    async def call(self, handle: Any, req: Request, timeout: float | None) -> Any:
        if not isinstance(handle, SimulatedMember):
            raise UsageError(f"not a simulated member: {handle!r}")
        return await handle.answer(req.method, (req,), timeout)

    async def call_helper(self, handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
        if not isinstance(handle, SimulatedMember):
            raise UsageError(f"not a simulated member: {handle!r}")
        return await handle.answer(method, tuple(args), timeout)

    def kill(self, handle: Any, *, pid: int | None, node: str | None) -> None:
        if isinstance(handle, SimulatedMember):
            handle.die("killed by the controller")

    def _agent(self, node_id: str) -> SimulatedLivenessAgent:
        agent = self._agents.get(node_id)
        if agent is None or (not agent.alive and self.alive(node_id)):
            # a light process (no torch), modelled as up at once, as the watchers are
            node = self._nodes.get(node_id, HEAD)
            agent = self._agents[node_id] = SimulatedLivenessAgent(
                self, f"agent-{node_id}", "agent", node_id, node["address"], next(self._pids), self.loop.time())
            if node_id in self._lost:
                agent.lose_node()
        return agent

    async def heartbeats(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                         timeout: float, *, mark: int | None = None, since: int | None = None) -> Any:
        return await self.heartbeats_future(node_id, handles, args, timeout, mark=mark, since=since)

    def heartbeats_future(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                          timeout: float, *, mark: int | None = None, since: int | None = None) -> asyncio.Future[Any]:
        # the agent's own answer's future: it settles with QUIET itself (nothing is pickled here)
        return self._agent(node_id).answer("heartbeats", (handles, args, timeout, mark, since), 2 * timeout)

    def calls(self, node_id: str, handles: Sequence[Any],
              requests: Sequence[Request]) -> AsyncIterator[list[tuple[int, Any]]]:
        # The agent's local hop is not modelled: each outcome arrives when the member's own call would end.
        for h in handles:
            if not isinstance(h, SimulatedMember):
                raise UsageError(f"not a simulated member: {h!r}")
        return AgentBatch(self.loop, self._agent(node_id), handles, requests)

    def close(self) -> None:
        for agent in self._agents.values():
            agent.die("the run ended")
        self._agents.clear()

    def start_node_agent(self, name: str, node_id: str) -> Any:
        # node-local staging is Ray-only: the controller falls back to private staging
        raise ConfigError("staging", f"node: a simulated node has no node copies (node {node_id[:8]}); staging: node is Ray-only")

    def start_node_watcher(self, node_id: str, options: Mapping[str, Any]) -> Any:
        # A watcher is light (no torch): up at once; notices come from drain_node() (the ``ray`` source).
        node = self._nodes.get(node_id, HEAD)
        return SimulatedNodeWatcher(self, f"watcher-{node_id}", "watcher", node_id, node["address"],
                                    next(self._pids), self.loop.time())

    async def draining_nodes(self, timeout: float) -> Mapping[str, int]:
        return {n: d for n, d in self.draining.items() if self.alive(n)}

    def rendezvous_store(self, host: str) -> Any:
        port = 29500 + len(self._stores)
        store = self._stores[port] = SimulatedStore(self, host, port)
        return store

    def store_at(self, port: int) -> SimulatedStore:
        return self._stores[port]

    def collective(self, key: tuple[Any, ...], what: str, expected: int, cost_s: float) -> Collective:
        """The collective ``key``, made on first arrival, kept while broken so a late arrival hears it."""
        c = self.collectives.get(key)
        if c is None:
            c = self.collectives[key] = Collective(self.loop, what, expected, cost_s, self.costs.death_detect_s,
                                                    on_finish=lambda: self.collectives.pop(key, None))
        return c

    # -- faults ----------------------------------------------------------------------------

    def member(self, name: str) -> SimulatedMember:
        try:
            return self.members[name]
        except KeyError:
            raise UsageError(f"no simulated member named {name!r}") from None

    def kill_member(self, name: str, reason: str = "SIGKILL") -> None:
        """The member's process dies (as a SIGKILL would)."""
        self.member(name).die(reason)

    def hang_member(self, name: str) -> None:
        """The member's process stays up and stops answering."""
        self.member(name).hang()

    def poison_node(self, node_id: str, after_s: float = 0.5) -> list[str]:
        """The node stays up but kills every member process on it ``after_s`` after it is up (a crash loop of
        the node); returns the members there now."""
        if not self.alive(node_id):
            raise UsageError(f"no live simulated node {node_id!r}")
        self.poisoned[node_id] = after_s
        there = [m for m in self._by_node[node_id].values() if m.alive]
        for m in there:
            self.loop.call_at(self.loop.time() + after_s, m.die, f"poisoned node {node_id}")
        return [m.name for m in there]

    def drain_node(self, node_id: str, deadline_ms: int = 0) -> None:
        """The cluster starts draining the node, as Ray's ``DrainNode``; ``deadline_ms``: epoch ms, 0 none."""
        if not self.alive(node_id):
            raise UsageError(f"no live simulated node {node_id!r}")
        self.draining[node_id] = int(deadline_ms)

    def add_node(self, *, cpus: float | None = None, labels: Mapping[str, str] | None = None) -> str:
        """A node joins (``cpus`` default: the first node's; ``labels`` of its own); returns its id."""
        first = next(iter(self._nodes.values()))
        i = len(self._nodes)
        nid = node_name(i)
        resources = {**first["resources"], **({"CPU": float(cpus)} if cpus is not None else {})}
        self._nodes[nid] = {"node_id": nid, "address": f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
                            "resources": resources, "labels": dict(labels or {})}
        self._room[nid] = dict(resources)
        self._by_node[nid] = {}
        self._alive_list = None
        return nid

    def lose_node(self, node_id: str, reason: str = "node lost") -> list[str]:
        """The node goes, with every process on it; returns the members it took."""
        if not self.alive(node_id):
            raise UsageError(f"no live simulated node {node_id!r}")
        self.lost_nodes.append(node_id)
        self._lost.add(node_id)
        self._alive_list = None
        gone = [m for m in self._by_node[node_id].values() if m.alive]
        agent = self._agents.get(node_id)
        processes = [*gone, *([agent] if agent is not None else [])]  # its agent goes with it
        for m in processes:
            m.lose_node()
        self.loop.call_at(self.loop.time() + self.costs.node_dead_s, self._declared_dead, processes,
                          f"{reason} ({node_id})")
        return [m.name for m in gone]

    def _declared_dead(self, members: list[SimulatedMember], reason: str) -> None:
        for m in members:
            m.die(reason)

    def on_node(self, node_id: str) -> list[str]:
        """The live members on a node."""
        return [n for n, m in self._by_node.get(node_id, {}).items() if m.alive]


class _SimulatedPool:
    """What both simulated pools share (the bundle, the description, the feasibility check)."""

    def __init__(self, cluster: SimulatedCluster, name: str, slots: int, *, cpus: float, gpus: float,
                 placement: RolePlacement) -> None:
        self.cluster = cluster
        self.name = name
        self.slots = slots
        self.placement = placement
        self.bundle: dict[str, float] = {"CPU": cpus, **placement.resources}
        if gpus:
            self.bundle["GPU"] = gpus
        self.colocated: list[int] = []
        check_feasible(self, cluster.nodes())  # type: ignore[arg-type]

    def _candidates(self) -> list[str]:
        # A draining node takes no new work (Ray's scheduler skips it), though it is still alive.
        return [n["node_id"] for n in self.cluster.nodes() if n["node_id"] not in self.cluster.draining
                and all(label_matches(n["labels"], k, v) for k, v in self.placement.labels.items())]

    def _bundle_text(self) -> str:
        bundle = ", ".join(f"{k}={v:g}" for k, v in self.bundle.items())
        return f"{{{bundle}}}"


class SimulatedResourcePool(_SimulatedPool):
    """A role's pool: every slot placed at once or none (then :meth:`ready` waits, as in Ray)."""

    def __init__(self, cluster: SimulatedCluster, name: str, slots: int, *, cpus: float, gpus: float,
                 placement: RolePlacement) -> None:
        super().__init__(cluster, name, slots, cpus=cpus, gpus=gpus, placement=placement)
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._is_free = set(self._free)
        self._nodes = self._place()

    def _place(self) -> dict[int, str]:
        nodes = self._candidates()
        out: dict[int, str] = {}
        if self.placement.strategy in ("PACK", "STRICT_PACK"):
            order = itertools.chain.from_iterable(itertools.repeat(n, self.slots) for n in nodes)
        else:
            order = itertools.chain.from_iterable(itertools.repeat(nodes, self.slots))
        for node in order:
            if len(out) == self.slots:
                break
            if self.cluster.fits(node, self.bundle):
                self.cluster.reserve(node, self.bundle)
                out[len(out)] = node
            elif self.placement.strategy not in ("PACK", "STRICT_PACK") and not any(
                    self.cluster.fits(n, self.bundle) for n in nodes):
                break
        if len(out) < self.slots:
            for node in out.values():  # all or nothing, as a placement group
                self.cluster.reserve(node, self.bundle, -1.0)
            return {}
        return out

    def describe(self) -> str:
        return f"pool {self.name!r}: {self.slots} x {self._bundle_text()}, {self.placement.strategy}"

    async def ready(self) -> None:
        if not self._nodes:
            await asyncio.get_running_loop().create_future()  # never placed: the deadline decides

    @property
    def placed(self) -> bool:
        return bool(self._nodes)

    def slot_nodes(self) -> dict[int, str]:
        return self._nodes

    def take(self, avoid_nodes: Collection[str] = (), *, strict: bool = False) -> int:
        if not self._free:
            raise NoFreeSlot(self.name, f"all {self.slots} in use")
        if avoid_nodes:
            for slot in sorted(self._free):
                node = self._nodes.get(slot)
                if node is not None and node not in avoid_nodes and self.cluster.alive(node):
                    self._free.remove(slot)
                    heapq.heapify(self._free)
                    self._is_free.discard(slot)
                    return slot
            if strict:
                raise NoFreeSlot(self.name, "none off the nodes to avoid")
        slot = heapq.heappop(self._free)
        self._is_free.discard(slot)
        return slot

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def give_back(self, slot: int) -> None:
        if slot not in self._is_free:
            heapq.heappush(self._free, slot)
            self._is_free.add(slot)

    def remove(self) -> None:
        for node in self._nodes.values():
            self.cluster.reserve(node, self.bundle, -1.0)
        self._nodes = {}


class SimulatedSparePool(_SimulatedPool):
    """The standby pool: a slot per spare, placed when taken on the roomiest node not to be avoided."""

    def __init__(self, cluster: SimulatedCluster, name: str, slots: int, *, cpus: float, gpus: float,
                 placement: RolePlacement) -> None:
        super().__init__(cluster, name, slots, cpus=cpus, gpus=gpus, placement=placement)
        self._groups: dict[int, str | None] = {}
        self._next = 0

    def describe(self) -> str:
        return (f"pool {self.name!r}: up to {self.slots} x {self._bundle_text()}, one placement group each, "
                "off the nodes of the members they cover")

    async def ready(self) -> None:
        return None

    @property
    def placed(self) -> bool:
        return True

    def slot_nodes(self) -> dict[int, str]:
        return {s: n for s, n in self._groups.items() if n is not None}

    def has_free_slot(self) -> bool:
        return len(self._groups) < self.slots

    def take(self, avoid_nodes: Collection[str] = (), *, strict: bool = False) -> int:
        if not self.has_free_slot():
            raise NoFreeSlot(self.name, f"all {self.slots} in use")
        avoid = set(avoid_nodes)
        slot = self._next
        self._next += 1
        candidates = [n for n in self._candidates() if self.cluster.fits(n, self.bundle)]
        allowed = [n for n in candidates if n not in avoid]
        if not allowed and avoid:
            if strict:
                nodes = self.cluster.nodes()
                from ftstate.controller.feasibility import describe_cluster

                raise PlacementUnsatisfiable(pool=self.name, asked=f"{self.describe()}, off nodes "
                                             f"{', '.join(sorted(n[:8] for n in avoid))}",
                                             cluster=describe_cluster(nodes), problem="no other node can hold it")
            if len(self.cluster.nodes()) > 1:
                self.colocated.append(slot)
            allowed = candidates
        node = max(allowed, key=lambda n: self.cluster._room[n].get("CPU", 0.0), default=None)
        if node is not None:
            self.cluster.reserve(node, self.bundle)
        self._groups[slot] = node
        return slot

    def give_back(self, slot: int) -> None:
        node = self._groups.pop(slot, None)
        if node is not None:
            self.cluster.reserve(node, self.bundle, -1.0)

    def remove(self) -> None:
        for slot in list(self._groups):
            self.give_back(slot)


__all__ = ["HEAD", "SimulatedCluster", "SimulatedResourcePool", "SimulatedSparePool", "node_name"]
