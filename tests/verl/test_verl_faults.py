"""Faults inside verl's update: a member that never joins, a replica SIGKILLed mid-update, a dead trainer rank.

Real verl worker groups on the local Ray cluster, real processes killed with SIGKILL; the
moment of the kill is chosen on observed progress (a rollout's server adapter holding part
of the update), never on a sleep.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytestmark = pytest.mark.ray


def wait_until(probe, what: str, timeout_s: float = 60.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def update_in_thread(manager, global_steps: int) -> tuple[threading.Thread, dict[str, object]]:
    """``manager.update_weights(global_steps=...)`` started in a thread, so a test can act on a
    worker mid-update; the result dict gets ``metrics`` or ``error`` once the thread ends."""
    result: dict[str, object] = {}

    def update() -> None:
        try:
            result["metrics"] = manager.update_weights(global_steps=global_steps)
        except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
            result["error"] = exc

    thread = threading.Thread(target=update)
    thread.start()
    return thread, result


def test_init_names_the_member_that_never_joined_within_init_timeout_s(ray_cluster) -> None:
    """The engine alone (no manager): rank 0 and rollout 0 join, rollout 1 never does."""
    from ftstate.core.errors import RendezvousTimeout
    from ftstate.integrations.verl import FTStateCheckpointEngine

    settings = {"init_timeout_s": 2.0, "group": "never-joins"}
    engines = [FTStateCheckpointEngine(1 << 20, is_master=True, **settings),
               FTStateCheckpointEngine(1 << 20, **settings), FTStateCheckpointEngine(1 << 20, **settings)]
    metadata = [e.prepare() for e in engines]
    metadata[2]["pid"] = 424242  # the one that will never come, told apart by its pid
    actor_kwargs, rollout_kwargs = FTStateCheckpointEngine.build_topology(1, 2, metadata)
    kwargs = [{k: v[0] for k, v in actor_kwargs.items()}] + [{k: v[i] for k, v in rollout_kwargs.items()}
                                                               for i in range(2)]
    errors: dict[int, BaseException] = {}

    def join(i: int) -> None:
        try:
            engines[i].init_process_group(**kwargs[i])
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors[i] = exc

    started = time.monotonic()
    threads = [threading.Thread(target=join, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    elapsed = time.monotonic() - started
    assert not any(t.is_alive() for t in threads)
    assert set(errors) == {0, 1}
    for exc in errors.values():
        assert isinstance(exc, RendezvousTimeout)
        assert exc.missing == ("rollout worker 1 (pid 424242 on 127.0.0.1)",), exc.missing
        assert "init_timeout_s" in str(exc) and "pid 424242" in str(exc)
    assert elapsed < 2.0 + 3.0, elapsed


def test_a_rollout_that_never_reaches_init_is_a_typed_error_within_the_deadline_and_nothing_runs_on(
    trainer, rollouts
) -> None:
    import ray

    from ftstate.core.errors import RendezvousTimeout
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.harness import checkpoint_engine_config

    wg, replicas = rollouts
    init_timeout_s = 4.0
    manager = FTStateCheckpointEngineManager(config=checkpoint_engine_config(init_timeout_s=init_timeout_s),
                                             actor_wg=trainer, replicas=list(replicas))
    stuck = wg.workers[1]
    blocked = stuck.block.remote(init_timeout_s + 6)  # its event loop is busy: prepare never starts
    try:
        wait_until(lambda: not ray.wait([blocked], timeout=0.2)[0], "the block to be running")
        started = time.monotonic()
        with pytest.raises(RendezvousTimeout) as info:
            manager.update_weights(global_steps=41)
        elapsed = time.monotonic() - started
        assert init_timeout_s <= elapsed < init_timeout_s + 3.0, elapsed
        assert info.value.missing == ("rollout replica 1 worker 0",), info.value.missing
        assert "init_timeout_s" in str(info.value)
        # nothing left running: the others answer at once and hold no group version
        probe = time.monotonic()
        states = [*trainer.engine_state(), ray.get(wg.workers[0].progress.remote())]
        assert time.monotonic() - probe < 2.0
        assert [s["communicator"] for s in states] == [False, False, False], states
        assert manager.group is not None and manager.group.state == "FAILED"
        assert manager.states()["rollout replica 1 worker 0"] == "LOST"
        expired = [r for r in manager.audit.records if r["event"] == "deadline_expired"]
        assert expired and expired[0]["key"] == "init_timeout_s"
        assert expired[0]["missing"] == ["rollout replica 1 worker 0"]
        from ftstate.core.audit_check import assert_trail_valid

        assert_trail_valid(manager.audit.records)
    finally:
        manager.close()
        ray.get(blocked)
    # once it is free, a new manager updates everyone (the late prepare was harmless)
    trainer.train_step(42)
    again = FTStateCheckpointEngineManager(config=checkpoint_engine_config(), actor_wg=trainer, replicas=list(replicas))
    try:
        again.update_weights(global_steps=42)
    finally:
        again.close()
    want = trainer.full_digests()[0]
    assert wg.digests() == [want, want]


def test_a_replica_sigkilled_mid_update_is_removed_and_the_update_completes_for_the_survivor(
    ray_cluster, trainer, tiny_model
) -> None:
    import ray

    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.conftest import kill_group
    from tests.verl.harness import checkpoint_engine_config, rollout_replicas

    ce = checkpoint_engine_config(init_timeout_s=30, sync_timeout_s=60)
    wg, replicas = rollout_replicas(tiny_model, ce)
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        trainer.train_step(51)
        manager.update_weights(global_steps=51)
        victim, survivor = wg.workers[1], wg.workers[0]
        ray.get(victim.pause_after.remote(5))
        trainer.train_step(52)
        thread, result = update_in_thread(manager, 52)
        progress = wait_until(lambda: (p := ray.get(victim.progress.remote()))["paused"] and p, "the victim mid-update")
        assert progress["in_update"] == 5  # it holds part of the update
        os.kill(progress["pid"], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert "error" not in result, result.get("error")
        assert result["metrics"]["ftstate/replicas_removed"] == 1
        want = trainer.full_digests()[0]
        assert ray.get(survivor.digests.remote()) == want
        assert manager.replicas == [replicas[0]] and manager.serving_replicas() == [replicas[0]]
        assert manager.states()["rollout replica 1 worker 0"] == "RETIRED"
        assert manager.states()["rollout replica 0 worker 0"] == "READY"
        assert [r["replica"] for r in manager.removed] == [1]
        removed = [r for r in manager.audit.records if r["event"] == "replica_removed"]
        assert removed and "rollout replica 1 worker 0" in removed[0]["workers"]
        assert manager.budget.spent == 1
        # and the run goes on with the survivor
        trainer.train_step(53)
        manager.update_weights(global_steps=53)
        assert ray.get(survivor.digests.remote()) == trainer.full_digests()[0]
        # verl adds a replacement: it serves only once it verified a complete update
        new_wg, (replacement,) = rollout_replicas(tiny_model, ce, replicas=1)
        replacement.replica_rank = 2
        manager.add_replicas([replacement])
        assert manager.serving_replicas() == [replicas[0]]
        trainer.train_step(54)
        manager.update_weights(global_steps=54)
        assert manager.serving_replicas() == [replicas[0], replacement]
        assert new_wg.digests() == [trainer.full_digests()[0]]
        path = [r["to"] for r in manager.audit.records
                if r.get("member") == "rollout replica 2 worker 0" and r["event"] == "transition"]
        assert path == ["RENDEZVOUS", "STALE", "RESYNCING", "RESYNCED", "READY"], path
        from ftstate.core.audit_check import assert_trail_valid

        assert_trail_valid(manager.audit.records)
    finally:
        manager.close()
        kill_group(ray_cluster, wg)
        if "new_wg" in locals():
            kill_group(ray_cluster, new_wg)


def test_a_dead_trainer_rank_is_member_lost_naming_it_never_a_hang(ray_cluster, tiny_model, rollouts) -> None:
    import ray

    from ftstate.core.errors import MemberLost
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.conftest import kill_group
    from tests.verl.harness import checkpoint_engine_config, trainer_group

    # init_timeout_s leaves room for the new trainer group to start on a loaded machine (20 s
    # was once too short in CI); the loss itself must still surface well before it (< 20 s).
    ce = checkpoint_engine_config(init_timeout_s=45, sync_timeout_s=30)
    doomed = trainer_group(tiny_model, ce)
    _, replicas = rollouts
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=doomed, replicas=list(replicas))
    try:
        manager.update_weights(global_steps=61)
        pid = ray.get(doomed.workers[1].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(MemberLost, match="trainer rank 1"):
            manager.update_weights(global_steps=62)
        assert time.monotonic() - started < 20
        assert manager.states()["trainer rank 1"] == "LOST"
    finally:
        manager.close()
        kill_group(ray_cluster, doomed)


def test_a_loss_past_max_failovers_is_budget_exhausted_naming_it(ray_cluster, trainer, tiny_model) -> None:
    import ray

    from ftstate.core.errors import FailoverBudgetExhausted
    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.conftest import kill_group
    from tests.verl.harness import checkpoint_engine_config, rollout_replicas

    ce = checkpoint_engine_config(init_timeout_s=30, sync_timeout_s=60, fault_tolerance={"max_failovers": 0})
    wg, replicas = rollout_replicas(tiny_model, ce)
    manager = FTStateCheckpointEngineManager(config=ce, actor_wg=trainer, replicas=list(replicas))
    try:
        manager.update_weights(global_steps=71)
        os.kill(ray.get(wg.workers[1].progress.remote())["pid"], signal.SIGKILL)
        with pytest.raises(FailoverBudgetExhausted, match=r"by rollout replica 1 worker 0: max_failovers=0"):
            manager.update_weights(global_steps=72)
        assert manager.group is not None and manager.group.state == "FAILED"
        assert manager.removed == []
    finally:
        manager.close()
        kill_group(ray_cluster, wg)
