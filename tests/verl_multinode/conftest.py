"""verl's worker groups on a three-node Ray cluster of this machine (``ray.cluster_utils.Cluster``).

Its own pytest session (a driver joins one Ray cluster only: the verl suite's is a local
single-node one), run by ``make test-verl`` after ``tests/verl`` in the verl venv; in the core
venv its tests are skipped, naming that target. Each node has 3 CPUs: verl's resource pools
reserve one CPU per worker and pack each pool's group on one node, so the trainer's two ranks
take one node and a rollout pool of ``[2, 2]`` the other two, two rollouts on each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.own_venv import root_first, skip_without

root_first()
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    skip_without("verl", HERE, items, suite="verl", target="test-verl")


@pytest.fixture(scope="session")
def cluster():
    from tests.multinode.harness import start_cluster, stop_cluster

    mn = start_cluster(num_cpus=3, object_store_mb=150)
    yield mn
    stop_cluster(mn)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.tiny_qwen2 import make_tiny_qwen2

    return make_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"))
