"""``commit_mode: staged`` holds each update once per node, not once per rollout worker.

Two rollout replicas of verl's ``CheckpointEngineWorker`` on the one Ray node of the local
cluster: the first is the node's writer (in the gloo group, it copies each verified chunk into
``/dev/shm``), the second its follower (out of the group, it maps the node's copy after the
vote). Real processes, real verl; the moment of a kill is chosen on observed progress (a
member holding part of the update), never on a sleep.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.verl.test_verl_faults import update_in_thread, wait_until

pytestmark = pytest.mark.ray

GROUP = "verl-weights"


def staged_bytes() -> tuple[int, set[int]]:
    """Bytes of every staged segment of the weight group in /dev/shm, and their writers' pids."""
    from ftstate.integrations.verl import nodestage
    from ftstate.transport.nodecopy import segment_bytes
    from ftstate.transport.shm import parse_name

    names = nodestage.segments_of(GROUP)
    return sum(segment_bytes(n) for n in names), {int(parse_name(n)["pid"]) for n in names}


def test_two_rollouts_on_one_node_get_bit_identical_weights_from_one_node_copy(ray_cluster, trainer, tiny_model) -> None:
    import ray

    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.conftest import kill_group
    from tests.verl.harness import checkpoint_engine_config, rollout_replicas

    ce = checkpoint_engine_config(commit_mode="staged", init_timeout_s=30, sync_timeout_s=60)
    wg, replicas = rollout_replicas(tiny_model, ce)
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        trainer.train_step(81)
        metrics = manager.update_weights(global_steps=81)
        payload = metrics["ftstate/bytes"]
        writer, follower = (ray.get(w.progress.remote()) for w in wg.workers)
        assert (writer["node_role"], follower["node_role"]) == ("writer", "follower")
        assert follower["rank"] == -1 and not follower["communicator"]  # out of the gloo group
        assert follower["chunks_in"] == metrics["ftstate/chunks"] >= 2  # it mapped every chunk
        # the next update, held mid-way: the follower has begun yielding, so the node's copy is
        # complete and voted on, and no one has finalized yet
        ray.get(wg.workers[1].pause_after.remote(3))
        trainer.train_step(82)
        thread, result = update_in_thread(manager, 82)
        try:
            wait_until(lambda: ray.get(wg.workers[1].progress.remote())["paused"], "the follower mid-update")
            held, writers = staged_bytes()
        finally:
            ray.get(wg.workers[1].release.remote())
            thread.join(timeout=60)
        assert "error" not in result, result.get("error")
        # one copy on the node, written by the writer alone (slack: a header page per chunk)
        assert writers == {writer["pid"]}, writers
        assert payload <= held < 1.1 * payload, (held, payload)
        # both rollouts hold the trainer's weights, bit for bit, and ftstate's checksum agrees
        want = trainer.full_digests()[0]
        assert wg.digests() == [want, want]
        assert wg.state_checksum() == [trainer.state_checksum()[0]] * 2
        assert staged_bytes() == (0, set()), "the node's copy outlived the update"
        from ftstate.core.audit_check import assert_trail_valid

        assert_trail_valid(manager.audit.records)
    finally:
        manager.close()
        kill_group(ray_cluster, wg)


