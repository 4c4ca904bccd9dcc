"""The audit vocabulary is declared once (ftstate.core.events): the code writes only declared
kinds, every declared kind is written somewhere, and the writer, the checker and the view all
read the one declaration."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from ftstate.cli.audit_view import EVENT_STYLES, FAILOVER_EVENTS
from ftstate.core.audit import AuditTrail
from ftstate.core.audit_check import TrailChecker
from ftstate.core.errors import InternalError
from ftstate.core.events import KINDS, in_story, tone_of

PACKAGE = Path(__file__).resolve().parents[2] / "ftstate"
#: drain.py writes ``drain_{outcome}``; its outcomes
DRAIN_OUTCOMES = ("drained", "failed", "cancelled")


@functools.cache
def written_kinds() -> dict[str, str]:
    """Each literal kind passed to ``.record(...)``/``.record_plain(...)`` in the package, with
    one place that writes it."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("record", "record_plain") and node.args):
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.setdefault(first.value, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
                elif isinstance(first, ast.JoinedStr) and "drain_{" in ast.unparse(first):
                    for outcome in DRAIN_OUTCOMES:
                        found.setdefault(f"drain_{outcome}", f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


class TestOneDeclaration:
    def test_every_kind_the_code_writes_is_declared(self):
        written = written_kinds()
        assert len(written) > 40  # the scan sees the package's records
        assert {k: where for k, where in written.items() if k not in KINDS} == {}

    def test_every_declared_kind_is_written_somewhere(self):
        # written as a literal, or through a constant of ftstate.core.audit (transition, error, ...)
        source = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")
                           if p.name != "events.py")
        written = written_kinds()
        unwritten = [k for k in KINDS if k not in written and f'"{k}"' not in source and k != "note"]
        assert unwritten == []

    def test_the_writer_refuses_an_undeclared_kind_naming_it(self):
        log = AuditTrail()
        with pytest.raises(InternalError, match="'made_up_kind' is not declared"):
            log.record("made_up_kind", member="rollout-0")
        log.record("note", mark="fine")
        assert log.records[-1]["event"] == "note"

    def test_the_checker_reports_an_undeclared_kind(self):
        checker = TrailChecker()
        checker.feed(1, {"event": "made_up_kind", "member": "rollout-0"})
        assert [v.problem for v in checker.violations] == [
            "unknown record kind 'made_up_kind' (not declared in ftstate.core.events)"]


class TestTheViewReadsTheDeclaration:
    def test_styles_follow_the_declared_tones(self):
        assert EVENT_STYLES["node_lost"] == EVENT_STYLES["error"] == "red"
        assert EVENT_STYLES["failover"] == "bold magenta"
        assert "weights_sent" not in EVENT_STYLES and tone_of("weights_sent") == "info"
        assert tone_of("from_an_older_trail") == "info"

    def test_the_failover_story_is_the_declared_one(self):
        assert in_story("failover") == FAILOVER_EVENTS
        assert {"failover", "node_lost", "budget_exhausted", "chaos"} <= FAILOVER_EVENTS
        assert "weights_sent" not in FAILOVER_EVENTS
