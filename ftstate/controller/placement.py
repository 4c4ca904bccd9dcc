"""Placement: Ray placement groups as resource pools, one per role plus one for spares.

Each pool is a placement group with one bundle per worker slot (``worker_cpus`` CPUs and
``worker_gpus`` GPUs), so a run reserves its resources up front and a replacement lands in
a slot that is known to exist. Spares live in their own pool, named by
``fault_tolerance.standby_resource_pool`` as verl calls it, so operators can put them on
other nodes than the serving workers (a spare on the node that just died is no spare).

A pool that cannot be placed (the cluster lacks the resources) waits; the wait runs inside
the rendezvous state, so ``init_timeout_s`` bounds it like everything else at start-up.
"""

from __future__ import annotations

from typing import Any


class ResourcePool:
    """One placement group. name: the pool's name (``rollout``, ``standby``…); slots: bundles;
    cpus / gpus: per bundle; strategy: Ray's (PACK keeps a group on few nodes, SPREAD spreads)."""

    def __init__(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float, strategy: str = "PACK") -> None:
        from ray.util.placement_group import placement_group

        self.name = name
        self.slots = slots
        self.cpus = cpus
        self.gpus = gpus
        bundle: dict[str, float] = {"CPU": cpus}
        if gpus:
            bundle["GPU"] = gpus
        self._free = list(range(slots))
        self._pg = placement_group([dict(bundle) for _ in range(slots)], strategy=strategy,
                                   name=f"ftstate-{run_id}-{name}")

    async def ready(self) -> None:
        await self._pg.ready()

    def take(self) -> int:
        """Reserve a free slot; returns its bundle index."""
        if not self._free:
            from ftstate.core.errors import FTError

            raise FTError(f"resource pool {self.name!r} has no free slot (all {self.slots} in use)")
        return self._free.pop(0)

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def give_back(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def options(self, slot: int) -> dict[str, Any]:
        """Actor options that place it in ``slot`` of this pool."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {
            "num_cpus": self.cpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=slot),
        }
        if self.gpus:
            opts["num_gpus"] = self.gpus
        return opts

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)
