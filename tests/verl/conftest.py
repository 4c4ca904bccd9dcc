"""The verl suite: verl 0.9.1's own worker groups on one local Ray cluster (loopback), CPU.

Runs in its own virtual environment (``make test-verl``); the core venv has no verl, so this
folder's tests are skipped there with a reason naming the target (its modules import verl
only inside the tests, so they collect without it). verl's wheel installs a top-level
``tests`` package: the project root goes first on ``sys.path`` here and on ``PYTHONPATH`` for
Ray's worker processes, so ``tests.verl.harness`` is always this project's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.own_venv import ROOT, root_first, skip_without

root_first()
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    """Without verl (the core venv), this folder's tests are skipped, saying where they run."""
    skip_without("verl", HERE, items, suite="verl", target="test-verl")


@pytest.fixture(scope="session")
def ray_cluster():
    # Before Ray is imported: a local cluster then binds 127.0.0.1 only (DESIGN.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    if not ray.is_initialized():
        # verl's resource pools reserve one logical CPU per worker (max_colocate_count=1)
        ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.tiny_qwen2 import make_tiny_qwen2

    return make_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"))


@pytest.fixture(scope="session")
def trainer(ray_cluster, tiny_model):
    """verl trainer worker group, 2 ranks (rank 1 is out of the weight group: rank -1)."""
    from tests.verl.harness import checkpoint_engine_config, trainer_group

    wg = trainer_group(tiny_model, checkpoint_engine_config(init_timeout_s=30, sync_timeout_s=60))
    wg.engine_state()  # every rank constructed (verl starts the actors in the background)
    yield wg
    kill_group(ray_cluster, wg)


@pytest.fixture(scope="session")
def rollouts(ray_cluster, tiny_model):
    """2 rollout replicas of 1 worker each (verl's CheckpointEngineWorker), commit_mode stream."""
    from tests.verl.harness import checkpoint_engine_config, rollout_replicas

    wg, replicas = rollout_replicas(tiny_model, checkpoint_engine_config(init_timeout_s=30, sync_timeout_s=60))
    wg.digests()  # every worker constructed
    yield wg, replicas
    kill_group(ray_cluster, wg)


def kill_group(ray, wg) -> None:
    """End a worker group's actors and free its placement groups (this session's own only)."""
    from tests.verl.harness import release

    release(wg)
