"""What a new user meets on real processes: two runs into one audit_log that ``ftstate audit
--check`` passes run by run, the runtime's start-up phases logged at INFO through structlog
(and handed to listeners), and the warning when workers far outnumber the CPUs."""

from __future__ import annotations

import contextlib
import logging

import pytest
from typer.testing import CliRunner

import ftstate
from ftstate.cli.main import app
from ftstate.core.audit import as_records, split_runs
from ftstate.core.errors import RendezvousTimeout
from tests.integration.workers import TinyRollout, TinyTrainer

pytestmark = pytest.mark.ray


def config(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    data = {"rollout_workers": 2, "init_timeout_s": 60, "sync_timeout_s": 30, "heartbeat_interval_s": 2.0,
            "heartbeat_timeout_s": 20.0, "audit_log": str(tmp_path / "audit.jsonl")}
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


async def one_run(cfg) -> str:
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        await rt.trainer("train_step")
        await rt.sync()
        return rt.run_id


async def test_two_runs_into_one_audit_log_pass_the_check_one_by_one(ray_cluster, tmp_path):
    cfg = config(tmp_path)
    first = await one_run(cfg)
    second = await one_run(cfg)
    path = tmp_path / "audit.jsonl"
    runs = split_runs(as_records(path))
    assert [rid for rid, _ in runs] == [first, second]
    for rid, pairs in runs:
        recs = [rec for _, rec in pairs]
        start = recs[0]
        assert start["event"] == "run_start" and start["run"] == rid
        assert start["versions"]["ftstate"] == ftstate.__version__ and start["versions"]["torch"]
        assert len(start["config_digest"]) == 16 and start["rollout_workers"] == 2 and start["nodes"]
        assert all(r["run"] == rid for r in recs)
    assert runs[0][1][0][1]["config_digest"] == runs[1][1][0][1]["config_digest"]  # the same config
    result = CliRunner().invoke(app, ["audit", str(path), "--check", "--no-timeline", "--no-summary"])
    assert result.exit_code == 0, result.output
    assert "audit check passed" in result.stdout and "2 runs" in result.stdout
    shown = CliRunner().invoke(app, ["audit", str(path), "--run", second, "--json"]).stdout.splitlines()
    assert len(shown) == len(runs[1][1])


async def test_start_up_phases_are_logged_at_info_and_told_to_listeners(ray_cluster, tmp_path, caplog):
    told = []
    rt = ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=TinyRollout)
    rt.progress.listen(lambda event: told.append(event.message))
    with caplog.at_level(logging.INFO, logger="ftstate"):
        async with rt:
            await rt.sync()
    messages = [r.getMessage() for r in caplog.records if r.name == "ftstate"]
    assert any("starting 3 workers: 0 ready" in m for m in messages), messages
    assert any("starting 3 workers: 3 ready" in m for m in messages), messages
    assert any("formed: version 1, 3 members" in m for m in messages), messages
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "ftstate")
    assert [m for m in told if m.startswith("starting 3 workers")] == \
        [f"starting 3 workers: {k} ready" for k in range(4)]
    assert told[0].startswith("connecting to Ray")


async def test_each_sync_and_each_failover_is_a_progress_line(ray_cluster, tmp_path, caplog):
    """After start-up the runtime keeps telling: one INFO line per completed sync (version,
    rollouts, seconds) and one per failover (who was lost and why, who serves, after how long)."""
    told = []
    cfg = config(tmp_path, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0,
                 fault_tolerance={"enable": True, "mode": "cold"})
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout)
    rt.progress.listen(told.append)
    with caplog.at_level(logging.INFO, logger="ftstate"):
        async with rt:
            await rt.sync()
            lost = await rt.chaos.kill("rollout", 1)
            await rt.trainer("train_step")
            report = await rt.sync()  # waits for the failover, then syncs
    syncs = [e for e in told if e.phase == "sync"]
    assert [e.facts["weights_version"] for e in syncs] == [1, 2]
    assert syncs[-1].message.startswith(f"weights version 2 synced to {len(report.rollouts)} rollouts in ")
    [failover] = [e for e in told if e.phase == "failover"]
    assert failover.facts["lost"] == lost and failover.facts["replacement"] == rt.failovers[0].replacement
    assert failover.message.startswith(f"{lost} lost (process died during ")
    assert f"{rt.failovers[0].replacement} serves weights version 1 after " in failover.message
    logged = [r.getMessage() for r in caplog.records if r.name == "ftstate"]
    assert any("weights version 2 synced to" in m for m in logged), logged
    assert any(f"{lost} lost (" in m for m in logged), logged


async def test_far_more_workers_than_cpus_is_warned_about(ray_cluster, tmp_path, caplog):
    """The session's cluster has 2 CPUs; 8 rollouts and a trainer are 9 processes (> 4 per CPU).
    The warning comes before anything is waited for; the start itself is not the point (with a
    short init_timeout_s it may well time out: 9 processes importing torch on 2 CPUs are slow,
    which is what the warning says)."""
    rt = ftstate.Runtime(config(tmp_path, rollout_workers=8, worker_cpus=0.01, init_timeout_s=5),
                         trainer=TinyTrainer, rollout=TinyRollout)
    with caplog.at_level(logging.INFO, logger="ftstate"), contextlib.suppress(RendezvousTimeout):
        async with rt:
            pass
    [warning] = [r for r in caplog.records if r.name == "ftstate" and r.levelno == logging.WARNING]
    assert "9 worker processes requested on a cluster of 2 CPUs" in warning.getMessage()
    [rec] = [r for r in as_records(tmp_path / "audit.jsonl") if r["event"] == "oversubscribed"]
    assert (rec["processes"], rec["cpus"]) == (9, 2.0)
