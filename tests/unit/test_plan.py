"""The route plan: who reads shared memory, who takes the collective and who relays, from the nodes alone."""

from __future__ import annotations

from ftstate.core.plan import COLLECTIVE, RELAY, SHM, Endpoint, plan_transfer

TRAINER = Endpoint("trainer-0", 0, "node-a")


def rollouts(*nodes: str | None) -> list[Endpoint]:
    return [Endpoint(f"rollout-{i}", i + 1, n) for i, n in enumerate(nodes)]


class TestSameNodeReadsSharedMemory:
    def test_rollouts_on_the_senders_node_read_shared_memory_the_others_take_the_collective(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-b", "node-a", "node-c"), "auto")
        assert plan.routes == {"rollout-0": SHM, "rollout-1": COLLECTIVE, "rollout-2": SHM, "rollout-3": COLLECTIVE}
        assert plan.same_host_ranks == (1, 3) and plan.uses_shm and not plan.require_shm
        assert plan.remote_nodes == {"node-b": ("rollout-1",), "node-c": ("rollout-3",)}
        assert plan.relays == {}

    def test_off_puts_everyone_on_the_collective_and_uses_no_shared_memory(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-a"), "off")
        assert set(plan.routes.values()) == {COLLECTIVE} and not plan.uses_shm
        assert plan.remote_nodes == {}  # same node, just not through shared memory

    def test_require_is_carried_to_the_sender(self):
        assert plan_transfer(TRAINER, rollouts("node-a"), "require").require_shm


class TestOneCopyPerRemoteNode:
    def test_the_lowest_rank_on_a_remote_node_relays_to_its_node_peers(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-b", "node-a", "node-b", "node-c", "node-b"), "auto")
        assert plan.routes == {"rollout-0": SHM, "rollout-1": COLLECTIVE, "rollout-2": SHM,
                               "rollout-3": RELAY, "rollout-4": COLLECTIVE, "rollout-5": RELAY}
        assert plan.relays == {"rollout-1": ("rollout-3", "rollout-5")}
        assert plan.relay_ranks == ((2, (4, 6)),)
        assert plan.same_host_ranks == (1, 3)

    def test_the_relay_is_chosen_by_rank_not_by_the_order_given(self):
        given = [Endpoint("rollout-9", 9, "node-b"), Endpoint("rollout-2", 2, "node-b"), Endpoint("rollout-5", 5, "node-b")]
        plan = plan_transfer(TRAINER, given, "auto")
        assert plan.relays == {"rollout-2": ("rollout-5", "rollout-9")}
        assert plan.routes == {"rollout-9": RELAY, "rollout-2": COLLECTIVE, "rollout-5": RELAY}

    def test_every_remote_node_with_two_receivers_has_its_own_relay(self):
        plan = plan_transfer(TRAINER, rollouts("node-b", "node-c", "node-b", "node-c"), "auto")
        assert plan.relay_ranks == ((1, (3,)), (2, (4,)))
        assert plan.uses_shm and plan.same_host_ranks == ()

    def test_one_receiver_on_a_remote_node_takes_the_collective_without_a_relay(self):
        plan = plan_transfer(TRAINER, rollouts("node-b", "node-c"), "auto")
        assert set(plan.routes.values()) == {COLLECTIVE} and plan.relays == {} and not plan.uses_shm

    def test_off_relays_nothing(self):
        plan = plan_transfer(TRAINER, rollouts("node-b", "node-b", "node-b"), "off")
        assert set(plan.routes.values()) == {COLLECTIVE} and plan.relays == {} and not plan.uses_shm

    def test_require_is_carried_to_the_relays(self):
        plan = plan_transfer(TRAINER, rollouts("node-b", "node-b"), "require")
        assert plan.require_shm and plan.relay_ranks == ((1, (2,)),)


class TestUnknownNodesAreNeverAssumedShared:
    def test_a_member_without_a_node_id_takes_the_collective(self):
        plan = plan_transfer(Endpoint("trainer-0", 0, None), rollouts(None, None), "auto")
        assert set(plan.routes.values()) == {COLLECTIVE} and not plan.uses_shm

    def test_receivers_without_a_node_id_never_relay_to_each_other(self):
        plan = plan_transfer(TRAINER, rollouts(None, None, None), "auto")
        assert set(plan.routes.values()) == {COLLECTIVE} and plan.relays == {}


class TestTheRecord:
    def test_the_audit_record_names_sender_routes_and_remote_nodes(self):
        plan = plan_transfer(Endpoint("trainer-0", 0, "0123456789abcdef"),
                             [Endpoint("rollout-0", 1, "0123456789abcdef"), Endpoint("rollout-1", 2, "fedcba9876543210")],
                             "auto")
        assert plan.record() == {"sender": "trainer-0", "node": "01234567", "mode": "auto",
                                 "routes": {"rollout-0": SHM, "rollout-1": COLLECTIVE},
                                 "remote_nodes": {"fedcba98": ["rollout-1"]}, "relays": {}}

    def test_the_audit_record_names_each_relay_its_node_and_its_peers(self):
        plan = plan_transfer(TRAINER, [Endpoint("rollout-0", 1, "fedcba9876543210"),
                                       Endpoint("rollout-1", 2, "fedcba9876543210")], "auto")
        record = plan.record()
        assert record["relays"] == {"fedcba98": {"relay": "rollout-0", "peers": ["rollout-1"]}}
        assert record["routes"] == {"rollout-0": COLLECTIVE, "rollout-1": RELAY}

    def test_a_fallback_keeps_the_receivers_and_moves_them_to_the_collective(self):
        plan = plan_transfer(TRAINER, rollouts("node-a", "node-b"), "auto").with_fallback()
        assert plan.routes == {"rollout-0": COLLECTIVE, "rollout-1": COLLECTIVE} and not plan.uses_shm
