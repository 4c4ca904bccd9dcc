"""No unbounded loop: a failure that repeats with nobody dead ends with its real cause.

Fault tolerance is on throughout (with it off nothing is ever retried). What used to happen
(issue 10): a receiver whose hashing raised (numpy missing in a plain install) made the
trainer see "connection reset", and ``sync()`` re-formed the group and tried again forever:
8,101 group versions in 600 s. Now a sync is tried again only after a loss was replaced, or
at most ``sync_retries`` times after a transient failure; the caller gets the member's own
exception, and the trail stays short and one line a reason.

The failing receive path is real: the rollout's process has numpy taken away
(``torch.Tensor.numpy`` raising what torch raises without numpy), exactly the plain-install
failure, inside ftstate's own receive code.
"""

from __future__ import annotations

import time

import pytest

import ftstate
from ftstate.core.errors import CommunicatorAborted, FTError, InvalidTransition, MemberLost
from ftstate.core.protocol import Abandon
from tests.integration.workers import TinyRollout, TinyTrainer

pytestmark = pytest.mark.ray

RETRIES = 2


def config(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2,
        "bucket_size_mb": 0.0625,
        "init_timeout_s": 60,
        "sync_timeout_s": 60,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 2.0,
        "sync_retries": RETRIES,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "mode": "cold", "max_failovers": 3},
    }
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


class NumpylessRollout(TinyRollout):
    """A rollout whose process has no working numpy, as in a plain install that forgot it."""

    def __init__(self) -> None:
        super().__init__()
        import torch

        def no_numpy(self, *args, **kwargs):
            raise RuntimeError("Numpy is not available")

        torch.Tensor.numpy = no_numpy


class AlwaysFailingTrainer(TinyTrainer):
    """A trainer whose state_dict() raises on every call after the first sync."""

    def break_state_dict(self) -> None:
        self.broken = True

    def state_dict(self):
        if getattr(self, "broken", False):
            raise ValueError("optimizer shard missing: simulated user bug")
        return super().state_dict()


class CrashingRollout(TinyRollout):
    """A rollout whose constructor kills its own process (a native crash in an engine's
    start-up): every replacement dies the same way."""

    def __init__(self) -> None:
        import os

        os._exit(3)


def one_line(records) -> None:
    for rec in records:
        for key in ("reason", "message"):
            assert "\n" not in str(rec.get(key, "")), rec


async def test_a_receiver_error_is_raised_as_itself_after_no_retry(ray_cluster, tmp_path) -> None:
    cfg = config(tmp_path)
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=NumpylessRollout)
    async with rt:
        v0 = rt.group_version
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rollout-\d: Numpy is not available") as info:
            await rt.sync()
        assert time.monotonic() - t0 < cfg.sync_timeout_s  # the error ended the sync; a wait lasts it out
        assert not isinstance(info.value, FTError)
        assert any("ftstate worker rollout-" in note for note in getattr(info.value, "__notes__", []))
        # Not a transient failure: no retry, one re-formed version for the abandoned transfer.
        assert rt.group_version - v0 <= 1
        assert not [r for r in rt.audit.records if r["event"] == "sync_retry"]
        assert rt.weights_version == 0
        assert rt.failovers == []
        one_line(rt.audit.records)
        assert len(rt.audit.records) < 200


async def test_a_trainer_whose_state_dict_always_raises_is_not_retried(ray_cluster, tmp_path) -> None:
    cfg = config(tmp_path)
    async with ftstate.Runtime(cfg, trainer=AlwaysFailingTrainer, rollout=TinyRollout) as rt:
        first = await rt.sync()
        await rt.trainer("break_state_dict")
        v0 = rt.group_version
        for _ in range(2):  # and again: each sync ends on its own, nothing piles up
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=r"trainer-0: optimizer shard missing"):
                await rt.sync()
            assert time.monotonic() - t0 < cfg.sync_timeout_s  # the error ended the sync; a wait lasts it out
        assert rt.group_version - v0 <= 2
        assert rt.weights_version == first.weights_version
        trainer_sum, rollout_sums = await rt.trainer("checksum"), await rt.rollout("checksum")
        assert rollout_sums == [first.checksum] * 2 and trainer_sum == first.checksum
        assert not [r for r in rt.audit.records if r["event"] == "sync_retry"]
        one_line(rt.audit.records)


async def test_a_transient_transport_error_is_retried_and_the_sync_succeeds(ray_cluster, tmp_path) -> None:
    async with ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        # rollout-0 loses its connection to the group: its communicator is aborted, so its
        # next transfer fails at once with CommunicatorAborted (nobody died).
        await rt.handle("rollout-0").abandon_transfer.remote(Abandon("test: connection dropped"))
        report = await rt.sync()
        assert report.weights_version == 2 and report.failovers == 0
        retries = [r for r in rt.audit.records if r["event"] == "sync_retry"]
        assert len(retries) == 1 and "CommunicatorAborted" in retries[0]["reason"]
        assert retries[0]["membership_changed"] is False
        trainer_sum, rollout_sums = await rt.trainer("checksum"), await rt.rollout("checksum")
        assert rollout_sums == [trainer_sum] * 2 == [report.checksum] * 2


async def test_a_transient_error_past_sync_retries_is_raised(ray_cluster, tmp_path) -> None:
    async with ftstate.Runtime(config(tmp_path, sync_retries=0), trainer=TinyTrainer, rollout=TinyRollout) as rt:
        first = await rt.sync()
        await rt.handle("rollout-1").abandon_transfer.remote(Abandon("test: connection dropped"))
        with pytest.raises(CommunicatorAborted, match="connection dropped"):
            await rt.sync()
        assert [r["event"] for r in rt.audit.records].count("sync_gave_up") == 1
        assert rt.weights_version == first.weights_version
        # The group was formed again without anyone lost: the next sync works.
        report = await rt.sync()
        assert await rt.rollout("checksum") == [report.checksum] * 2


async def test_a_constructor_that_crashes_its_process_fails_start_with_the_cause(ray_cluster, tmp_path) -> None:
    for mode in ("cold", "standby"):
        cfg = config(tmp_path / mode, fault_tolerance={"enable": True, "mode": mode, "max_failovers": 3})
        rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=CrashingRollout)
        t0 = time.monotonic()
        with pytest.raises(FTError) as info:
            await rt.start()
        assert time.monotonic() - t0 < cfg.init_timeout_s  # the crash ended the start; a wait lasts it out
        err = info.value
        assert not isinstance(err, InvalidTransition), err
        assert isinstance(err, MemberLost), repr(err)
        assert "rollout-" in str(err)
        # The cause, once: it died starting, and so did every replacement tried.
        assert "process died during" in str(err) and "no replacement could start" in str(err), str(err)
        assert str(err).count(f"{err.member} lost") == 1, str(err)
        assert rt.state == "FAILED"
