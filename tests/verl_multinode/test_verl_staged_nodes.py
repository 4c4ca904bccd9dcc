"""``commit_mode: staged`` across nodes: one copy of each update per node, on every node.

verl's trainer group (2 ranks) on one node of a three-node Ray cluster, its rollout pool
``[2, 2]`` on the other two: each rollout node's first rollout is its writer (in the gloo
group, it receives each chunk straight into that node's ``/dev/shm`` copy and verifies it
there), the other its follower (out of the group, it maps that node's copy after the vote).
Real processes and real verl; the nodes are raylets of this machine, so their ``/dev/shm`` is
one folder and the copies are told apart by their writer's pid in the name. The moment of
the mid-update look is chosen on observed progress (both followers paused mid-yield), never
on a sleep.
"""

from __future__ import annotations

import pytest

from tests.verl.test_verl_faults import update_in_thread, wait_until
from tests.verl.test_verl_staged import staged_bytes

pytestmark = pytest.mark.ray


def nodes_of(wg) -> set[str]:
    """The nodes verl's placement groups put a worker group's bundles on."""
    import ray

    return {node for pg in wg.ftstate_pool.pgs
            for node in ray.util.placement_group_table(pg)["bundles_to_node_id"].values()}


def test_each_rollout_node_holds_one_copy_written_by_its_writer_and_every_rollout_gets_the_weights(
        cluster, tiny_model) -> None:
    import ray

    from ftstate.core.audit_check import assert_trail_valid
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.harness import checkpoint_engine_config, release, rollout_replicas, trainer_group

    ce = checkpoint_engine_config(commit_mode="staged", init_timeout_s=60, sync_timeout_s=90)
    trainer = trainer_group(tiny_model, ce)
    trainer.engine_state()  # both ranks placed (on one node) before the rollouts' pool asks
    wg, replicas = rollout_replicas(tiny_model, ce, nodes=[2, 2])
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        [trainer_node] = nodes_of(trainer)
        rollout_nodes = nodes_of(wg)
        assert len(rollout_nodes) == 2 and trainer_node not in rollout_nodes, (trainer_node, rollout_nodes)

        trainer.train_step(81)
        metrics = manager.update_weights(global_steps=81)
        payload = metrics["ftstate/bytes"]
        progress = [ray.get(w.progress.remote(), timeout=60) for w in wg.workers]
        by_node: dict[str, list[dict]] = {}
        for p in progress:
            by_node.setdefault(p["node_id"], []).append(p)
        assert set(by_node) == rollout_nodes
        for node, workers in by_node.items():  # one writer in the group and one follower per node
            roles = sorted(p["node_role"] for p in workers)
            assert roles == ["follower", "writer"], (node, workers)
            follower = next(p for p in workers if p["node_role"] == "follower")
            assert follower["rank"] == -1 and not follower["communicator"]
            assert follower["chunks_in"] == metrics["ftstate/chunks"] >= 2
        writers = {p["pid"] for p in progress if p["node_role"] == "writer"}

        # the next update held mid-way on both nodes: each follower has begun yielding, so both
        # nodes' copies are complete and voted on, and nobody has finalized yet
        followers = [w for w, p in zip(wg.workers, progress, strict=True) if p["node_role"] == "follower"]
        ray.get([w.pause_after.remote(3) for w in followers], timeout=60)
        trainer.train_step(82)
        thread, result = update_in_thread(manager, 82)
        try:
            wait_until(lambda: all(ray.get(w.progress.remote(), timeout=60)["paused"] for w in followers),
                       "both followers mid-update", timeout_s=120)
            held, writing = staged_bytes()
        finally:
            ray.get([w.release.remote() for w in followers], timeout=60)
            thread.join(timeout=120)
        assert "error" not in result, result.get("error")
        # one copy per node, each written by that node's writer alone (slack: a header page a chunk)
        assert writing == writers, (writing, writers)
        assert 2 * payload <= held < 2.2 * payload, (held, payload)
        # all four rollouts hold the trainer's weights, bit for bit, and ftstate's checksum agrees
        want = trainer.full_digests()[0]
        assert wg.digests() == [want] * 4
        assert wg.state_checksum() == [trainer.state_checksum()[0]] * 4
        assert staged_bytes() == (0, set()), "a node's copy outlived the update"
        assert_trail_valid(manager.audit.records)
    finally:
        manager.close()
        release(wg)
        release(trainer)


def test_a_writer_sigkilled_on_one_node_fails_the_update_and_no_rollout_on_either_node_yields(
        cluster, tiny_model) -> None:
    """One node's writer is SIGKILLed while it holds part of its node's copy; with no failover
    budget the update fails naming it, and neither that node's follower nor the other node's
    two rollouts yielded anything: they hold the previous update, whole; /dev/shm is clean."""
    import os
    import signal

    import ray

    from ftstate.core.errors import FailoverBudgetExhausted
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.harness import checkpoint_engine_config, release, rollout_replicas, trainer_group

    ce = checkpoint_engine_config(commit_mode="staged", init_timeout_s=60, sync_timeout_s=90,
                                  fault_tolerance={"max_failovers": 0})
    trainer = trainer_group(tiny_model, ce)
    trainer.engine_state()
    wg, replicas = rollout_replicas(tiny_model, ce, nodes=[2, 2])
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        trainer.train_step(91)
        manager.update_weights(global_steps=91)
        before = trainer.full_digests()[0]
        progress = [ray.get(w.progress.remote(), timeout=60) for w in wg.workers]
        victim_index = next(i for i, p in enumerate(progress) if p["node_role"] == "writer")
        victim = wg.workers[victim_index]
        ray.get(victim.execute_checkpoint_engine.remote("stall_after_chunks", 2, 60.0))
        trainer.train_step(92)
        thread, result = update_in_thread(manager, 92)
        wait_until(lambda: ray.get(victim.progress.remote(), timeout=60)["stalled"], "the writer holding part of the update")
        assert staged_bytes()[0] > 0
        os.kill(progress[victim_index]["pid"], signal.SIGKILL)
        thread.join(timeout=120)
        assert not thread.is_alive()
        error = result.get("error")
        assert isinstance(error, FailoverBudgetExhausted), error
        name = f"rollout replica {victim_index} worker 0"
        assert name in str(error)
        survivors = [w for i, w in enumerate(wg.workers) if i != victim_index]
        for w in survivors:  # on both nodes: nothing yielded, the previous update whole
            assert ray.get(w.yielded.remote(), timeout=60) == []
            assert ray.get(w.digests.remote(), timeout=60) == before
        assert staged_bytes() == (0, set()), "a node's segments were left in /dev/shm"
        assert manager.states()[name] == "LOST"
    finally:
        manager.close()
        release(wg)
        release(trainer)
