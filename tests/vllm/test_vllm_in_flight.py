"""In-flight updates into real vLLM engines (``rollout_updates: in_flight``): a version committed
while an engine generates is loaded between two ``llm_engine.step()`` calls, the running requests
preempted and their KV recomputed on the new weights, and the engine is proven on it from its
kernels (``held_weights()``) before it serves that version."""

from __future__ import annotations

import asyncio

import pytest

import ftstate
from ftstate.core.protocol import UserCall
from tests.integration.test_runtime import wait_until
from tests.vllm.harness import ENGINE_KWARGS, PROMPTS, QwenTrainer

pytestmark = [pytest.mark.ray, pytest.mark.asyncio]


def config(tmp_path) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": 1, "bucket_size_mb": 1, "init_timeout_s": 120, "sync_timeout_s": 60,
        "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 8.0, "rollout_updates": "in_flight",
        "audit_log": str(tmp_path / "audit.jsonl"), "fault_tolerance": {"enable": False},
    }, environ={})


async def test_a_version_committed_mid_generation_is_loaded_between_engine_steps_and_proven(
        ray_cluster, tiny_model, tmp_path):
    from tests.vllm.rollouts import ProbedRollout

    async with ftstate.Runtime(config(tmp_path), trainer=QwenTrainer, rollout=ProbedRollout,
                               trainer_args=(tiny_model,), rollout_args=(tiny_model,),
                               rollout_kwargs={"engine_kwargs": ENGINE_KWARGS}) as rt:
        await rt.sync()
        old = rt.weights_version
        (name,) = rt.serving_rollouts()
        # long enough that the sync below lands while the engine is still stepping
        long = asyncio.ensure_future(rt.handle(name).call.remote(UserCall(
            "generate", (PROMPTS * 4,), {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0})))
        await asyncio.sleep(1.0)
        await rt.trainer("train_step", 0.5)
        report = await rt.sync()
        assert not long.done(), "the generation ended before the sync: nothing was in flight"
        assert tuple(report.pending) == (name,), report  # committed without waiting for the generation
        answers = await long
        assert all(a["weights_versions"] == [old, rt.weights_version] for a in answers), \
            {tuple(a["weights_versions"]) for a in answers}
        assert all(len(a["token_ids"]) == 200 for a in answers)
        # the engine's own labels agree: the first tokens on the old version, the rest on the new
        for a in answers:
            (v0, first, cut), (v1, resumed, end) = a["weights_spans"]
            assert (v0, first, v1, end) == (old, 0, rt.weights_version, 200) and 0 < cut == resumed < 200, a
        # the engine serves the new version, proven from what its kernels hold
        await wait_until(lambda: any(r["event"] == "swapped" and r.get("member") == name for r in rt.audit.records),
                         10, "the swap, proven by the engine's own checksum")
        held = await rt.handle(name).call.remote(UserCall("held_checksum"))
        assert held == rt.checksum == await rt.trainer("checksum")
        # and it generates as the new version does, whole (a request after the swap is one version)
        (after,) = await rt.rollout("generate", PROMPTS, max_tokens=12)
        assert {tuple(a["weights_versions"]) for a in after} == {(rt.weights_version,)}