@pytest.mark.parametrize("victim_index", [0, 1], ids=["writer", "follower"])
def test_a_rollout_sigkilled_mid_staged_update_fails_it_naming_it_and_no_rollout_yields_anything(
    ray_cluster, trainer, tiny_model, victim_index
) -> None:
    """The writer (in the group, holding part of the node's copy) or its follower (waiting for
    the vote) is SIGKILLed while the writer holds part of the update; with no failover budget
    the update fails naming it, the other rollout yielded nothing, and /dev/shm is clean."""
    import ray

    from ftstate.core.errors import FailoverBudgetExhausted
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.conftest import kill_group
    from tests.verl.harness import checkpoint_engine_config, rollout_replicas

    ce = checkpoint_engine_config(commit_mode="staged", init_timeout_s=30, sync_timeout_s=60,
                                  fault_tolerance={"max_failovers": 0})
    wg, replicas = rollout_replicas(tiny_model, ce)
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        trainer.train_step(91)
        manager.update_weights(global_steps=91)
        before = trainer.full_digests()[0]
        writer = wg.workers[0]
        victim, survivor = wg.workers[victim_index], wg.workers[1 - victim_index]
        ray.get(writer.execute_checkpoint_engine.remote("stall_after_chunks", 2, 30.0))
        trainer.train_step(92)
        thread, result = update_in_thread(manager, 92)
        progress = wait_until(lambda: (p := ray.get(writer.progress.remote()))["stalled"] and p,
                              "the writer holding part of the update")
        assert progress["node_role"] == "writer" and progress["staged_bytes"] > 0  # chunks in /dev/shm
        assert staged_bytes()[0] > 0
        victim_pid = ray.get(victim.progress.remote())["pid"]
        os.kill(victim_pid, signal.SIGKILL)
        if victim_index == 1:
            # on to the vote once the follower is gone (a death after the writer's check is a
            # rollout dying after the vote: the others may have applied the update)
            from ftstate.transport.shm import pid_alive

            wait_until(lambda: not pid_alive(victim_pid), "the follower to be dead")
            ray.get(writer.execute_checkpoint_engine.remote("unstall"))
        thread.join(timeout=60)
        assert not thread.is_alive()
        error = result.get("error")
        assert isinstance(error, FailoverBudgetExhausted), error
        name = f"rollout replica {victim_index} worker 0"
        assert name in str(error)
        # the other rollout yielded nothing and still holds the previous update, whole
        assert ray.get(survivor.yielded.remote()) == []
        assert ray.get(survivor.digests.remote()) == before
        assert staged_bytes() == (0, set()), "a SIGKILLed writer's segments were left in /dev/shm"
        assert manager.states()[name] == "LOST"
    finally:
        manager.close()
        kill_group(ray_cluster, wg)


class TestTheTopologyNamesOneWriterPerNode:
    """``build_topology``'s node roles, from the workers' metadata alone (no Ray, no processes)."""

    @staticmethod
    def meta(pid: int, node: str, mode: str = "staged") -> dict:
        return {"pid": pid, "host": "10.0.0.1", "node": node, "commit_mode": mode}

    def test_the_first_staged_rollout_of_each_node_writes_and_the_others_follow_it(self) -> None:
        from ftstate.integrations.verl.engine import _stages

        ranks, stages = _stages([self.meta(11, "a"), self.meta(12, "b"), self.meta(13, "a"), self.meta(14, "a")])
        assert ranks == [1, 2, -1, -1]  # one group rank per node, the followers out of the group
        assert [s["role"] for s in stages] == ["writer", "writer", "follower", "follower"]
        assert [f["pid"] for f in stages[0]["followers"]] == [13, 14] and stages[1]["followers"] == []
        assert {s["writer_pid"] for s in stages[2:]} == {11}
        assert stages[2]["writer"] == "rollout worker 0 (pid 11 on 10.0.0.1)"

    def test_a_stream_rollout_keeps_its_own_rank_and_no_node_role(self) -> None:
        from ftstate.integrations.verl.engine import _stages

        ranks, stages = _stages([self.meta(11, "a", "stream"), self.meta(12, "a"), self.meta(13, "a")])
        assert ranks == [1, 2, -1] and stages[0] is None
        assert stages[1]["role"] == "writer" and stages[2]["writer_pid"] == 12

    def test_build_topology_sizes_the_group_to_the_trainer_and_the_writers(self) -> None:
        from ftstate.integrations.verl import FTStateCheckpointEngine

        trainer = {"pid": 1, "host": "10.0.0.1", "is_master": True, "commit_mode": "staged",
                   "settings": {"commit_mode": "staged", "group": "topology-only",
                                "security": {"authenticate": False, "integrity": "xxh3"}}}
        actor, rollout = FTStateCheckpointEngine.build_topology(
            1, 3, [trainer, self.meta(11, "a"), self.meta(12, "a"), self.meta(13, "b")])
        assert rollout["rank"] == [1, -1, 2] and rollout["world_size"] == [3, 3, 3]
        assert rollout["members"][0] == ["trainer rank 0 (pid 1 on 10.0.0.1)", "rollout worker 0 (pid 11 on 10.0.0.1)",
                                         "rollout worker 2 (pid 13 on 10.0.0.1)"]
        assert actor["rank"] == [0]



