"""Whether a pool of worker slots can ever be placed on a cluster, and what a cluster has, in
words: pure rules over the nodes' resources and labels, shared by the Ray pools
(:mod:`ftstate.controller.ray.placement`) and the simulated cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ftstate.core.config import RolePlacement
from ftstate.core.errors import PlacementUnsatisfiable


class Placeable(Protocol):
    """A pool as the rules read it: its name, slots, one slot's bundle and the role's placement."""

    name: str
    slots: int
    bundle: dict[str, float]
    placement: RolePlacement

    def describe(self) -> str: ...


def describe_cluster(nodes: list[dict[str, Any]]) -> str:
    """What the cluster has, one clause per alive node."""
    parts = []
    for n in nodes:
        res = ", ".join(f"{k}={v:g}" for k, v in sorted(n["resources"].items())
                        if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type")))
        labels = {k: v for k, v in n["labels"].items() if not k.startswith("ray.io/")}
        parts.append(f"node {n['node_id'][:8]} ({n['address']}): {{{res}}}" + (f" labels {labels}" if labels else ""))
    return f"{len(nodes)} alive node(s): " + "; ".join(parts)


def check_feasible(pool: Placeable, nodes: list[dict[str, Any]]) -> None:
    """Raise :class:`PlacementUnsatisfiable` when no placement of ``pool`` can ever exist on
    the cluster as it is (the room being taken for now is not this: that is waited for)."""
    fits = [n for n in nodes if fits_one(n, pool.bundle, pool.placement.labels)]
    problem = ""
    if not fits:
        problem = "no node can hold even one bundle"
    elif pool.placement.strategy == "STRICT_SPREAD" and len(fits) < pool.slots:
        problem = f"STRICT_SPREAD needs {pool.slots} distinct nodes, {len(fits)} can hold a bundle"
    elif pool.placement.strategy == "STRICT_PACK" and not any(_fits_n(n, pool.bundle, pool.slots) for n in fits):
        problem = f"STRICT_PACK needs one node for all {pool.slots} bundles, none has the room"
    elif sum(_capacity(n, pool.bundle) for n in fits) < pool.slots:
        problem = f"the nodes that fit hold {sum(_capacity(n, pool.bundle) for n in fits)} bundles in all"
    if problem:
        raise PlacementUnsatisfiable(pool=pool.name, asked=pool.describe(), cluster=describe_cluster(nodes),
                                     problem=problem)


def label_matches(node_labels: Mapping[str, str], key: str, expr: str) -> bool:
    """Ray's label selector syntax: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``."""
    negate = expr.startswith("!")
    body = expr[1:] if negate else expr
    if body.startswith("in(") and body.endswith(")"):
        allowed = {v.strip() for v in body[3:-1].split(",") if v.strip()}
    else:
        allowed = {body}
    return (node_labels.get(key) in allowed) != negate


def fits_one(node: Mapping[str, Any], bundle: Mapping[str, float], labels: Mapping[str, str]) -> bool:
    if not all(label_matches(node["labels"], k, v) for k, v in labels.items()):
        return False
    return _fits_n(node, bundle, 1)


def _fits_n(node: Mapping[str, Any], bundle: Mapping[str, float], n: int) -> bool:
    return all(node["resources"].get(k, 0.0) + 1e-9 >= v * n for k, v in bundle.items() if v > 0)


def _capacity(node: Mapping[str, Any], bundle: Mapping[str, float]) -> int:
    counts = [int((node["resources"].get(k, 0.0) + 1e-9) // v) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 1 << 30
