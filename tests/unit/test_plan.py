"""The route plan: who reads shared memory and who takes the collective, from the nodes alone."""

from __future__ import annotations

from ftstate.core.plan import COLLECTIVE, SHM, Endpoint, plan_transfer

TRAINER = Endpoint("trainer-0", 0, "node-a")


def rollouts(*nodes: str | None) -> list[Endpoint]:
    return [Endpoint(f"rollout-{i}", i + 1, n) for i, n in enumerate(nodes)]


class TestSameNodeReadsSharedMemory:
    def test_rollouts_on_the_senders_node_read_shared_memory_the_others_take_the_collective(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-b", "node-a", "node-b", "node-c"), "auto")
        assert plan.routes == {"rollout-0": SHM, "rollout-1": COLLECTIVE, "rollout-2": SHM,
                               "rollout-3": COLLECTIVE, "rollout-4": COLLECTIVE}
        assert plan.same_host_ranks == (1, 3) and plan.uses_shm and not plan.require_shm
        assert plan.remote_nodes == {"node-b": ("rollout-1", "rollout-3"), "node-c": ("rollout-4",)}

    def test_off_puts_everyone_on_the_collective_and_uses_no_shared_memory(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-a"), "off")
        assert set(plan.routes.values()) == {COLLECTIVE} and not plan.uses_shm
        assert plan.remote_nodes == {}  # same node, just not through shared memory

    def test_require_is_carried_to_the_sender(self):
        assert plan_transfer(TRAINER, rollouts("node-a"), "require").require_shm


class TestUnknownNodesAreNeverAssumedShared:
    def test_a_member_without_a_node_id_takes_the_collective(self):
        plan = plan_transfer(Endpoint("trainer-0", 0, None), rollouts(None, None), "auto")
        assert set(plan.routes.values()) == {COLLECTIVE} and not plan.uses_shm


class TestTheRecord:
    def test_the_audit_record_names_sender_routes_and_remote_nodes(self):
        plan = plan_transfer(Endpoint("trainer-0", 0, "0123456789abcdef"),
                             [Endpoint("rollout-0", 1, "0123456789abcdef"), Endpoint("rollout-1", 2, "fedcba9876543210")],
                             "auto")
        assert plan.record() == {"sender": "trainer-0", "node": "01234567", "mode": "auto",
                                 "routes": {"rollout-0": SHM, "rollout-1": COLLECTIVE},
                                 "remote_nodes": {"fedcba98": ["rollout-1"]}}

    def test_a_fallback_keeps_the_receivers_and_moves_them_to_the_collective(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-b"), "auto").with_fallback()
        assert plan.routes == {"rollout-0": COLLECTIVE, "rollout-1": COLLECTIVE} and not plan.uses_shm
