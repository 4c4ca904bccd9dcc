"""ftstate inside verl, end to end on one CPU machine: three weight updates, then a replica dies.

Run it from the repository root in the verl venv (``make test-verl`` builds it and runs this
file as one of its tests)::

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONPATH=. .venv-verl/bin/python docs/examples/verl_update.py

The worker groups are verl's own (``RayWorkerGroup``, ``CheckpointEngineWorker``,
``RolloutReplica``); the trainer and the server adapter are the test suite's CPU stand-ins
(``tests/verl/harness.py``: a verl ``Worker`` holding a tiny Qwen2 sharded over 2 ranks, and
an adapter that records what it is given). In a verl job the same three settings go into the
trainer's YAML (docs/integration.md) and verl builds all of this itself.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # verl's wheel installs a `tests` package of its own
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def main() -> dict[str, object]:
    import ray
    from verl.workers.config import CheckpointEngineConfig

    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.tiny_qwen2 import make_tiny_qwen2
    from tests.verl.harness import release, rollout_replicas, trainer_group

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    # what the YAML's checkpoint_engine block becomes
    config = CheckpointEngineConfig(
        backend="ftstate",
        custom_backend_module="ftstate.integrations.verl",
        update_weights_bucket_megabytes=1,
        engine_kwargs={"ftstate": {"init_timeout_s": 60, "sync_timeout_s": 120, "commit_mode": "stream",
                                   "fault_tolerance": {"max_failovers": 2}}},
    )
    model = make_tiny_qwen2(os.path.join(tempfile.mkdtemp(), "tiny-qwen2"))
    trainer = trainer_group(model, config)                 # verl's actor worker group (2 ranks)
    rollout, replicas = rollout_replicas(model, config)    # 2 replicas, verl's CheckpointEngineWorker
    manager = FTStateCheckpointEngineManager(config=config, actor_wg=trainer, replicas=replicas)
    try:
        for step in (1, 2, 3):
            trainer.train_step(step)
            metrics = manager.update_weights(global_steps=step)
            same = rollout.digests() == [trainer.full_digests()[0]] * 2
            print(f"update {step}: {metrics['ftstate/chunks']} verified chunks, group version "
                  f"{metrics['ftstate/group_version']}, every rollout bit-equal: {same}")

        # a replica dies between two updates: the next update completes for the survivor
        pid = ray.get(rollout.workers[1].progress.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        trainer.train_step(4)
        metrics = manager.update_weights(global_steps=4)
        print(f"update 4: removed {manager.removed}; serving replicas: "
              f"{[r.replica_rank for r in manager.serving_replicas()]}")
        return {"removed": manager.removed, "states": manager.states(), "audit": manager.audit.records}
    finally:
        manager.close()
        release(trainer)
        release(rollout)


if __name__ == "__main__":
    main()
