"""What a rollout holds is what the trail says: held-bytes checksums at commit and on re-admission.

A rollout whose engine keeps its own copy of the weights (``EngineRollout``, read back
through ``held_weights()``) corrupts that copy silently, the way a buggy engine would, while
``load_weights`` returns normally. The runtime must notice from the bytes the rollout holds,
not from the sender's seal: the member is taken out of serving (STALE), the others serve,
the trail records each member's own checksum, and ``audit --check`` flags a trail doctored
to claim the corrupted member served.
"""

from __future__ import annotations

import os
import signal

import pytest

import ftstate
from ftstate.core.audit_check import check_trail, load_records
from ftstate.core.protocol import UserCall
from tests.integration.test_runtime import wait_until
from tests.integration.workers import EngineRollout, TinyTrainer

pytestmark = pytest.mark.ray


def config(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2,
        "bucket_size_mb": 0.0625,
        "init_timeout_s": 60,
        "sync_timeout_s": 30,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 4.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "mode": "cold"},
    }
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


async def user_call(rt, member: str, method: str, *args):
    """A user method on one member only (rt.rollout calls every serving rollout)."""
    return await rt.handle(member).call.remote(UserCall(method, args))


def state_of(rt, member: str) -> str:
    return next(m.state for m in rt.members() if m.member == member)


async def suspend_and_resume(rt, name: str, then: str, timeout: float = 10) -> None:
    """SIGSTOP member ``name`` until it is SUSPECT, resume it, and wait for it to be ``then``
    (READY when a fresh hash of what it holds matches, STALE when not)."""
    pid = next(m.pid for m in rt.members() if m.member == name)
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_until(lambda: state_of(rt, name) == "SUSPECT", timeout, f"{name} suspected")
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_until(lambda: state_of(rt, name) == then, timeout, f"{name} {then}")


def records_of(rt, member: str, trigger: str) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == "transition" and r.get("member") == member
            and r["trigger"] == trigger]


@pytest.mark.parametrize("proof", [{}, {"held_weights_proof": "admission", "held_weights_proof_fraction": 1.0}],
                         ids=["every_sync", "admission-fraction-1"])
async def test_an_engine_that_corrupts_its_own_copy_is_taken_out_of_serving_at_commit(ray_cluster, tmp_path, proof):
    rt = ftstate.Runtime(config(tmp_path, **proof), trainer=TinyTrainer, rollout=EngineRollout)
    async with rt:
        await rt.sync()
        good, bad = rt.serving_rollouts()
        await user_call(rt, bad, "flip_next_load")
        await rt.trainer("train_step")
        report = await rt.sync()

        assert report.weights_version == 2
        assert report.stale == (bad,) and report.rollouts == (good,)
        assert rt.serving_rollouts() == [good]
        assert state_of(rt, bad) == "STALE"
        trainer = await rt.trainer("checksum")
        assert rt.checksum == trainer == await user_call(rt, good, "engine_checksum")
        held = await user_call(rt, bad, "engine_checksum")
        assert held != trainer
        # The trail has each member's own checksum: the good one's equals the sender's, the
        # bad one's is what its engine holds, with the typed error.
        (committed,) = [r for r in records_of(rt, good, "committed") if r["weights_version"] == 2]
        assert committed["checksum"] == trainer
        (failed,) = records_of(rt, bad, "sync_failed")
        assert failed["to"] == "STALE" and failed["checksum"] == held and failed["expected_checksum"] == trainer
        assert failed["error"] == "HeldWeightsMismatch"
        assert rt.failovers == []  # a fault of its engine, not a death: no budget spent

        # The next sync resyncs it (the flip was one-shot) and it serves again, proven.
        await rt.trainer("train_step")
        report = await rt.sync()
        assert sorted(report.rollouts) == sorted([good, bad]) and report.stale == ()
        assert await rt.rollout("engine_checksum") == [rt.checksum] * 2 == [await rt.trainer("checksum")] * 2

    path = tmp_path / "audit.jsonl"
    assert check_trail(path) == []
    # Doctor the trail to claim the corrupted member committed version 2 (and stop there).
    records, _ = load_records(path)
    done = next(i for i, (_, r) in enumerate(records) if r.get("trigger") == "sync_done" and r["weights_version"] == 2)
    doctored = []
    for _, r in records[: done + 1]:
        if r is failed_record(records, bad):
            r = {**r, "trigger": "committed", "to": "READY", "weights_version": 2}
        doctored.append(r)
    violations = check_trail(doctored)
    assert len(violations) == 1, violations
    assert violations[0].member == bad
    assert f"serving weights version 2 with checksum {held}, the sender's is {trainer}" in violations[0].problem


def failed_record(records, member: str) -> dict:
    return next(r for _, r in records if r.get("member") == member and r.get("trigger") == "sync_failed")


async def test_a_suspect_rollout_is_readmitted_only_if_a_fresh_hash_of_what_it_holds_matches(ray_cluster, tmp_path):
    rt = ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=EngineRollout)
    async with rt:
        await rt.sync()
        name = rt.serving_rollouts()[-1]

        # Untouched: its fresh hash matches, it is verified and serves again.
        await suspend_and_resume(rt, name, "READY")
        (verified,) = records_of(rt, name, "verified")[-1:]
        assert verified["checksum"] == rt.checksum

        # Its engine's copy changed since its commit (its cached checksum did not): the fresh
        # hash shows it, so it is not re-admitted.
        await user_call(rt, name, "flip_now")
        await suspend_and_resume(rt, name, "STALE")
        (stale,) = records_of(rt, name, "alive_stale")
        assert stale["checksum"] == await user_call(rt, name, "engine_checksum") != rt.checksum
        assert name not in rt.serving_rollouts()

        await rt.trainer("train_step")
        report = await rt.sync()
        assert name in report.rollouts
        assert await rt.rollout("engine_checksum") == [rt.checksum] * 2
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_held_weights_hook_returning_something_unhashable_is_a_typed_error_naming_the_member(
    ray_cluster, tmp_path
):
    class BrokenHook(EngineRollout):
        def held_weights(self):
            return [1, 2, 3]

    rt = ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=BrokenHook)
    async with rt:
        with pytest.raises(ftstate.StateDictError, match=r"rollout-\d.*held_weights\(\)"):
            await rt.sync()
        assert rt.serving_rollouts() == []


async def test_with_the_proof_at_admission_only_a_load_is_read_back_when_it_admits_the_rollout(ray_cluster, tmp_path):
    """held_weights_proof: admission (fraction 0): the first load and the re-admission of a
    SUSPECT rollout read the engine back; a load in between reports what was received, so an
    engine that corrupts its copy then is caught only at its next admission (the cost traded)."""
    cfg = config(tmp_path, held_weights_proof="admission", held_weights_proof_fraction=0.0)
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=EngineRollout)
    async with rt:
        await rt.sync()  # the first load of each: proven
        _, bad = rt.serving_rollouts()
        await user_call(rt, bad, "flip_next_load")
        await rt.trainer("train_step")
        report = await rt.sync()
        assert report.stale == () and bad in report.rollouts  # not read back: not caught here
        trainer = await rt.trainer("checksum")
        assert await user_call(rt, bad, "engine_checksum") != trainer
        await suspend_and_resume(rt, bad, "STALE")  # re-admission proves

        # Its next load follows a failed proof: it is read back, and it serves again.
        await rt.trainer("train_step")
        report = await rt.sync()
        assert bad in report.rollouts
        assert await rt.rollout("engine_checksum") == [rt.checksum] * 2