class TestTheOutcomeRecordIsTheWritersOwn:
    """A follower believes the node's outcome record only when it carries the run key's tag for
    its writer: anyone who can write ``/dev/shm`` could otherwise plant a record naming chunks
    and checksums of their choosing (docs/security.md). In one process: this test is both the
    writer (a chunk landed in a real segment, as :class:`NodeReceiver` lands it) and the follower."""

    GROUP = "outcome-auth"

    @pytest.fixture(autouse=True)
    def run_key(self):
        from ftstate.integrations.verl import nodestage
        from ftstate.transport import auth

        self.writers = []
        auth.install("outcome-auth-run", auth.new_secret())
        yield
        auth.uninstall()
        for w in self.writers:
            w.close()
        assert nodestage.segments_of(self.GROUP) == []

    def publish(self, version: int) -> None:
        import types

        import torch

        from ftstate.integrations.verl import nodestage
        from ftstate.transport import state_checksum
        from ftstate.transport.buckets import plan_layout

        weights = {"w": torch.arange(1024, dtype=torch.float32)}
        entries, _, total = plan_layout([("w", "float32", (1024,))], 1 << 20)
        writer = nodestage.StageWriter(self.GROUP, version)
        self.writers.append(writer)
        landed = writer.segment(total)
        landed.copy_(weights["w"].view(torch.uint8))
        writer.add(types.SimpleNamespace(entries=entries, flat=landed, state_checksum=state_checksum(weights)))
        writer.publish(nodestage.OK)

    def follow(self, version: int) -> list:
        import time

        from ftstate.integrations.verl import nodestage

        return nodestage.wait_and_map(self.GROUP, version, writer_pid=os.getpid(), writer="the writer", me="follower",
                                      deadline=time.monotonic() + 5, timeout_s=5, abandoned=lambda: None)

    def test_the_writers_signed_record_is_followed(self) -> None:
        self.publish(1)
        (tensors,) = self.follow(1)
        assert tensors["w"].tolist() == list(range(1024))

    def test_a_record_planted_without_the_key_is_refused_and_recorded(self) -> None:
        import msgpack

        from ftstate.core.errors import ManifestError
        from ftstate.integrations.verl import nodestage
        from ftstate.transport import auth
        from ftstate.transport.nodecopy import NodeCopy
        from ftstate.transport.shm import SHM_DIR

        self.publish(2)
        name = nodestage.outcome_name(self.GROUP, 2, os.getpid())
        genuine = NodeCopy.attach(name, group=nodestage.stage_group(self.GROUP), owner=os.getpid(), group_version=2,
                                  writer=os.getpid())
        body = msgpack.unpackb(bytes(genuine.manifest)[:-auth.TAG_BYTES])  # the same record, its tag dropped
        genuine.close()
        planted = NodeCopy.create(nodestage.stage_group(self.GROUP), group_version=2, owner=os.getpid(),
                                  weights_version=0, manifest=msgpack.packb(body), data_bytes=0)
        os.rename(SHM_DIR / planted.name, SHM_DIR / name)  # over the genuine one, as an attacker would
        planted.close()
        auth.drain_forged()
        with pytest.raises(ManifestError, match="does not authenticate") as info:
            self.follow(2)
        assert info.value.field == "outcome"
        assert [f["channel"] for f in auth.drain_forged()] == [nodestage.OUTCOME_CHANNEL]
