"""Diagrams are drawn from the specs alone: every state, every explicit edge, nothing random."""

from __future__ import annotations

import pytest

from ftstate.core.diagram import FORMATS, edges, render, wildcards
from ftstate.core.spec import MachineSpec, load_machines

SPECS = load_machines()
CASES = [(name, fmt) for name in SPECS for fmt in FORMATS]


def edge_text(fmt: str, src: str, dst: str) -> str:
    return f"{src} --> {dst} : " if fmt == "mermaid" else f'"{src}" -> "{dst}" [label='


@pytest.mark.parametrize(("name", "fmt"), CASES)
class TestEveryDiagram:
    def test_names_every_state(self, name: str, fmt: str) -> None:
        text = render(SPECS[name], fmt)
        for state in SPECS[name].states:
            assert state in text

    def test_draws_every_explicit_transition_with_its_trigger(self, name: str, fmt: str) -> None:
        spec = SPECS[name]
        lines = render(spec, fmt).splitlines()
        for t in spec.transitions:
            if t.wildcard:
                continue
            matching = [line for line in lines if line.strip().startswith(edge_text(fmt, t.source, t.dest))]
            assert len(matching) == 1, f"{t.source} -> {t.dest}: {matching}"
            assert t.trigger in matching[0]

    def test_is_deterministic(self, name: str, fmt: str) -> None:
        assert render(SPECS[name], fmt) == render(SPECS[name], fmt)

    def test_collapses_the_wildcards_instead_of_drawing_an_edge_from_every_state(
        self, name: str, fmt: str
    ) -> None:
        spec = SPECS[name]
        text = render(spec, fmt)
        explicit_pairs = {(t.source, t.dest) for t in spec.transitions if not t.wildcard}
        for t in spec.transitions:
            if t.wildcard and (t.source, t.dest) not in explicit_pairs:
                assert not any(
                    line.strip().startswith(edge_text(fmt, t.source, t.dest)) for line in text.splitlines()
                )
        for trigger, dest, _ in wildcards(spec):
            assert trigger in text and dest in text

    def test_shows_every_deadline_and_budget_key(self, name: str, fmt: str) -> None:
        spec = SPECS[name]
        text = render(spec, fmt)
        for st in spec.states.values():
            if st.deadline:
                assert f"{st.deadline.on_expiry} ({st.deadline.key})" in text
            if st.budget:
                assert f"budget {st.budget.key}" in text


class TestMermaid:
    def test_starts_at_the_initial_state_and_ends_at_each_terminal_one(self) -> None:
        for spec in SPECS.values():
            text = render(spec, "mermaid")
            assert text.startswith("stateDiagram-v2\n")
            assert f"[*] --> {spec.initial}\n" in text
            for state in spec.terminal_states:
                assert f"{state} --> [*]\n" in text

    def test_styles_the_serving_states(self) -> None:
        text = render(SPECS["worker"], "mermaid")
        assert "classDef serving" in text
        assert "class READY,SYNCING,DRAINING serving" in text

    def test_says_where_fail_and_stop_come_from_in_one_note_each(self) -> None:
        text = render(SPECS["worker"], "mermaid")
        assert "note left of FAILED : fail from every non-terminal state" in text
        assert "note left of STOPPED : stop from every non-terminal state" in text
        assert text.count(" --> FAILED : ") == len([e for e in edges(SPECS["worker"]) if e[1] == "FAILED"])

    def test_joins_the_triggers_of_one_pair_on_one_label(self) -> None:
        assert "SYNCING --> READY : sync_done, sync_failed\n" in render(SPECS["group"], "mermaid")

    def test_a_state_name_that_is_no_identifier_gets_an_alias(self) -> None:
        spec = MachineSpec.from_dict(
            {
                "name": "odd",
                "initial": "NEW ONE",
                "states": {"NEW ONE": {}, "DONE": {"terminal": True}},
                "transitions": [{"trigger": "finish", "source": "NEW ONE", "dest": "DONE"}],
            }
        )
        text = render(spec, "mermaid")
        assert 'state "NEW ONE" as s0' in text
        assert "s0 --> DONE : finish" in text


class TestDot:
    def test_is_a_digraph_with_a_start_point(self) -> None:
        for spec in SPECS.values():
            text = render(spec, "dot")
            assert f'digraph "{spec.name}" {{' in text
            assert f'"__start__" -> "{spec.initial}";' in text
            assert text.rstrip().endswith("}")

    def test_draws_wildcards_as_one_dashed_edge_per_destination(self) -> None:
        text = render(SPECS["group"], "dot")
        assert '"__any__" -> "FAILED" [label="fail", style=dashed' in text
        assert text.count('"__any__" -> ') == 2


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown diagram format 'svg'"):
        render(SPECS["group"], "svg")
