"""Failure mixes, the status quo's cost and ftstate's measured on the real controller, and
``ftstate simulate`` (issue 27; no Ray)."""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from ftstate.cli.main import app
from ftstate.core.errors import ConfigError
from ftstate.simulation import clock
from ftstate.simulation.costs import Costs
from ftstate.simulation.goodput import StatusQuo, replay_ftstate, status_quo
from ftstate.simulation.mix import LLAMA3, Failure, draw_schedule, get_mix
from ftstate.simulation.scenario import Shape

DAY = 86400.0


class TestTheLlama3Mix:
    def test_it_is_the_published_table(self):
        assert LLAMA3.total == 419
        assert LLAMA3.causes["faulty GPU"] == (148, "member") and LLAMA3.causes["host maintenance"][1] == "maintenance"
        # about one interruption every three hours for the whole 16,384-GPU job
        hours_between = 24 / (16384 * LLAMA3.per_gpu_day)
        assert hours_between == pytest.approx(3.09, abs=0.01)

    def test_a_schedule_is_a_function_of_its_seed_and_has_the_mix_rate(self):
        a = draw_schedule(LLAMA3, gpus=16384, seconds=54 * DAY, seed=3)
        assert a == draw_schedule(LLAMA3, gpus=16384, seconds=54 * DAY, seed=3)
        assert a != draw_schedule(LLAMA3, gpus=16384, seconds=54 * DAY, seed=4)
        assert 419 * 0.85 < len(a) < 419 * 1.15
        assert all(x.at < y.at for x, y in itertools.pairwise(a))

    def test_an_unknown_mix_is_refused_naming_the_known_ones(self):
        with pytest.raises(ConfigError, match="llama3"):
            get_mix("gemini")


class TestTheStatusQuo:
    def test_a_failure_loses_the_progress_since_the_checkpoint_and_a_restart(self):
        r = status_quo([Failure(at=5000.0, cause="faulty GPU", effect="member", pick=0.0)], 10000.0,
                       StatusQuo(checkpoint_interval_s=3600.0, restart_s=100.0))
        assert r.outcomes[0].downtime_s == pytest.approx(1400.0 + 100.0)
        assert r.goodput == pytest.approx((10000.0 - 1500.0) / 10000.0)

    def test_a_maintenance_notice_loses_only_the_restart(self):
        r = status_quo([Failure(at=5000.0, cause="host maintenance", effect="maintenance", pick=0.0)], 10000.0,
                       StatusQuo(checkpoint_interval_s=3600.0, restart_s=100.0))
        assert r.outcomes[0].downtime_s == pytest.approx(100.0)


QUIET = Costs(jitter=0.0)


class TestFtstateOnTheRealController:
    def test_a_rollout_loss_costs_little_and_a_trainer_loss_its_recovery(self):
        schedule = [Failure(at=100.0, cause="faulty GPU", effect="member", pick=0.5),  # a rollout
                    Failure(at=200.0, cause="software bug", effect="member", pick=0.0)]  # the trainer
        r = clock.run(replay_ftstate(schedule, 1000.0, shape=Shape(rollouts=4, nodes=2, spares=1), costs=QUIET))
        # 7 members (trainer, 4 rollouts, 2 spares): pick 0.5 is the 4th, pick 0 the trainer
        assert r.ended_at is None and [o.target for o in r.outcomes] == ["rollout-2", "trainer-0"]
        rollout, trainer = (o.downtime_s for o in r.outcomes)
        assert rollout < 1.0
        assert 0.1 < trainer < QUIET.train_step_s + 5.0  # its step again, on the resynced spare
        assert r.goodput == pytest.approx(1 - (rollout + trainer) / 1000.0)

    def test_a_failure_past_max_failovers_ends_the_job_there(self):
        schedule = [Failure(at=100.0, cause="faulty GPU", effect="member", pick=0.5),
                    Failure(at=300.0, cause="faulty GPU", effect="member", pick=0.5)]
        r = clock.run(replay_ftstate(schedule, 1000.0, shape=Shape(rollouts=4, nodes=2, spares=1), costs=QUIET,
                                     overrides={"fault_tolerance": {"max_failovers": 1}}))
        assert r.ended_at == 300.0 and "FailoverBudgetExhausted" in (r.error or "")
        assert r.goodput < 0.31


class TestTheCommand:
    def test_it_reports_both_goodputs_and_writes_the_figures(self, tmp_path):
        out = tmp_path / "figures.json"
        result = CliRunner().invoke(app, ["simulate", "--members", "20", "--days", "20", "--seed", "2",
                                          "--json", str(out)])
        assert result.exit_code == 0, result.output
        assert "ftstate goodput:" in result.output and "status quo goodput:" in result.output
        figures = json.loads(out.read_text())
        assert figures["mix"] == "llama3" and figures["shape"]["rollouts"] == 16
        assert figures["shape"]["trainers"] == 2  # one trainer rank per 8 members
        assert figures["ftstate"]["goodput"] >= figures["status_quo"]["goodput"]

    def test_a_bad_mix_is_one_line_naming_the_field(self):
        result = CliRunner().invoke(app, ["simulate", "--mix", "nope", "--members", "20"])
        assert result.exit_code == 2 and "mix" in result.output and "Traceback" not in result.output
