"""What a user meets when their own code raises inside a worker (real Ray actors).

The user's exception comes first: its type, its message (terminal escapes removed), the
member and the user's method (never ftstate's internal call), and the frame in the user's
file; every rollout that raised is named. A constructor that raises fails ``start()`` at
once, with fault tolerance on as well as off (a class that fails every time is not a fault to
tolerate), and spends no failover.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import ftstate
from ftstate.core.audit import read_trail
from ftstate.core.errors import ReplacementFailed, WorkerInitError
from tests.integration._user_code import (
    RolloutThatFailsToLoad,
    RolloutWhoseNewcomersCannotLoad,
    RolloutWhoseSparesCannotStart,
    TrainerThatCannotOpenItsModel,
    TrainerThatCannotTakeWeightsBack,
    TrainerWhoseStateDictRaises,
)
from tests.integration.workers import TinyRollout, TinyTrainer

pytestmark = pytest.mark.ray

USER_FILE = "tests/integration/_user_code.py"


def config(tmp_path, ft: bool = False, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2,
        "init_timeout_s": 60,
        "sync_timeout_s": 30,
        # generous: these tests are about user errors, not liveness, on a loaded 2-CPU machine
        "heartbeat_interval_s": 2.0,
        "heartbeat_timeout_s": 20.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
    }
    if ft:
        data["fault_tolerance"] = {"enable": True, "mode": "standby", "max_failovers": 4}
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


def no_escapes_anywhere(tmp_path) -> None:
    text = (tmp_path / "audit.jsonl").read_text()
    assert "\x1b" not in text and "\\u001b" not in text, "an ANSI escape reached the trail"


@pytest.mark.parametrize("ft", [False, True], ids=["ft-off", "ft-on"])
async def test_a_trainer_constructor_that_raises_fails_start_at_once_with_the_users_error(ray_cluster, tmp_path, ft):
    cfg = config(tmp_path, ft=ft)
    rt = ftstate.Runtime(cfg, trainer=TrainerThatCannotOpenItsModel, rollout=TinyRollout)
    t0 = time.monotonic()
    with pytest.raises(WorkerInitError) as info:
        await rt.start()
    took = time.monotonic() - t0
    err = info.value
    assert (err.member, err.role, err.cls, err.exc_type) == (
        "trainer-0", "trainer", "TrainerThatCannotOpenItsModel", "RuntimeError")
    assert err.message == "cannot open /data/model.pt (no such file)"
    assert USER_FILE in err.where and err.where.endswith("in __init__"), err.where
    assert "raise RuntimeError" in err.traceback
    text = str(err)
    assert text.startswith("trainer-0: TrainerThatCannotOpenItsModel.__init__() raised RuntimeError: cannot open")
    assert "\x1b" not in text and "ray::" not in text
    # no replacement was built for it: not a fault, and nothing of the budget is spent
    records = [rec for _, rec in read_trail(tmp_path / "audit.jsonl")]
    assert not [r for r in records if r["event"] in ("failover", "budget_spent")]
    assert not [r for r in records if r.get("trigger") == "promote" and r.get("machine") == "group"]
    no_escapes_anywhere(tmp_path)
    print(f"constructor error surfaced in {took:.2f}s (fault tolerance {'on' if ft else 'off'})")
    # the error ended the start: waiting for the trainer would last init_timeout_s out (and a
    # replacement, none of which was built: see above)
    assert took < cfg.init_timeout_s


async def test_every_rollout_whose_load_weights_raises_is_named_with_the_users_method_and_frame(
        ray_cluster, tmp_path):
    async with ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=RolloutThatFailsToLoad) as rt:
        await rt.sync()  # version 1 loads
        await rt.trainer("train_step")
        with pytest.raises(ValueError) as info:
            await rt.sync()
    err = info.value
    text = str(err)
    assert "shape mismatch in my engine at version 2" in text
    assert "rollout-0" in text and "rollout-1" in text, text  # both raised: both named
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "RolloutThatFailsToLoad.load_weights()" in notes, notes
    assert "commit_weights" not in notes and "commit_weights" not in text
    assert f"{USER_FILE}:" in notes and "in load_weights" in notes
    assert err.__cause__ is None and "\x1b" not in notes
    no_escapes_anywhere(tmp_path)


async def test_a_trainer_whose_state_dict_raises_is_named_with_its_method(ray_cluster, tmp_path):
    async with ftstate.Runtime(config(tmp_path), trainer=TrainerWhoseStateDictRaises, rollout=TinyRollout) as rt:
        with pytest.raises(KeyError) as info:
            await rt.sync()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "TrainerWhoseStateDictRaises.state_dict()" in notes and "trainer-0" in notes, notes
    assert f"{USER_FILE}:" in notes


async def test_a_spare_whose_constructor_raises_is_recorded_with_the_users_error(ray_cluster, tmp_path):
    """Fault tolerance on: the members construct, every spare's constructor raises. The spares
    are given up after spare_start_attempts with the user's exception as the reason (not
    "process died"), and the run goes on."""
    marker = tmp_path / "engine-busy"
    cfg = config(tmp_path, ft=True, rollout_workers=2)
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=RolloutWhoseSparesCannotStart,
                               rollout_kwargs={"marker": str(marker)}) as rt:
        await wait_for(lambda: any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()), "a warm spare")
        await rt.sync()
        marker.touch()  # from now on a rollout's constructor raises
        spare = next(m.member for m in rt.members() if m.state == "STANDBY" and m.role == "rollout")
        await rt.chaos.kill(spare)
        await wait_for(lambda: any(r["event"] == "spare_unavailable" for r in rt.audit.records), "spares given up")
        [gave_up] = [r for r in rt.audit.records if r["event"] == "spare_unavailable"]
        assert gave_up["role"] == "rollout"
        assert "RolloutWhoseSparesCannotStart.__init__() raised OSError: engine refused to start" in gave_up["reason"]
        await rt.trainer("train_step")
        report = await rt.sync()
        assert set(report.rollouts) == {"rollout-0", "rollout-1"}
    no_escapes_anywhere(tmp_path)


@pytest.mark.parametrize("role", ["trainer", "rollout"])
async def test_a_replacement_whose_own_code_raises_at_its_resync_ends_the_run_at_once(ray_cluster, tmp_path, role):
    """Fault tolerance on: a replacement's ``load_state_dict`` (trainer, reverse recovery) or
    ``load_weights`` (rollout) raises when it is brought up. That is the user's code failing
    for the current weights, as it would in every further replacement: the run ends at once
    with a ReplacementFailed naming the replacement, the member it replaces, the user's
    method, exception and frame, after one failover spent, not at failover_timeout_s."""
    marker = tmp_path / "newcomers-refuse"
    # cold: the rollout's replacement is constructed after the marker exists
    cfg = config(tmp_path, failover_timeout_s=60, heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                 fault_tolerance={"enable": True, "mode": "standby" if role == "trainer" else "cold",
                                  "reverse_weight_sync": True, "max_failovers": 4})
    if role == "trainer":
        rt = ftstate.Runtime(cfg, trainer=TrainerThatCannotTakeWeightsBack, rollout=TinyRollout)
    else:
        rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=RolloutWhoseNewcomersCannotLoad,
                             rollout_kwargs={"marker": str(marker)})
    await rt.start()
    try:
        await rt.sync()
        marker.touch()
        t0 = time.monotonic()
        lost = await rt.chaos.kill(role, 0)
        # the cause ends the run in seconds; waiting for the replacement would last failover_timeout_s
        # out: half of it tells the two apart with the rest for scheduling
        await wait_for(lambda: rt.state == "FAILED", "the run to fail", timeout=cfg.failover_timeout_s / 2)
        took = time.monotonic() - t0
        with pytest.raises(ReplacementFailed) as info:
            await rt.sync()
        err = info.value
        assert err.replaces == lost and err.member != lost
        method = ("TrainerThatCannotTakeWeightsBack.load_state_dict()" if role == "trainer"
                  else "RolloutWhoseNewcomersCannotLoad.load_weights()")
        assert err.method == method, err
        assert err.exc_type == ("RuntimeError" if role == "trainer" else "ValueError")
        assert ("parameter 'layer.weight' was renamed" if role == "trainer" else "engine rejects") in err.message
        assert USER_FILE in err.where
        assert took < cfg.failover_timeout_s / 2, f"{took:.1f}s: the run waited for a deadline, not the cause"
        assert sum(1 for r in rt.audit.records if r["event"] == "budget_spent") == 1
        failed = [r for r in rt.audit.records if r.get("machine") == "group" and r.get("to") == "FAILED"]
        assert failed and method in failed[-1]["reason"]
    finally:
        await rt.close()
    no_escapes_anywhere(tmp_path)


async def wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_rollout_map_never_calls_a_rollout_with_an_empty_shard(ray_cluster, tmp_path):
    from tests.integration._user_code import RolloutCountingShards

    async with ftstate.Runtime(config(tmp_path, rollout_workers=3), trainer=TinyTrainer,
                               rollout=RolloutCountingShards) as rt:
        await rt.sync()
        assert await rt.rollout_map("generate_all", ["a"]) == ["A"]
        assert await rt.rollout_map("generate_all", []) == []
        assert await rt.rollout_map("generate_all", ["a", "b", "c", "d"]) == ["A", "B", "C", "D"]
        sizes = await rt.rollout("shard_sizes")
        assert sizes == [[1, 2], [1], [1]], sizes  # rollout-0 got the lone item; nobody got []
        # every rollout that raised is named, through rt.rollout as through the commit
        with pytest.raises(RuntimeError) as info:
            await rt.rollout("boom")
        assert all(f"rollout-{i}" in str(info.value) for i in range(3)), str(info.value)
        assert "RolloutCountingShards.boom()" in "\n".join(info.value.__notes__)
        # a shard answered with the wrong count is the user's method's fault, named as such
        with pytest.raises(ftstate.UserCodeError, match=r"^rollout-\d: generate_one_short\(\) answered 1 results "
                           r"for a shard of 2 items; expected a list with one result per item") as bad:
            await rt.rollout_map("generate_one_short", ["a", "b", "c", "d"])
        assert bad.value.method == "generate_one_short()"
