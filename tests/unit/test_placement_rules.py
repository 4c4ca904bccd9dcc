"""Placement rules without a cluster: which requests can never be placed, and Ray's label
selector syntax as ftstate reads it (the cluster is given as data)."""

from __future__ import annotations

import dataclasses

import pytest

from ftstate.controller.feasibility import check_feasible, describe_cluster, label_matches
from ftstate.core.config import RolePlacement
from ftstate.core.errors import PlacementUnsatisfiable


def node(i: int, cpus: float, **extra) -> dict:
    labels = extra.pop("labels", {})
    return {"node_id": f"{i:02d}" * 28, "address": "127.0.0.1", "resources": {"CPU": cpus, **extra}, "labels": labels}


NODES = [node(1, 2, node_a=4, labels={"pool": "a"}), node(2, 2, node_b=4, labels={"pool": "b"}),
         node(3, 8, labels={"pool": "b"})]


@dataclasses.dataclass
class Pool:
    name: str
    slots: int
    bundle: dict
    placement: RolePlacement

    def describe(self) -> str:
        return f"pool {self.name!r}: {self.slots} x {self.bundle}"


def pool(slots: int, cpus: float = 1, strategy: str = "SPREAD", labels=None, **resources) -> Pool:
    return Pool("rollout", slots, {"CPU": cpus, **resources},
                RolePlacement(strategy=strategy, resources=resources, labels=labels or {}))


class TestFeasibility:
    def test_what_fits_somewhere_passes(self):
        check_feasible(pool(2), NODES)
        check_feasible(pool(1, node_b=1), NODES)
        check_feasible(pool(2, labels={"pool": "b"}, strategy="STRICT_SPREAD"), NODES)
        check_feasible(pool(8, strategy="STRICT_PACK"), NODES)

    def test_a_resource_no_node_has_is_refused_naming_what_and_where(self):
        with pytest.raises(PlacementUnsatisfiable) as info:
            check_feasible(pool(1, node_z=1), NODES)
        err = info.value
        assert err.problem == "no node can hold even one bundle"
        assert "node_z" in err.asked and "3 alive node(s)" in err.cluster and "node_b=4" in err.cluster

    def test_a_label_no_node_carries_is_refused(self):
        with pytest.raises(PlacementUnsatisfiable, match="no node can hold"):
            check_feasible(pool(1, labels={"pool": "gpu"}), NODES)

    def test_strict_spread_over_more_bundles_than_nodes_is_refused(self):
        with pytest.raises(PlacementUnsatisfiable, match="STRICT_SPREAD needs 3 distinct nodes, 2 can hold"):
            check_feasible(pool(3, labels={"pool": "in(a,b)"}, strategy="STRICT_SPREAD", node_a=0), NODES[:2])

    def test_strict_pack_beyond_the_largest_node_is_refused(self):
        with pytest.raises(PlacementUnsatisfiable, match="STRICT_PACK needs one node for all 9 bundles"):
            check_feasible(pool(9, strategy="STRICT_PACK"), NODES)

    def test_more_bundles_than_the_whole_cluster_holds_is_refused(self):
        with pytest.raises(PlacementUnsatisfiable, match="hold 12 bundles in all"):
            check_feasible(pool(13), NODES)


class TestLabelSelectors:
    @pytest.mark.parametrize(("expr", "value", "match"), [
        ("b", "b", True), ("b", "a", False), ("!b", "a", True), ("!b", "b", False),
        ("in(a,b)", "b", True), ("in(a, b)", "c", False), ("!in(a,b)", "c", True), ("!in(a,b)", "a", False),
        ("b", None, False), ("!b", None, True),
    ])
    def test_rays_syntax(self, expr, value, match):
        labels = {} if value is None else {"pool": value}
        assert label_matches(labels, "pool", expr) is match


def test_the_cluster_is_described_node_by_node_without_rays_internal_resources():
    text = describe_cluster([node(1, 2, node_a=4, memory=1e9, **{"node:127.0.0.1": 1},
                                  labels={"pool": "a", "ray.io/node-id": "01" * 28})])
    assert text.startswith("1 alive node(s): node 01010101 (127.0.0.1): {CPU=2, node_a=4}")
    assert "memory" not in text and "node:127" not in text and "ray.io" not in text and "'pool': 'a'" in text
