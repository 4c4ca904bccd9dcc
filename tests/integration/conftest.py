"""One local Ray cluster for the whole test session, bound to loopback; one pool of transport
member processes per test module that asks for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster():
    # Before Ray is imported: a local cluster then binds 127.0.0.1 only (DESIGN.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Worker processes import the test worker classes from tests/.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pool():
    """Three member processes (tests/integration/_transport_workers.py), shared by one module's tests."""
    from tests.integration._transport_workers import Pool

    p = Pool(size=3)
    try:
        yield p
    finally:
        p.close()
