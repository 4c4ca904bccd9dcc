"""Property-based fuzzing of the trail reader, the checker, the views and ``ftstate audit``.

Inputs: mutated copies of the demo's real trail (tests/unit/data/demo-audit.jsonl) and of a
two-run synthetic one (a field set to any JSON value, a field dropped, a
line cut at any byte, bytes spliced in, lines swapped or repeated) and records of arbitrary
JSON. The property: only typed outcomes (violations, exit status 0, 1 or 2 with no
traceback) within a bounded time per case (hypothesis ``deadline``: 10 s, against ~0.2-0.5 s a
case takes here; generous because the machine running it may be loaded). Case counts are the
``max_examples`` below (FUZZ_EXAMPLES each, half that for the CLI: 175 in all with the default 50; set
FTSTATE_FUZZ_EXAMPLES for a longer run).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from ftstate.cli.audit_view import (
    failover_rows,
    plain_lines,
    render_maintenance,
    render_summary,
    render_timeline,
    select,
)
from ftstate.cli.main import app
from ftstate.core.audit import parse_lines, split_runs
from ftstate.core.audit_check import check, load_records
from tests.unit._trails import write_trail

#: Cases per property (override with FTSTATE_FUZZ_EXAMPLES for a longer run).
FUZZ_EXAMPLES = int(os.environ.get("FTSTATE_FUZZ_EXAMPLES", "50"))
COMMON = settings(max_examples=FUZZ_EXAMPLES, deadline=10_000, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_ROOT = Path(__file__).resolve().parent
_SYNTHETIC = write_trail(Path(os.environ.get("TMPDIR", "/tmp")) / f"ftstate-fuzz-base-{os.getpid()}.jsonl",
                         runs=("run-a", "run-b")).read_bytes().splitlines()
#: The trail of a real `make docs` demo run (24 steps, three kills, 305 records).
_DEMO = (_ROOT / "data" / "demo-audit.jsonl").read_bytes().splitlines()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["event", "machine", "member", "from", "to", "trigger", "role", "rank", "pid", "t", "ts", "run",
          "group_version", "weights_version", "seconds_in_state", "checksum", "reason", "message", "lost",
          "replacement", "total_s", "transfer_s", "rerendezvous_s", "reward", "step", "deadline", "moved",
          "members", "versions", "nodes", "fault", "budget", "spent", "limit"]


@st.composite
def mutated_trails(draw) -> bytes:
    lines = list(draw(st.sampled_from([_SYNTHETIC, _DEMO])))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["set", "drop", "cut", "splice", "swap", "repeat", "raw"]))
        if kind in ("set", "drop"):
            try:
                rec = json.loads(lines[i])
            except (ValueError, RecursionError):  # a line an earlier mutation made unreadable
                continue
            if not isinstance(rec, dict):
                continue
            key = draw(st.sampled_from(FIELDS))
            if kind == "set":
                rec[key] = draw(json_values)
            else:
                rec.pop(key, None)
            lines[i] = json.dumps(rec).encode()
        elif kind == "cut":
            lines[i] = lines[i][: draw(st.integers(0, max(len(lines[i]) - 1, 0)))]
        elif kind == "splice":
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(st.binary(max_size=12)) + lines[i][at:]
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "repeat":
            lines.insert(i, lines[i])
        else:
            lines[i] = draw(st.sampled_from([b"[" * 3000, b"{" * 200, b'"' * 50, b"null", b"[]", b"{}", b"1e999999"]))
    return b"\n".join(lines) + b"\n"


def exercise_views(records) -> None:
    console = Console(file=io.StringIO(), width=100)
    console.print(render_timeline(records))
    console.print(render_summary(records))
    maintenance = render_maintenance(records)
    if maintenance is not None:
        console.print(maintenance)
    list(plain_lines(records))
    failover_rows(records)
    select(records, members=["rollout-*"], events=["fail*"], since=0.5, until=3.0, failovers=True)
    for _, recs in split_runs(records):
        list(plain_lines(recs, context=recs))


@COMMON
@given(data=mutated_trails())
def test_mutated_trails_read_check_and_render_without_raising(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
    path.write_bytes(data)
    records, bad = load_records(path)
    assert all(v.line >= 1 and v.problem for v in bad)
    result = check(path)
    assert all(isinstance(v.problem, str) for v in result.violations)
    exercise_views(records)


@COMMON
@given(records=st.lists(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=10), max_size=20))
def test_records_of_any_json_are_checked_and_rendered_without_raising(records) -> None:
    for rec in records:
        rec.setdefault("event", "transition")
    result = check(records)
    assert result.records + len({v.line for v in result.violations if "expected" in v.problem}) >= 0
    from ftstate.core.audit import record_problem

    good = [r for r in records if record_problem(r) is None]
    exercise_views(good)


@COMMON
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_are_lines_or_problems(data: bytes) -> None:
    for line, rec, problem in parse_lines(io.BytesIO(data)):
        assert line >= 1 and (rec is None) != (problem is None)


_runner = CliRunner()


@settings(max_examples=max(FUZZ_EXAMPLES // 2, 10), deadline=10_000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=mutated_trails(), flags=st.sampled_from([["--check"], [], ["--failovers"], ["--json", "-m", "rollout-*"],
                                                     ["--check", "--no-timeline"]]))
def test_the_cli_ends_with_a_typed_exit_on_any_mutated_trail(tmp_path_factory, data: bytes, flags) -> None:
    path = tmp_path_factory.mktemp("cli") / "t.jsonl"
    path.write_bytes(data)
    result = _runner.invoke(app, ["audit", str(path), *flags])
    assert result.exit_code in (0, 1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code == 2:
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")
