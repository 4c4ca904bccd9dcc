"""verl 0.9.1 loads backend "ftstate" by name and its updates arrive bit-equal, with either manager.

Trainer: a verl ``Worker`` holding a tiny Qwen2, sharded over 2 ranks (rank 1 is out of the
weight group and drains the generator, whose every tensor is an all-gather across the
trainer ranks). Rollout: 2 replicas of verl's ``CheckpointEngineWorker`` with a recording
server adapter (the only mock: no inference engine on CPU).
"""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.ray


def trainer_digests(trainer) -> dict[str, str]:
    return trainer.full_digests()[0]


def assert_every_rollout_holds(trainer, wg) -> dict[str, str]:
    want = trainer_digests(trainer)
    for i, got in enumerate(wg.digests()):
        assert got == want, f"rollout worker {i}: {sorted(n for n in want if got.get(n) != want[n])[:3]} differ"
    return want


def three_updates(manager, trainer, wg, first_step: int) -> list[dict[str, str]]:
    seen = []
    for step in range(first_step, first_step + 3):
        trainer.train_step(step)
        metrics = manager.update_weights(global_steps=step)
        assert metrics["ftstate/chunks"] >= 2, metrics  # several verified chunks per update
        seen.append(assert_every_rollout_holds(trainer, wg))
    for before, after in itertools.pairwise(seen):
        assert all(before[n] != after[n] for n in before), "an update left a tensor unchanged"
    return seen


def test_verls_own_manager_runs_three_bit_equal_updates_over_backend_ftstate(trainer, rollouts) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager

    from tests.verl.harness import checkpoint_engine_config

    wg, replicas = rollouts
    manager = CheckpointEngineManager(checkpoint_engine_config(), trainer, list(replicas))
    from ftstate.integrations.verl import FTStateCheckpointEngine

    assert manager.backend_cls is FTStateCheckpointEngine
    walked = [e["tensors_walked"] for e in trainer.engine_state()]
    three_updates(manager, trainer, wg, first_step=1)
    states = trainer.engine_state()
    assert [e["rank"] for e in states] == [0, -1]
    # rank -1 walked the generator as far as rank 0 (each tensor is an all-gather of both)
    assert states[0]["tensors_walked"] - walked[0] == states[1]["tensors_walked"] - walked[1] > 0
    assert all(not e["communicator"] for e in states)  # finalize released the group


def test_ftstate_manager_runs_three_bit_equal_updates_and_every_worker_ends_ready(trainer, rollouts) -> None:
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.harness import checkpoint_engine_config

    wg, replicas = rollouts
    manager = FTStateCheckpointEngineManager(config=checkpoint_engine_config(), actor_wg=trainer,
                                             replicas=list(replicas))
    try:
        three_updates(manager, trainer, wg, first_step=11)
        assert set(manager.states().values()) == {"READY"}, manager.states()
        assert manager.serving_replicas() == list(replicas)
        records = manager.audit.records
        # one run, named in every record, opened by what started
        assert records[0]["event"] == "run_start" and records[0]["integration"] == "verl"
        assert records[0]["run"] == manager.run_id and records[0]["versions"]["ftstate"]
        assert {r.get("run") for r in records} == {manager.run_id}
        # the driver's secret reached the workers through verl's own calls (security.authenticate)
        from ftstate.transport import auth

        runs = {e["authenticated_run"] for e in trainer.engine_state() if e["rank"] == 0}
        assert auth.current() is not None and runs == {auth.current().run}, runs
        # a new rollout reached READY only through RESYNCED
        first = [r["to"] for r in records if r.get("member") == "rollout replica 0 worker 0" and r["event"] == "transition"]
        assert first[:6] == ["RENDEZVOUS", "STALE", "RESYNCING", "RESYNCED", "READY", "SYNCING"], first
        groups = [r for r in records if r.get("machine") == "group" and r.get("to") == "STOPPED"]
        versions = [r["group_version"] for r in groups]
        assert len(versions) == 3 and versions == sorted(set(versions)), versions  # a new version per update
        from ftstate.core.audit_check import assert_trail_valid

        assert_trail_valid(records)  # every transition legal, READY only through RESYNCED, no stale serving
    finally:
        manager.close()


def test_a_corrupted_chunk_is_never_yielded_and_the_update_fails_naming_the_rollout(trainer, rollouts) -> None:
    import ray

    from ftstate.core.errors import ChecksumMismatch
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.harness import checkpoint_engine_config

    wg, replicas = rollouts
    manager = FTStateCheckpointEngineManager(config=checkpoint_engine_config(), actor_wg=trainer,
                                             replicas=list(replicas))
    try:
        trainer.train_step(21)
        ray.get(wg.workers[1].execute_checkpoint_engine.remote("corrupt_next_bucket", 2))
        with pytest.raises(ChecksumMismatch, match=r"rejected by rollout worker 1 .*chunk 3"):
            manager.update_weights(global_steps=21)
        want = trainer_digests(trainer)
        clean, corrupted = (ray.get(w.yielded.remote()) for w in wg.workers)
        assert [n for n, _ in clean] == list(want) and all(want[n] == d for n, d in clean)
        # the corrupted rollout yielded the two verified chunks before it, bit-equal, and nothing after
        assert 0 < len(corrupted) < len(want), len(corrupted)
        assert all(want[n] == d for n, d in corrupted)
        assert manager.states()["rollout replica 1 worker 0"] == "STALE"
        assert manager.serving_replicas() == [replicas[0]]
        # the next update repairs it: complete and verified again, and it serves again
        trainer.train_step(22)
        manager.update_weights(global_steps=22)
        assert_every_rollout_holds(trainer, wg)
        assert manager.serving_replicas() == list(replicas)
        from ftstate.core.audit_check import assert_trail_valid

        assert_trail_valid(manager.audit.records)
    finally:
        manager.close()


def test_staged_mode_yields_nothing_anywhere_until_every_rollout_verified_everything(
    ray_cluster, trainer, tiny_model
) -> None:
    import ray

    from ftstate.core.errors import ChecksumMismatch
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.conftest import kill_group
    from tests.verl.harness import checkpoint_engine_config, rollout_replicas

    ce = checkpoint_engine_config(commit_mode="staged", init_timeout_s=30, sync_timeout_s=60)
    wg, replicas = rollout_replicas(tiny_model, ce)
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        trainer.train_step(31)
        manager.update_weights(global_steps=31)
        before = assert_every_rollout_holds(trainer, wg)
        trainer.train_step(32)
        ray.get(wg.workers[0].execute_checkpoint_engine.remote("corrupt_next_bucket", 3))
        with pytest.raises(ChecksumMismatch, match="rollout worker 0"):
            manager.update_weights(global_steps=32)
        assert [ray.get(w.yielded.remote()) for w in wg.workers] == [[], []]
        assert wg.digests() == [before, before]  # both still hold the previous update, whole
        # the node's copy (one writer, one follower) is gone with the failed update
        from ftstate.integrations.verl import nodestage

        assert nodestage.segments_of("verl-weights") == []
        roles = [ray.get(w.progress.remote())["node_role"] for w in wg.workers]
        assert roles == ["writer", "follower"], roles
        assert set(manager.states().values()) == {"READY"}  # all-or-nothing: both serve the previous one
        manager.update_weights(global_steps=33)
        assert_every_rollout_holds(trainer, wg)
        from ftstate.core.audit_check import assert_trail_valid

        assert_trail_valid(manager.audit.records)
    finally:
        manager.close()
        kill_group(ray_cluster, wg)
