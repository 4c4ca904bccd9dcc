"""Real vLLM engines as ftstate's rollouts: syncs reach the engines, proven from their kernels.

Every check reads the engines themselves: the held checksum is computed from what
``held_weights()`` reads back through each layer's packed kernel, and generation is compared
with an engine started from a checkpoint of the trainer's weights (no ftstate in between).
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

import ftstate
from tests.integration.test_held_weights import state_of, suspend_and_resume, user_call
from tests.integration.test_runtime import wait_until
from tests.vllm.harness import ENGINE_KWARGS, PROMPTS, QwenTrainer

# One runtime (a trainer, two engines) for the module: an engine start costs an import of vLLM.
pytestmark = [pytest.mark.ray, pytest.mark.asyncio(loop_scope="module")]


def config(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2,
        "bucket_size_mb": 1,
        "init_timeout_s": 120,
        "sync_timeout_s": 60,
        "failover_timeout_s": 120,
        "heartbeat_interval_s": 0.25,
        "heartbeat_timeout_s": 4.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "mode": "cold"},
    }
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


def runtime(cfg, model: str) -> ftstate.Runtime:
    from tests.vllm.rollouts import ProbedRollout

    return ftstate.Runtime(cfg, trainer=QwenTrainer, rollout=ProbedRollout, trainer_args=(model,),
                           rollout_args=(model,), rollout_kwargs={"engine_kwargs": ENGINE_KWARGS})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(ray_cluster, tiny_model, tmp_path_factory):
    async with runtime(config(tmp_path_factory.mktemp("vllm-sync")), tiny_model) as rt:
        yield rt


async def sync_proven(rt, *, engines: int, step: bool) -> ftstate.SyncReport:
    """One sync (after a train step when ``step``), proven: what each of the ``engines`` serving
    engines holds, read back from its kernels (not what it was handed), hashes to the trainer's."""
    if step:
        await rt.trainer("train_step")
    report = await rt.sync()
    trainer = await rt.trainer("checksum")
    assert report.checksum == trainer
    assert await rt.rollout("held_checksum") == [trainer] * engines
    return report


async def reference_generation(ray, rt, tmp_path, name: str) -> list[list[int]]:
    """Greedy tokens of an engine started from a checkpoint of the trainer's current weights."""
    from ftstate.integrations.vllm import VLLMRollout

    path = await rt.trainer("save", str(tmp_path / name))
    engine = ray.remote(VLLMRollout).remote(path, load_format="auto", engine_kwargs=ENGINE_KWARGS)
    try:
        out = await engine.generate.remote(PROMPTS, max_tokens=12)
    finally:
        ray.kill(engine)
    return [o["token_ids"] for o in out]


async def test_each_sync_reaches_every_engine_bit_for_bit_and_it_generates_as_an_engine_started_from_those_weights(
    rt, ray_cluster, tmp_path
):
    for step in range(2):
        report = await sync_proven(rt, engines=2, step=bool(step))
        got = await rt.rollout("generate", PROMPTS, max_tokens=12)
        assert [o["weights_version"] for out in got for o in out] == [report.weights_version] * 6
        tokens = [[o["token_ids"] for o in out] for out in got]
        assert tokens[0] == tokens[1]
    # One reference engine (each costs an import of vLLM and an engine start), for the weights
    # that came through a sync after a step, not the checkpoint the engines were built from.
    assert tokens[0] == await reference_generation(ray_cluster, rt, tmp_path, "v2")


async def test_requests_during_a_sync_are_served_whole_from_one_version_or_the_next(rt):
    """Generation keeps coming while a sync reloads the engines: every answer is the old
    version's or the new one's, token for token, never a mix (no request between the first and
    the last tensor of a load)."""
    await rt.sync()
    old = rt.weights_version
    tokens = {old: [o["token_ids"] for o in (await rt.rollout("generate", PROMPTS, max_tokens=12))[0]]}
    await rt.trainer("train_step", 0.5)  # a large step: the two versions generate differently
    sync = asyncio.ensure_future(rt.sync())
    answers = []
    while not sync.done():  # a few requests in flight at once, to land inside the commit too
        for got in await asyncio.gather(*(rt.rollout("generate", PROMPTS, max_tokens=12) for _ in range(3))):
            answers += got
    await sync
    new = rt.weights_version
    tokens[new] = [o["token_ids"] for o in (await rt.rollout("generate", PROMPTS, max_tokens=12))[0]]
    assert tokens[old] != tokens[new]
    print(f"requests during the sync: {len(answers)} answers, versions "
          f"{sorted({o['weights_version'] for out in answers for o in out})}")
    assert answers
    for out in answers:
        (version,) = {o["weights_version"] for o in out}
        assert version in tokens and [o["token_ids"] for o in out] == tokens[version]


async def test_weights_changed_inside_an_engine_behind_ftstates_back_take_it_out_of_serving(rt):
    await rt.sync()
    good, bad = rt.serving_rollouts()

    # A loader that changes a weight after vLLM's reload returned: caught at the commit.
    await user_call(rt, bad, "tamper_next_load")
    await rt.trainer("train_step")
    report = await rt.sync()
    assert report.stale == (bad,) and report.rollouts == (good,)
    assert state_of(rt, bad) == "STALE"
    trainer = await rt.trainer("checksum")
    assert await user_call(rt, bad, "held_checksum") != trainer
    assert await rt.rollout("held_checksum") == [trainer]  # only the good one serves
    failed = [r for r in rt.audit.records if r.get("member") == bad and r.get("trigger") == "sync_failed"]
    assert failed[-1]["error"] == "HeldWeightsMismatch"

    # Resynced at the next sync (the tamper was one-shot), it serves again, proven.
    await rt.trainer("train_step")
    report = await rt.sync()
    assert sorted(report.rollouts) == sorted([good, bad])
    assert await rt.rollout("held_checksum") == [rt.checksum] * 2

    # Changed while it serves, then suspected (stopped, resumed): the fresh proof of what
    # its kernels hold does not match, so it is not re-admitted.
    await user_call(rt, bad, "tamper_now")
    await suspend_and_resume(rt, bad, "STALE", timeout=20)
    assert rt.serving_rollouts() == [good]


async def test_an_engine_killed_in_cold_mode_is_replaced_by_a_new_engine_holding_the_current_weights(rt):
    await rt.trainer("train_step")
    await rt.sync()  # the STALE one of the test before is resynced here
    assert len(rt.serving_rollouts()) == 2
    before = len(rt.failovers)
    victim = await rt.chaos.kill("rollout", 1)
    # cold: a new actor imports vLLM and starts its engine, then gets the weights from a survivor
    await wait_until(lambda: len(rt.failovers) > before and rt.state == "READY", 120, "the cold failover")
    record = rt.failovers[-1]
    assert record.lost == victim and record.resynced and not record.replacement.startswith("spare")
    assert await rt.rollout("held_checksum") == [await rt.trainer("checksum")] * 2
