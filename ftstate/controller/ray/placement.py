"""Placement, for the Ray backend: placement groups as resource pools, one per role (a bundle per worker slot,
placed by the role's strategy and labels) plus :class:`SparePool`, whose spares get one-bundle groups kept off
the nodes they cover and off lost nodes by a node-id label selector. Infeasible requests fail at once naming
what was asked and what the cluster has; a feasible one not placed yet is waited for inside RENDEZVOUS, so
``init_timeout_s`` bounds it."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any

from ftstate.controller.feasibility import check_feasible, describe_cluster, fits_one
from ftstate.core.config import RolePlacement
from ftstate.core.errors import NoFreeSlot, PlacementUnsatisfiable


class _Pool:
    """What both kinds of pool share: one worker's bundle (``cpus``/``gpus``, the role's resources and labels)
    and the actor options that put a worker in it; refuses a pool the cluster can never place."""

    def __init__(
        self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float, placement: RolePlacement
    ) -> None:
        self.run_id = run_id
        self.name = name
        self.slots = slots
        self.cpus = cpus
        self.gpus = gpus
        self.placement = placement
        self.bundle: dict[str, float] = {"CPU": cpus, **placement.resources}
        if gpus:
            self.bundle["GPU"] = gpus
        check_feasible(self, cluster_nodes())

    def _bundle_text(self) -> str:
        bundle = ", ".join(f"{k}={v:g}" for k, v in self.bundle.items())
        labels = f" on nodes labelled {dict(self.placement.labels)}" if self.placement.labels else ""
        return f"{{{bundle}}}{labels}"

    def _options(self, group: Any, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {
            "num_cpus": self.cpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        }
        if self.gpus:
            opts["num_gpus"] = self.gpus
        if self.placement.resources:
            opts["resources"] = dict(self.placement.resources)
        return opts


class ResourcePool(_Pool):
    """One placement group with one bundle per slot, placed by the role's strategy."""

    def __init__(
        self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float, placement: RolePlacement
    ) -> None:
        from ray.util.placement_group import placement_group

        super().__init__(run_id, name, slots, cpus=cpus, gpus=gpus, placement=placement)
        self._free = list(range(slots))
        selector = [dict(placement.labels) for _ in range(slots)] if placement.labels else None
        self._pg = placement_group([dict(self.bundle) for _ in range(slots)], strategy=placement.strategy,
                                   name=f"ftstate-{run_id}-{name}", bundle_label_selector=selector)

    def describe(self) -> str:
        """What this pool asks of the cluster, in one line."""
        return f"pool {self.name!r}: {self.slots} x {self._bundle_text()}, {self.placement.strategy}"

    async def ready(self) -> None:
        await self._pg.ready()

    @property
    def placed(self) -> bool:
        import ray

        return ray.util.placement_group_table(self._pg).get("state") == "CREATED"

    def slot_nodes(self) -> dict[int, str]:
        """Ray's node id of each placed bundle (empty before the pool is placed)."""
        import ray

        table = ray.util.placement_group_table(self._pg)
        return {int(k): v for k, v in (table.get("bundles_to_node_id") or {}).items()}

    def take(self, avoid_nodes: Collection[str] = (), *, strict: bool = False) -> int:
        """Reserve a free slot off ``avoid_nodes`` when one is (``strict``: only such); its bundle index."""
        if not self._free:
            raise NoFreeSlot(self.name, f"all {self.slots} in use")
        if avoid_nodes:
            nodes = self.slot_nodes()
            for slot in self._free:
                if nodes.get(slot) not in avoid_nodes and slot in nodes:
                    self._free.remove(slot)
                    return slot
            if strict:
                raise NoFreeSlot(self.name, "none off the nodes to avoid")
        return self._free.pop(0)

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def give_back(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def options(self, slot: int) -> dict[str, Any]:
        """Actor options that place it in ``slot`` of this pool."""
        return self._options(self._pg, slot)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)


NODE_ID_LABEL = "ray.io/node-id"


class SparePool(_Pool):
    """The standby pool: up to ``slots`` spares, each in a one-bundle placement group off given nodes."""

    def __init__(
        self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float, placement: RolePlacement
    ) -> None:
        super().__init__(run_id, name, slots, cpus=cpus, gpus=gpus, placement=placement)
        self._groups: dict[int, Any] = {}
        self._next = 0
        #: Spares placed on a node they were meant to avoid (no other node could hold them).
        self.colocated: list[int] = []

    def describe(self) -> str:
        return (f"pool {self.name!r}: up to {self.slots} x {self._bundle_text()}, one placement group each, "
                "off the nodes of the members they cover")

    async def ready(self) -> None:
        return None  # each spare's group is placed when its spare starts

    @property
    def placed(self) -> bool:
        return True

    def slot_nodes(self) -> dict[int, str]:
        import ray

        out = {}
        for slot, pg in self._groups.items():
            nodes = (ray.util.placement_group_table(pg).get("bundles_to_node_id") or {})
            if nodes:
                out[slot] = next(iter(nodes.values()))
        return out

    def has_free_slot(self) -> bool:
        return len(self._groups) < self.slots

    def take(self, avoid_nodes: Collection[str] = (), *, strict: bool = False) -> int:
        """A new slot off ``avoid_nodes``; where no other node can hold it, on them anyway (recorded in
        :attr:`colocated`), or with ``strict`` (a drain) :class:`PlacementUnsatisfiable`."""
        from ray.util.placement_group import placement_group

        if not self.has_free_slot():
            raise NoFreeSlot(self.name, f"all {self.slots} in use")
        selector = dict(self.placement.labels)
        avoid = set(avoid_nodes)
        slot = self._next
        self._next += 1
        if avoid:
            nodes = cluster_nodes()
            allowed = [n["node_id"] for n in nodes
                       if n["node_id"] not in avoid and fits_one(n, self.bundle, self.placement.labels)]
            if allowed:
                selector[NODE_ID_LABEL] = f"in({','.join(sorted(allowed))})"
            elif strict:
                raise PlacementUnsatisfiable(pool=self.name, asked=f"{self.describe()}, off nodes "
                                             f"{', '.join(sorted(n[:8] for n in avoid))}",
                                             cluster=describe_cluster(nodes), problem="no other node can hold it")
            elif len(nodes) > 1:  # on one node there is nowhere else to be: nothing to report
                self.colocated.append(slot)
        self._groups[slot] = placement_group([dict(self.bundle)], strategy="PACK",
                                             name=f"ftstate-{self.run_id}-{self.name}-{slot}",
                                             bundle_label_selector=[selector] if selector else None)
        return slot

    def give_back(self, slot: int) -> None:
        from ray.util.placement_group import remove_placement_group

        pg = self._groups.pop(slot, None)
        if pg is not None:
            with contextlib.suppress(Exception):  # the cluster may be gone already
                remove_placement_group(pg)

    def options(self, slot: int) -> dict[str, Any]:
        return self._options(self._groups[slot], 0)

    def remove(self) -> None:
        for slot in list(self._groups):
            self.give_back(slot)


def cluster_nodes() -> list[dict[str, Any]]:
    """The alive nodes as ``{node_id, address, resources, labels}``."""
    import ray

    return [{"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"), "resources": n.get("Resources", {}),
             "labels": n.get("Labels", {}) or {}} for n in ray.nodes() if n.get("Alive")]
