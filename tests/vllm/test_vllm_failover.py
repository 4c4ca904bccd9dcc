"""A vLLM engine dies or wedges with its actor: detected, replaced, and nothing left behind.

The engine runs in the actor's process (the only mode VLLMRollout accepts), so a SIGKILL or a
SIGSTOP of the actor is one of the engine too; an engine wedged in a kernel while the actor
answers is seen by its steps standing still. After each fault: the controller replaces the
member within its bounds, every serving engine holds the trainer's weights by the checksum of
what its kernels compute with, no process the engine started outlives it, and /dev/shm holds
no new segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from tests.integration.test_held_weights import state_of, user_call
from tests.integration.test_runtime import assert_gone, wait_until
from tests.vllm.harness import ENGINE_KWARGS, PROMPTS, QwenTrainer
from tests.vllm.test_vllm_sync import config

pytestmark = pytest.mark.ray


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def shm_left(before: set[str], pids: list[int]) -> list[str]:
    """Segments in /dev/shm since ``before`` that this run made: vLLM's own (``psm_*``, its
    multiprocess engine's) or ftstate's of one of ``pids`` (the machine is shared: another
    run's segments are not this test's)."""
    from ftstate.transport import shm

    left = []
    for name in set(os.listdir("/dev/shm")) - before:
        fields = shm.parse_name(name)
        if name.startswith("psm_") or (fields is not None and int(fields["pid"]) in pids):
            left.append(name)
    return sorted(left)


def vllm_processes() -> list[str]:
    """Every live process named like a vLLM engine core or worker (the multiprocess engine's)."""
    names = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                if cmd.startswith("VLLM::"):
                    names.append(f"{entry} {cmd}")
    return names


async def assert_engines_hold_the_trainers_weights(rt) -> None:
    trainer = await rt.trainer("checksum")
    serving = rt.serving_rollouts()
    assert serving and rt.checksum == trainer
    assert await rt.rollout("held_checksum") == [trainer] * len(serving)
    tokens = [[o["token_ids"] for o in out] for out in await rt.rollout("generate", PROMPTS, max_tokens=8)]
    assert all(t == tokens[0] for t in tokens)


async def test_engines_killed_mid_update_and_stopped_are_replaced_by_prewarmed_engines(
    ray_cluster, tiny_model, tmp_path
):
    from tests.vllm.rollouts import ProbedRollout

    shm_before = set(os.listdir("/dev/shm"))
    cfg = config(tmp_path, fault_tolerance={"enable": True, "mode": "standby", "standby_workers": 1})
    rt = ftstate.Runtime(cfg, trainer=QwenTrainer, rollout=ProbedRollout, trainer_args=(tiny_model,),
                         rollout_args=(tiny_model,), rollout_kwargs={"engine_kwargs": ENGINE_KWARGS})
    await rt.start()
    stopped = None
    try:
        await wait_until(lambda: any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()), 120,
                         "a warm rollout spare")
        await rt.sync()
        started = {m.member: m.pid for m in rt.members()}
        assert all(children(pid) == [] for pid in started.values()), "an in-process engine starts no process"
        survivor, victim = rt.serving_rollouts()
        before = await user_call(rt, survivor, "held_checksum")
        assert before == rt.checksum

        # SIGKILL inside vLLM's loader, 5 tensors into version 2: that engine is torn, and dies.
        await user_call(rt, victim, "kill_during_next_load", 5)
        await rt.trainer("train_step")
        report = await rt.sync()
        # the sync commits for the survivor; the dead member's replacement follows, resynced
        assert report.weights_version == 2 and report.rollouts == (survivor,)
        await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 60, "the failover")
        (record,) = rt.failovers
        assert record.lost == victim and record.replacement.startswith("spare-rollout")
        assert state_of(rt, victim) == "RETIRED"
        after = await user_call(rt, survivor, "held_checksum")
        assert before != after == report.checksum  # the survivor moved from v1 to v2 whole
        await assert_engines_hold_the_trainers_weights(rt)
        print(f"vLLM spare promoted: transfer {record.transfer_s:.3f}s, total {record.total_s:.3f}s")

        # SIGSTOP (an engine wedged with its actor): LOST within the heartbeat deadline, replaced.
        await wait_until(lambda: any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()), 120,
                         "the next warm rollout spare")
        wedged = rt.serving_rollouts()[0]
        stopped = next(m.pid for m in rt.members() if m.member == wedged)
        t0 = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        await wait_until(lambda: state_of(rt, wedged) in ("LOST", "RETIRED"), 30, f"{wedged} lost")
        lost_s = time.monotonic() - t0
        assert lost_s < cfg.heartbeat_timeout_s + 3 * cfg.heartbeat_interval_s + 1.5, lost_s
        await wait_until(lambda: len(rt.failovers) == 2 and rt.state == "READY", 60, "the second failover")
        await assert_engines_hold_the_trainers_weights(rt)
        assert rt.failovers[1].replacement.startswith("spare-rollout")

        # An engine wedged in a kernel while its actor answers every heartbeat (its generate's
        # next step sleeps with the GIL released): busy, its steps standing still, it is suspected
        # after half the timeout, LOST at its SUSPECT deadline, killed and replaced; the generate
        # that waited on it fails instead of waiting for ever.
        await wait_until(lambda: any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()), 120,
                         "the third warm rollout spare")
        wedged = rt.serving_rollouts()[0]
        await user_call(rt, wedged, "wedge_next_step")
        t0 = time.monotonic()
        stuck = asyncio.ensure_future(user_call(rt, wedged, "generate", PROMPTS, 8))
        await wait_until(lambda: state_of(rt, wedged) == "SUSPECT", 30, f"{wedged} suspected")
        suspected_s = time.monotonic() - t0
        await wait_until(lambda: state_of(rt, wedged) in ("LOST", "RETIRED"), 30, f"{wedged} lost")
        lost_s = time.monotonic() - t0
        assert cfg.heartbeat_timeout_s / 2 - cfg.heartbeat_interval_s <= suspected_s, suspected_s
        assert lost_s < 1.5 * cfg.heartbeat_timeout_s + 3 * cfg.heartbeat_interval_s + 1.5, lost_s
        with pytest.raises(Exception):  # noqa: B017 - its actor was killed: Ray's death, whatever its class
            await asyncio.wait_for(stuck, 30)
        await wait_until(lambda: len(rt.failovers) == 3 and rt.state == "READY", 60, "the third failover")
        await assert_engines_hold_the_trainers_weights(rt)
        assert rt.failovers[2].lost == wedged and rt.failovers[2].replacement.startswith("spare-rollout")
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        pids = [m.pid for m in rt.members()]
        run_id = rt.run_id
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
    import ray

    assert_gone(ray, run_id, pids)
    assert vllm_processes() == []
    assert shm_left(shm_before, pids) == []


