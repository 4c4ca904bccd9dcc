"""Tensor-parallel vLLM engines (``tensor_parallel_size=2``, vLLM's multiprocess executor) as
rollouts: synced and proven across ranks, and every engine process supervised.

One run for the module (a trainer, one serving TP=2 engine and a warm TP=2 spare: each engine
start costs an import of vLLM and two worker processes), the tests in order. After each fault
the member is replaced by the spare, every serving engine holds the trainer's weights by the
checksum of what its ranks' kernels compute with (assembled), none of the dead engine's
processes is left and none of its /dev/shm files; after the run closes, no vLLM process and no
segment of the run's is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import pytest_asyncio

import ftstate
from tests.integration.test_held_weights import state_of, user_call
from tests.integration.test_runtime import assert_gone, wait_until
from tests.vllm.harness import PROMPTS, QwenTrainer, rollout_kwargs
from tests.vllm.test_vllm_failover import assert_engines_hold_the_trainers_weights, shm_left, vllm_processes
from tests.vllm.test_vllm_sync import config, sync_proven
from tests.vllm.test_vllm_tree import running

pytestmark = [pytest.mark.ray, pytest.mark.asyncio(loop_scope="module")]



@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(ray_cluster, tiny_model, tmp_path_factory):
    async with module_run(tiny_model, tmp_path_factory.mktemp("vllm-tp"), rollout_kwargs(tp=2)) as state:
        yield state


@contextlib.asynccontextmanager
async def module_run(tiny_model: str, tmp, kwargs: dict):
    """A started run of a trainer, one serving rollout and a warm spare (``ProbedRollout`` with
    ``kwargs``), for a module's tests in order: its runtime, config and the /dev/shm names before."""
    from tests.vllm.rollouts import ProbedRollout

    shm_before = set(os.listdir("/dev/shm"))
    # heartbeat_timeout_s: a TP=2 step here (two ranks pinned to two shared cores) stood still
    # for over 5 s on a host loaded 5x over, which the activity rule takes for a wedge at half
    # the bound; a death is noticed by its own signal, not by this bound
    cfg = config(tmp, rollout_workers=1, init_timeout_s=600, failover_timeout_s=300, heartbeat_timeout_s=15.0,
                 # one slot is replaced four times here, on purpose: no crash loop
                 fault_tolerance={"enable": True, "mode": "standby", "standby_workers": 1, "max_slot_failovers": 8})
    rt = ftstate.Runtime(cfg, trainer=QwenTrainer, rollout=ProbedRollout, trainer_args=(tiny_model,),
                         rollout_args=(tiny_model,), rollout_kwargs=kwargs)
    await rt.start()
    try:
        yield {"rt": rt, "cfg": cfg, "shm_before": shm_before, "pids": set()}
    finally:
        await rt.close()  # once closed by the last test, a second close does nothing


async def engine_of(rt, member: str) -> tuple[int, dict[str, int], set[str]]:
    """The member's actor pid, its engine's processes (name: pid) and their /dev/shm files."""
    from ftstate.integrations.vllm.tree import shm_files

    procs = dict(await user_call(rt, member, "engine_processes"))
    return (next(m.pid for m in rt.members() if m.member == member), procs,
            set().union(*(shm_files(p) for p in procs.values())))


async def gone(pids, files, within: float) -> None:
    """Every one of ``pids`` dead (or a zombie: reaped by nobody yet, holding nothing) and none
    of ``files`` left, within ``within`` seconds."""
    def left() -> list:
        return [p for p in pids if running(p)] + [f for f in files if os.path.exists(f)]

    try:
        await wait_until(lambda: not left(), within, "the engine's processes and files gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: left {left()} of {sorted(pids)}, {sorted(files)}") from None


async def serving_engine(rt) -> tuple[str, int, dict[str, int], set[str], int]:
    """Once a spare is warm: the serving member, its actor's pid, its engine's processes and
    /dev/shm files (:func:`engine_of`), and the number of failovers so far."""
    await spare_ready(rt)
    member = await serving_member(rt)
    return (member, *await engine_of(rt, member), len(rt.failovers))


async def serving_member(rt) -> str:
    """The one serving rollout. A generation slowed past half ``heartbeat_timeout_s`` by a
    loaded host leaves it STALE (busy, it could not prove its weights when suspected): a sync
    brings it back, proven."""
    if not rt.serving_rollouts():
        await rt.sync()
    (member,) = rt.serving_rollouts()
    return member


async def serving_again(rt) -> None:
    """The promoted spare, STALE (the lost member was the only rollout: no survivor to copy
    from), gets the current version from the trainer at the next sync, proven; it serves."""
    await rt.sync()
    await assert_engines_hold_the_trainers_weights(rt)


