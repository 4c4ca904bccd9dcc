"""One run, one trail; an audit view for people; a reader that hostile files cannot crash.

Through the real CLI (typer's runner) on trails written by the real AuditTrail: runs appended
to one file are checked one by one; every event kind has its content in the detail column;
each filter selects what it says; piped output is plain lines, a terminal's fits COLUMNS; an
empty or unreadable file exits 2 with one line, distinct from 1 (violations); hostile lines
(deep nesting, wrong types, over-long lines, not UTF-8) are violations, never tracebacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftstate.cli.audit_view import failover_rows, plain_lines, select
from ftstate.cli.main import app
from ftstate.core.audit import MAX_LINE_BYTES, AuditTrail, as_records, split_runs
from ftstate.core.audit_check import check, load_records
from tests.unit._trails import write_trail

runner = CliRunner()


def audit(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, ["audit", *args], env=env)


def lines_of(result) -> list[str]:
    return [ln for ln in result.stdout.splitlines() if ln.strip()]


class TestOneRunOneTrail:
    def test_every_record_carries_the_run_and_the_first_says_what_started(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        records = as_records(path)
        assert records[0]["event"] == "run_start"
        assert records[0]["config_digest"] == "0123456789abcdef" and records[0]["versions"]["torch"] == "2.13.0"
        assert {r.get("run") for r in records} == {"run-a"}

    def test_two_runs_appended_to_one_file_pass_the_check_run_by_run(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl", runs=("run-a", "run-b"))
        assert [rid for rid, _ in split_runs(load_records(path)[0])] == ["run-a", "run-b"]
        result = audit(str(path), "--check", "--no-timeline", "--no-summary")
        assert result.exit_code == 0, result.output
        assert "audit check passed" in result.stdout and "2 runs" in result.stdout

    def test_without_run_ids_the_same_two_runs_break_the_check(self, tmp_path: Path) -> None:
        """What the run id buys: the same records without it are one run that goes on after STOPPED."""
        path = write_trail(tmp_path / "audit.jsonl", runs=("run-a", "run-b"))
        bare = tmp_path / "bare.jsonl"
        with bare.open("w") as f:
            for rec in as_records(path):
                if rec["event"] != "run_start":
                    rec.pop("run")
                    f.write(json.dumps(rec) + "\n")
        result = audit(str(bare), "--check", "--no-timeline", "--no-summary")
        assert result.exit_code == 1
        assert "after group entered terminal state STOPPED" in result.stdout

    def test_the_view_shows_each_run_under_its_own_heading(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl", runs=("run-a", "run-b"))
        out = audit(str(path), "--no-summary").stdout
        assert out.count("== ") == 2 and "run run-a" in out and "run run-b" in out
        only_b = audit(str(path), "--no-summary", "--run", "run-b", "--json").stdout
        assert {json.loads(ln)["run"] for ln in only_b.splitlines()} == {"run-b"}
        missing = audit(str(path), "--run", "nope")
        assert missing.exit_code == 2 and "no run 'nope'" in missing.output

    def test_ansi_escapes_never_reach_a_record(self, tmp_path: Path) -> None:
        path = tmp_path / "audit.jsonl"
        with AuditTrail(path) as trail:
            trail.record("error", member="rollout-0", message="\x1b[36mray::ftstate\x1b[0m boom\x07",
                         detail={"x": ["\x1b[1mbold"]})
        text = path.read_text()
        assert "\\u001b" not in text and "\\u0007" not in text
        rec = as_records(path)[0]
        assert rec["message"] == "ray::ftstate boom" and rec["detail"] == {"x": ["bold"]}


class TestHowARecordIsWritten:
    """Each record is one compact line (orjson), whatever its values: what orjson refuses goes
    through the standard library's encoder in the same form, and what JSON cannot hold goes as
    its ``str``, as before."""

    def test_every_value_lands_on_one_line_that_reads_back(self, tmp_path: Path) -> None:
        import dataclasses
        import datetime

        @dataclasses.dataclass
        class Plan:
            rollouts: int

        path = tmp_path / "audit.jsonl"
        with AuditTrail(path) as trail:
            trail.record("note", plan=Plan(3), at=datetime.datetime(2026, 1, 2, 3, 4, 5), where=Path("/x"))
            trail.record("note", nbytes=2**70, n=7, keys={1: "one"})  # past 64 bits: orjson refuses
            trail.record("note", reason="\udc80 lone surrogate")  # not UTF-8 encodable: orjson refuses
        lines = path.read_bytes().splitlines()
        assert len(lines) == 3 and all(ln.startswith(b'{"ts":"') for ln in lines)
        first, big, surrogate = as_records(path)
        assert first["plan"].endswith("Plan(rollouts=3)")
        assert (first["at"], first["where"]) == ("2026-01-02 03:04:05", "/x")
        assert big["nbytes"] == 2**70 and big["n"] == 7 and big["keys"] == {"1": "one"}
        assert surrogate["reason"].endswith("lone surrogate")


class TestUnreadable:
    @pytest.mark.parametrize("content,says", [
        (b"", "the file is empty"),
        (b"\n\n", "the file is empty"),
        (b"hello world\nnot json\n", "not an audit trail"),
        (b"[" * 100_000, "not an audit trail"),
        (b"[" * 5000 + b"]" * 5000 + b"\n", "not an audit trail"),
        (b"\xff\xfe\x00garbage\n", "not an audit trail"),
        (b'{"event": 5}\n', "not an audit trail"),
    ], ids=["empty", "blank", "text", "open-brackets", "deep", "binary", "event-not-str"])
    @pytest.mark.parametrize("check", [True, False], ids=["check", "view"])
    def test_a_file_with_no_record_exits_2_with_one_line(self, tmp_path: Path, content: bytes, says: str,
                                                         check: bool) -> None:
        path = tmp_path / "t.jsonl"
        path.write_bytes(content)
        result = audit(str(path), *(["--check"] if check else []))
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        [line] = result.stderr.splitlines()
        assert line.startswith("error: ") and says in line

    def test_a_missing_file_and_a_folder_exit_2(self, tmp_path: Path) -> None:
        for target in (tmp_path / "absent.jsonl", tmp_path):
            result = audit(str(target), "--check")
            assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.output


class TestHostileLines:
    """Bad lines inside a real trail are violations with their line number (exit 1 under
    --check, warnings in the view); the good records are still checked and shown."""

    def with_bad_line(self, tmp_path: Path, bad: bytes) -> Path:
        path = write_trail(tmp_path / "audit.jsonl")
        lines = path.read_bytes().splitlines(keepends=True)
        lines.insert(3, bad.rstrip(b"\n") + b"\n")
        path.write_bytes(b"".join(lines))
        return path

    @pytest.mark.parametrize("bad,problem", [
        (b"[" * 100_000, "nested deeper than"),
        (b'{"event": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper than"),
        (b'{"event": "transition", "machine": "worker", "member": ["rollout-0"], "from": 1}', "field 'member'"),
        (b'{"event": "transition", "machine": "group", "member": "group", "weights_version": [1]}',
         "field 'weights_version'"),
        (b'{"event": "transition", "t": "soon"}', "field 't'"),
        (b'{"event": "transition", "rank": true}', "field 'rank'"),
        (b"\xc3\x28 not utf-8", "not UTF-8"),
        (b'{"event": "x", "n": 1' + b"0" * 5000 + b"}", "not a JSON object"),
    ], ids=["brackets", "deep-value", "member-list", "version-list", "t-str", "rank-bool", "utf8", "huge-int"])
    def test_a_hostile_line_is_a_violation_naming_it(self, tmp_path: Path, bad: bytes, problem: str) -> None:
        path = self.with_bad_line(tmp_path, bad)
        result = audit(str(path), "--check", "--no-timeline", "--no-summary")
        assert result.exit_code == 1, result.output
        [violation] = [ln for ln in result.stdout.splitlines() if ln.startswith(f"{path}:")]
        assert violation.startswith(f"{path}:4: ") and problem in violation, violation
        view = audit(str(path))
        assert view.exit_code == 0 and problem in view.stderr

    def test_a_line_longer_than_the_cap_is_skipped_without_reading_it_whole(self, tmp_path: Path) -> None:
        path = self.with_bad_line(tmp_path, b'{"event": "x", "pad": "' + b"a" * (3 * MAX_LINE_BYTES) + b'"}')
        records, bad = load_records(path)
        assert [v.line for v in bad] == [4] and "longer than" in bad[0].problem
        assert len(records) == len(as_records(write_trail(tmp_path / "again.jsonl")))
        result = audit(str(path), "--check", "--no-timeline", "--no-summary")
        assert result.exit_code == 1 and f"{path}:4: line longer than {MAX_LINE_BYTES} bytes" in result.stdout

    def test_checker_fed_records_of_wrong_types_reports_them(self) -> None:
        result = check([{"event": "transition", "machine": "worker", "member": {"a": 1}},
                        {"event": "transition", "machine": "group", "member": "group", "from": "INIT",
                         "to": "RENDEZVOUS", "trigger": "start", "weights_version": {"v": 1}}])
        assert [v.line for v in result.violations] == [1, 2]
        assert all("expected" in v.problem for v in result.violations)


class TestView:
    def test_every_event_kind_shows_its_content(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        out = audit(str(path), "--no-summary").stdout
        by_event: dict[str, list[str]] = {}
        for line in out.splitlines()[2:]:
            cells = line.split("\t")
            by_event.setdefault(cells[2], []).append(cells[-1])
        [failover] = by_event["failover"]
        assert failover.startswith("rollout-1 -> spare-rollout-0: detection 0.070s, re-rendezvous 0.040s, "
                                   "transfer 0.030s, total 0.080s; cause: process died during vigil()"), failover
        assert by_event["chaos"] == ["kill injected into rollout-1 (pid 4242)"]
        assert by_event["reward"] == ["step 1: reward 0.1250", "step 2: reward 0.5000"]
        assert by_event["sync_retry"] == ["transient_retries 1, nobody lost: PeerLost: rollout-0: a peer was lost "
                                          "during bucket 2/4"]
        assert by_event["call_retry"] == ["method generate, attempt 1, items 4"]
        assert by_event["transfer_abandoned"] == ["rollout-0: PeerLost: bucket 2/4; abandoned by spare-rollout-0"]
        assert by_event["run_start"][0].startswith("run run-a: 1 trainer(s), 2 rollout(s), config 0123456789abcdef")
        assert by_event["budget_spent"] == ["max_failovers 1/5"]
        assert "members=trainer-0, rollout-0, spare-rollout-0" in by_event["group_formed"][0]
        for event, details in by_event.items():
            if event != "transition":
                assert all(details), f"{event} has an empty detail"

    def test_piped_output_is_one_plain_line_per_record(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        result = audit(str(path), "--no-summary")
        lines = result.stdout.splitlines()
        n = len(as_records(path))
        assert len(lines) == n + 2  # the run's heading and the header
        assert all(len(ln.split("\t")) == 8 for ln in lines[1:])
        assert "\x1b" not in result.stdout and "│" not in result.stdout

    @pytest.mark.parametrize("columns", [80, 132])
    def test_on_a_terminal_the_tables_fit_columns(self, tmp_path: Path, columns: int) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        result = audit(str(path), env={"COLUMNS": str(columns)})
        assert result.exit_code == 0
        widths = [len(ln) for ln in result.stdout.splitlines()]
        assert max(widths) <= columns, max(widths)
        assert "spare-rollout-0" in result.stdout and "│" in result.stdout

    def test_member_filter_takes_patterns_and_failovers_of_the_member(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        recs = [json.loads(ln) for ln in audit(str(path), "--member", "rollout-1", "--json").stdout.splitlines()]
        assert {r["event"] for r in recs} == {"transition", "chaos", "failover"}
        assert all("rollout-1" in (r.get("member"), r.get("lost")) for r in recs)
        pattern = [json.loads(ln) for ln in audit(str(path), "-m", "rollout-*", "--json").stdout.splitlines()]
        assert {r["member"] for r in pattern if "member" in r} == {"rollout-0", "rollout-1"}

    def test_event_filter_takes_events_and_triggers(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        recs = [json.loads(ln) for ln in
                audit(str(path), "--event", "reward", "-e", "died", "--json").stdout.splitlines()]
        assert [r["event"] for r in recs] == ["reward", "transition", "reward"]
        assert recs[1]["trigger"] == "died"
        sync = [json.loads(ln) for ln in audit(str(path), "-e", "sync_*", "--json").stdout.splitlines()]
        assert {r.get("trigger") or r["event"] for r in sync} == {"sync_start", "sync_done", "sync_failed",
                                                                  "sync_retry"}

    def test_since_and_until_bound_the_time_window(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        recs = [json.loads(ln) for ln in
                audit(str(path), "--since", "2", "--until", "2.1", "--json").stdout.splitlines()]
        assert recs and all(2 <= r["t"] <= 2.1 for r in recs)
        assert {r["event"] for r in recs} == {"chaos", "transition", "budget_spent"}

    def test_failovers_shows_only_the_failover_story(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        result = audit(str(path), "--failovers")
        rows = [ln.split("\t") for ln in result.stdout.splitlines()[2:]]
        events = [(r[1], r[2], r[4]) for r in rows]
        assert ("rollout-1", "chaos", "") in events and ("group", "transition", "promote") in events
        assert any(e[1] == "failover" for e in events) and ("rollout-1", "transition", "died") in events
        assert not any(e[1] == "reward" or e[2] in ("sync_start", "joined") for e in events)
        # the summary table is left out when a filter is on
        assert "per member" not in result.stdout

    def test_failover_durations_are_read_in_one_place(self, tmp_path: Path) -> None:
        path = write_trail(tmp_path / "audit.jsonl")
        [row] = failover_rows(load_records(path)[0])
        assert (row["lost"], row["replacement"]) == ("rollout-1", "spare-rollout-0")
        assert row["detection_s"] == pytest.approx(0.07) and row["total_s"] == 0.08
        assert row["cause"].startswith("process died during vigil()")
        # a filtered view still knows the cause from the whole run
        only = select(load_records(path)[0], events=["failover"])
        [line] = list(plain_lines(only, context=load_records(path)[0]))[1:]
        assert "detection 0.070s" in line and "cause: process died" in line


def test_a_big_hostile_file_is_read_whole_and_refused_as_not_an_audit_trail(tmp_path: Path) -> None:
    """20,000 lines of nesting just past the bound and wrong types: read, checked and refused
    (exit code 2), not a crash; how long it takes is not asserted on a shared machine."""
    path = tmp_path / "big.jsonl"
    deep = b'{"event": "x", "a": ' + b"[" * 40 + b"]" * 40 + b"}\n"
    wrong = b'{"event": "transition", "machine": "worker", "member": "m", "from": {"a": 1}}\n'
    path.write_bytes((deep + wrong) * 10_000)
    result = audit(str(path), "--check", "--no-timeline", "--no-summary")
    assert result.exit_code == 2 and "not an audit trail" in result.stderr


def test_the_picture_draws_each_failover_with_the_reports_figure(tmp_path: Path) -> None:
    """The picture's failover band runs from LOST to serving, the failover record's total_s:
    the figure the report and `ftstate audit` print, from the same record."""
    from ftstate.cli.plot import _failovers, plot_timeline

    path = write_trail(tmp_path / "audit.jsonl")
    records = as_records(path)
    [band] = _failovers(records, 10.0)
    [row] = failover_rows(records)
    assert band.reason == "rollout-1 -> spare-rollout-0"
    assert round(band.end - band.start, 6) == row["total_s"] == 0.08
    assert plot_timeline(records, tmp_path / "t.png").stat().st_size > 0
