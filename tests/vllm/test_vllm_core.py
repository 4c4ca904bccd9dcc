"""vLLM's engine core in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as verl,
NeMo-RL and OpenRLHF deploy it) with tensor parallelism (``tensor_parallel_size=2``): synced and
proven through the extra hop, and every engine process (the core and its workers, which are the
core's children, not the actor's) supervised.

One run for the module (a trainer, one serving engine and a warm spare), the tests in order, as
in ``test_vllm_tp.py``, whose helpers these are. After each fault the member is replaced by the
spare, serves proven, and none of the dead engine's processes or /dev/shm files is left. Last,
one rank (``tensor_parallel_size=1``) with a separate core, the worker built in the test's
process: loaded, read back, and failing typed when the core dies.
"""

from __future__ import annotations

import os
import time

import pytest
import pytest_asyncio

import ftstate
from tests.vllm.harness import PROMPTS, QwenTrainer, rollout_kwargs
from tests.vllm.test_vllm_tp import (
    actor_sigkilled_leaves_nothing,
    close_leaving_nothing,
    killed_inside_reload,
    killed_under_generate,
    module_run,
    stopped_under_generate,
    synced_twice,
)

pytestmark = [pytest.mark.ray, pytest.mark.asyncio(loop_scope="module")]

#: The engine's environment: the core in a process of its own, tensor parallelism on this host.
SEPARATE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def core_kwargs(tp: int) -> dict:
    kwargs = rollout_kwargs(tp=tp)
    return {**kwargs, "engine_env": {**kwargs.get("engine_env", {}), **SEPARATE_CORE}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(ray_cluster, tiny_model, tmp_path_factory):
    async with module_run(tiny_model, tmp_path_factory.mktemp("vllm-core"), core_kwargs(tp=2)) as state:
        yield state


def test_one_rank_with_a_separate_core_loads_proves_and_fails_typed_when_the_core_dies(monkeypatch, tiny_model):
    """TP=1 with the core in a process of its own, the worker built here (outside a run, where
    ``declare_lost`` does nothing): the weights cross the core to its one worker and read back
    bit for bit; the core SIGKILLed under ``generate`` raises the typed error, and none of the
    engine's processes or files is left."""
    import torch

    from ftstate.integrations.vllm.tree import REAP_S, read_proc
    from tests.vllm.rollouts import ProbedRollout
    from tests.vllm.test_vllm_tree import running

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(key, os.environ.get(key, "0"))  # the worker sets them here: restored after
    import ray

    # first in the session, before Ray starts here: an engine built in this process takes every
    # process below it for its own, and a dead core takes them with it (Ray's raylet would go too)
    assert not ray.is_initialized(), "run before the session's Ray cluster starts in this process"
    state = QwenTrainer(tiny_model).state
    rollout = ProbedRollout(tiny_model, **core_kwargs(tp=1))
    procs = dict(rollout.engine_processes())
    core = procs["VLLM::EngineCore"]
    assert read_proc(core)[0] == os.getpid() and read_proc(procs["VLLM::Worker"])[0] == core, procs
    from ftstate.integrations.vllm.tree import shm_files

    files = set().union(*(shm_files(p) for p in procs.values()))
    rollout.load_weights(state, 1)
    held = rollout.held_weights()
    assert held is not None and sorted(held) == sorted(state)
    assert all(torch.equal(held[k], state[k]) for k in state), "the read-back through the core is the trainer's"
    assert all(len(o["token_ids"]) == 4 for o in rollout.generate(PROMPTS, max_tokens=4))
    rollout.kill_at_next_step("VLLM::EngineCore")
    t0 = time.monotonic()
    with pytest.raises(ftstate.EngineProcessDied, match=r"VLLM::EngineCore \(pid \d+\)"):
        rollout.generate(PROMPTS, max_tokens=8)
    raised_s = time.monotonic() - t0
    with pytest.raises(ftstate.EngineProcessDied):  # every later call too
        rollout.held_weights()
    deadline = time.monotonic() + REAP_S
    while time.monotonic() < deadline and ([p for p in procs.values() if running(p)]
                                           or [f for f in files if os.path.exists(f)]):
        time.sleep(0.1)
    assert [p for p in procs.values() if running(p)] == [] and [f for f in files if os.path.exists(f)] == []
    print(f"TP=1 engine core SIGKILL: generate raised after {raised_s:.2f}s")


async def test_a_sync_crosses_the_core_to_both_ranks_and_the_assembled_read_back_is_the_trainers(run):
    from ftstate.integrations.vllm.tree import read_proc

    rt = run["rt"]
    report, actor, procs, files = await synced_twice(rt)
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(procs), procs
    core = procs["VLLM::EngineCore"]
    assert read_proc(core)[0] == actor, "the engine core is the actor's child"
    assert read_proc(procs["VLLM::Worker_TP0"])[0] == core, "its workers are the core's children"
    assert files, "the engine maps its message queues from /dev/shm"
    (out,) = await rt.rollout("generate", PROMPTS, max_tokens=8)
    assert [o["weights_version"] for o in out] == [report.weights_version] * len(PROMPTS)
    assert all(len(o["token_ids"]) == 8 for o in out)


async def test_the_engine_core_sigkilled_fails_the_generate_naming_it_and_the_spare_takes_over(run):
    await killed_under_generate(run["rt"], run["cfg"], "VLLM::EngineCore")


async def test_the_engine_core_stopped_is_a_wedge_the_member_lost_and_replaced(run):
    # every process alive and the core answering nothing: only the activity rule can tell
    await stopped_under_generate(run["rt"], run["cfg"], "VLLM::EngineCore")


async def test_a_rank_killed_inside_vllms_reload_through_the_core_is_replaced_and_the_next_sync_serves_whole(run):
    await killed_inside_reload(run["rt"])


async def test_the_actor_sigkilled_takes_the_core_its_workers_and_their_shm_files_with_it(run):
    procs = await actor_sigkilled_leaves_nothing(run["rt"])
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(procs), procs


async def test_closing_the_run_leaves_no_engine_process_and_no_segment(run):
    await close_leaving_nothing(run["rt"], run["shm_before"])


def test_a_vllm_whose_client_cannot_be_unblocked_refuses_the_separate_core():
    # another vLLM's client without what ends a call waiting on a dead core: refused, not run blind
    from types import SimpleNamespace

    from ftstate.integrations.vllm.rollout import UNBLOCK_POINTS, check_unblockable

    class Client:
        resources = outputs_queue = None

    with pytest.raises(ftstate.EngineRefused, match=r"VLLM_ENABLE_V1_MULTIPROCESSING.*has no utility_results"):
        check_unblockable(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=Client())))
    whole = SimpleNamespace(**dict.fromkeys(UNBLOCK_POINTS))
    check_unblockable(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=whole)))


def test_seeds_that_do_not_match_the_prompts_are_a_usage_error_naming_both_counts():
    from types import SimpleNamespace

    from ftstate.core.errors import UsageError
    from ftstate.integrations.vllm import VLLMRollout

    with pytest.raises(UsageError, match=r"seeds: one per prompt, got 1 for 2 prompts"):
        VLLMRollout.generate(SimpleNamespace(), [[1, 2], [3]], seeds=[7])