async def failed_over(rt, before: int) -> None:
    """Wait for the failover after ``before`` ones, within its own deadline (``failover_timeout_s``)."""
    await wait_until(lambda: len(rt.failovers) > before and rt.state == "READY", rt.config.failover_timeout_s,
                     "the failover")


async def spare_ready(rt) -> None:
    await wait_until(lambda: any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()), 300,
                     "a warm TP=2 spare")


async def test_a_sync_reaches_both_ranks_and_the_assembled_read_back_is_the_trainers(run):
    rt = run["rt"]
    report, actor, procs, _ = await synced_twice(rt)
    assert {"VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(procs), procs
    from ftstate.integrations.vllm.tree import read_proc

    assert all(read_proc(pid)[0] == actor for pid in procs.values()), "the engine's processes are the actor's children"
    (out,) = await rt.rollout("generate", PROMPTS, max_tokens=8)
    assert [o["weights_version"] for o in out] == [report.weights_version] * len(PROMPTS)
    assert all(len(o["token_ids"]) == 8 for o in out)


async def synced_twice(rt) -> tuple[ftstate.SyncReport, int, dict[str, int], set[str]]:
    """Once the spare is warm, two syncs (the second after a train step), each proven; the last
    report and the serving engine (:func:`engine_of`)."""
    await spare_ready(rt)
    for step in range(2):
        report = await sync_proven(rt, engines=1, step=bool(step))
    (member,) = rt.serving_rollouts()
    return (report, *await engine_of(rt, member))


async def test_one_ranks_corrupt_slice_takes_the_whole_engine_out_of_serving(run):
    rt = run["rt"]
    member = await serving_member(rt)
    # rank 1's slice of down_proj changed right after vLLM's reload returned: rank 0 is intact
    await user_call(rt, member, "tamper_next_load", 1)
    await rt.trainer("train_step")
    report = await rt.sync()
    assert report.stale == (member,) and report.rollouts == ()
    assert state_of(rt, member) == "STALE" and rt.serving_rollouts() == []
    failed = [r for r in rt.audit.records if r.get("member") == member and r.get("trigger") == "sync_failed"]
    assert failed[-1]["error"] == "HeldWeightsMismatch"
    # resynced whole at the next sync (the tamper was one-shot), it serves again, proven
    await rt.trainer("train_step")
    await rt.sync()
    assert rt.serving_rollouts() == [member]
    assert await rt.rollout("held_checksum") == [await rt.trainer("checksum")]


async def test_a_tp_worker_sigkilled_fails_the_generate_naming_it_and_the_spare_takes_over(run):
    await killed_under_generate(run["rt"], run["cfg"], "VLLM::Worker_TP1")


async def killed_under_generate(rt, cfg, process: str) -> None:
    """The serving engine's ``process`` SIGKILLed at the generate's first engine step, from
    inside the actor: the generate raises ``EngineProcessDied`` naming it, the member is lost
    within ``heartbeat_timeout_s`` (by the death, not by stalled progress), the spare takes over
    and serves proven, and none of the dead engine's processes or /dev/shm files is left."""
    from ftstate.integrations.vllm.tree import REAP_S

    member, actor, procs, files, before = await serving_engine(rt)
    await user_call(rt, member, "kill_at_next_step", process)
    t0 = time.monotonic()
    # how it ended is read when the watch wins the race with vLLM's own monitor, which reaps it
    died = rf"{process} \(pid \d+\) (was killed by SIGKILL|died)"
    with pytest.raises(ftstate.EngineProcessDied, match=died) as info:
        await asyncio.wait_for(rt.rollout("generate", PROMPTS, max_tokens=8), 60)
    raised_s = time.monotonic() - t0
    assert info.value.pid == procs[process]
    await wait_until(lambda: state_of(rt, member) in ("LOST", "RETIRED"), 30, f"{member} lost")
    lost_s = time.monotonic() - t0
    assert lost_s < cfg.heartbeat_timeout_s, lost_s  # by the process's death, not by stalled progress
    await failed_over(rt, before)
    record = rt.failovers[-1]
    assert record.lost == member and record.replacement.startswith("spare-rollout")
    await gone([actor, *procs.values()], files, REAP_S)
    await serving_again(rt)
    print(f"{process} SIGKILL: generate raised after {raised_s:.2f}s, lost after {lost_s:.2f}s, spare serving "
          f"after {record.total_s:.2f}s (failover), {time.monotonic() - t0:.2f}s (proven, from the kill)")


async def test_the_actor_sigkilled_takes_every_engine_process_and_shm_file_with_it(run):
    await actor_sigkilled_leaves_nothing(run["rt"])


async def actor_sigkilled_leaves_nothing(rt) -> dict[str, int]:
    """SIGKILL the serving member's actor: none of its engine's processes and /dev/shm files
    is left within ``REAP_S``, and the spare takes its place and serves, proven. Returns the
    engine's processes (name: pid) as they were."""
    from ftstate.integrations.vllm.tree import REAP_S

    member, actor, procs, files, before = await serving_engine(rt)
    assert files, "a multiprocess engine maps its message queues from /dev/shm"
    t0 = time.monotonic()
    os.kill(actor, signal.SIGKILL)
    await gone([actor, *procs.values()], files, REAP_S)
    reaped_s = time.monotonic() - t0
    await failed_over(rt, before)
    assert rt.failovers[-1].lost == member
    await serving_again(rt)
    print(f"actor SIGKILL: its {len(procs)} engine processes and {len(files)} /dev/shm files gone after {reaped_s:.2f}s")
    return procs


async def test_a_rank_killed_inside_vllms_reload_is_replaced_and_the_next_sync_serves_whole(run):
    await killed_inside_reload(run["rt"])


async def killed_inside_reload(rt) -> None:
    """Rank 1's process SIGKILLs itself 5 tensors into vLLM's reload at the next sync (rank 0's
    load goes on): the member is lost by the rank's own death, named, replaced, and nothing of
    its engine is left; the next sync serves whole."""
    from ftstate.integrations.vllm.tree import REAP_S

    member, actor, procs, files, before = await serving_engine(rt)
    await user_call(rt, member, "kill_during_next_load", 5, 1)
    await rt.trainer("train_step")
    try:
        await rt.sync()
    except ftstate.FTError as exc:  # its only rollout died mid-commit: the sync may fail, typed
        print(f"the sync with its only rollout dying: {type(exc).__name__}: {exc}")
    await failed_over(rt, before)
    assert rt.failovers[-1].lost == member
    lost = [r for r in rt.audit.records if r.get("member") == member and r.get("to") == "LOST"]
    assert "VLLM::Worker_TP1" in str(lost[-1]), lost[-1]  # lost by the rank's own death, named
    await gone([actor, *procs.values()], files, REAP_S)
    await serving_again(rt)


async def test_a_tp_worker_stopped_stalls_the_generate_and_the_member_is_lost_and_replaced(run):
    await stopped_under_generate(run["rt"], run["cfg"], "VLLM::Worker_TP1")


async def stopped_under_generate(rt, cfg, name: str) -> None:
    """SIGSTOP the serving engine's process ``name`` under a ``generate``: the engine takes no
    step (a wedge, every process alive), the activity rule declares the member lost, the call
    fails typed, the spare takes over, and every process of the engine is gone, the stopped one
    too (SIGKILL needs no SIGCONT)."""
    from ftstate.integrations.vllm.tree import REAP_S

    member, actor, procs, files, before = await serving_engine(rt)
    stopped = procs[name]
    os.kill(stopped, signal.SIGSTOP)
    try:
        stuck = asyncio.ensure_future(rt.rollout("generate", PROMPTS, max_tokens=8))
        await wait_until(lambda: state_of(rt, member) in ("LOST", "RETIRED"), 3 * cfg.heartbeat_timeout_s,
                         f"{member} lost")
        # the call waits for the failover before it retries or raises: bounded by its deadline
        with pytest.raises(ftstate.FTError):
            await asyncio.wait_for(stuck, cfg.failover_timeout_s + cfg.heartbeat_timeout_s)
        await failed_over(rt, before)
        await gone([actor, *procs.values()], files, REAP_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
    await serving_again(rt)


async def test_closing_the_run_leaves_no_engine_process_and_no_segment(run):
    await close_leaving_nothing(run["rt"], run["shm_before"])
    from ftstate.integrations.vllm.tree import REAP_S

    await wait_until(lambda: vllm_processes() == [], REAP_S, "no vLLM process left")


async def close_leaving_nothing(rt, shm_before: set[str]) -> None:
    """Close the run: no actor of it left, none of its engines' processes (those serving and
    the spares) and none of their /dev/shm files, nor any of ftstate's own segments of the run."""
    import ray

    from ftstate.integrations.vllm.tree import REAP_S

    engines = [await engine_of(rt, m.member) for m in rt.members() if m.role == "rollout"
               and m.state in ("READY", "STANDBY")]
    pids = [m.pid for m in rt.members()]
    run_id = rt.run_id
    await rt.close()  # a spare may still be starting its engine: its processes are reaped too
    assert_gone(ray, run_id, pids)
    await gone([p for _, procs, _ in engines for p in procs.values()],
               set().union(*(files for _, _, files in engines)), REAP_S)
    # ftstate's own segments of the run; vLLM's (psm_*) are the engines' files checked above (a
    # psm_* name alone does not say whose: the host is shared)
    assert [n for n in shm_left(shm_before, pids) if not n.startswith("psm_")] == []