def test_an_unreadable_engine_core_switch_and_pipeline_or_data_parallelism_are_refused_naming_the_setting_and_why(
        monkeypatch, tiny_model):
    from ftstate.integrations.vllm import VLLMRollout

    # 0 and 1 (the core in a process of its own: test_vllm_core.py) are the values vLLM reads
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "true")
    with pytest.raises(ftstate.EngineRefused, match=r"VLLM_ENABLE_V1_MULTIPROCESSING='true' is refused: expected 0") as info:
        VLLMRollout(tiny_model)
    assert info.value.setting == "VLLM_ENABLE_V1_MULTIPROCESSING"
    with pytest.raises(ftstate.EngineRefused, match=r"VLLM_ENABLE_V1_MULTIPROCESSING='2' is refused"):
        VLLMRollout(tiny_model, engine_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "2"})
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # refused before any engine starts: settings ftstate neither supervises nor proves
    for kwargs, setting in (({"pipeline_parallel_size": 2}, "engine_kwargs.pipeline_parallel_size"),
                            ({"data_parallel_size": 2}, "engine_kwargs.data_parallel_size"),
                            ({"tensor_parallel_size": 0}, "engine_kwargs.tensor_parallel_size"),
                            ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
                             "engine_kwargs.distributed_executor_backend"),
                            ({"distributed_executor_backend": "mp"}, "engine_kwargs.distributed_executor_backend")):
        with pytest.raises(ftstate.EngineRefused, match=setting):
            VLLMRollout(tiny_model, engine_kwargs=kwargs)
