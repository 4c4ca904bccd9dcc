"""Diagrams of the machines (Mermaid ``stateDiagram-v2`` or Graphviz DOT), drawn from their specs alone, so
the same spec gives the same text byte for byte. Hand-written rather than ``transitions``' extension, which
needs Graphviz and knows nothing of deadlines, budgets, serving and terminal states; each of those is drawn
here, and the ``"*"`` wildcards are collapsed into one note per destination. Imports neither Ray nor torch."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from ftstate.core.spec import MachineSpec, TransitionSpec

Format = Literal["mermaid", "dot"]
FORMATS: tuple[str, ...] = ("mermaid", "dot")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Mermaid class definitions (kept in one place so the docs and the CLI agree).
_MERMAID_CLASSES = {
    "serving": "fill:#c8e6c9,stroke:#2e7d32,stroke-width:2px",
    "terminal": "fill:#eeeeee,stroke:#616161",
}
_DOT_SERVING = 'style="rounded,filled,bold", fillcolor="#c8e6c9", color="#2e7d32"'
_DOT_TERMINAL = 'style="rounded,filled", fillcolor="#eeeeee", peripheries=2'


def render(spec: MachineSpec, fmt: str = "mermaid") -> str:
    """The diagram of ``spec`` as text in ``fmt`` (``"mermaid"`` or ``"dot"``), ending in a newline."""
    if fmt == "mermaid":
        return _mermaid(spec)
    if fmt == "dot":
        return _dot(spec)
    raise ValueError(f"unknown diagram format {fmt!r}; expected one of: {', '.join(FORMATS)}")


# -- what both formats draw ------------------------------------------------------------


def edges(spec: MachineSpec) -> list[tuple[str, str, list[str]]]:
    """The explicit edges, ``(source, dest, labels)`` in spec order, one per pair; a deadline's or budget's
    key is appended to the trigger that fires when it runs out. Wildcards are left out."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for t in spec.transitions:
        if t.wildcard:
            continue
        label = _label(spec, t)
        labels = pairs.setdefault((t.source, t.dest), [])
        if label not in labels:
            labels.append(label)
    return [(src, dst, labels) for (src, dst), labels in pairs.items()]


def wildcards(spec: MachineSpec) -> list[tuple[str, str, str]]:
    """The collapsed wildcard transitions: ``(trigger, dest, "from every non-terminal state")``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for t in spec.transitions:
        if t.wildcard:
            groups.setdefault((t.trigger, t.dest), []).append(t.source)
    out = []
    non_terminal = [s for s in spec.states if s not in spec.terminal_states]
    for (trigger, dest), sources in groups.items():
        everyone = [s for s in non_terminal if s != dest]
        if sorted(sources) == sorted(everyone):
            where = (
                "from every non-terminal state"
                if dest not in non_terminal
                else "from every other non-terminal state"
            )
        else:  # pragma: no cover - the parser always expands "*" to every non-terminal state
            where = "from " + ", ".join(sources)
        out.append((trigger, dest, where))
    return out


def _label(spec: MachineSpec, t: TransitionSpec) -> str:
    d = spec.states[t.source].deadline
    if d is not None and d.on_expiry == t.trigger:
        return f"{t.trigger} ({d.key})"
    for st in spec.states.values():
        if st.budget is not None and st.budget.on_exhausted == t.trigger:
            return f"{t.trigger} ({st.budget.key} spent)"
    return t.trigger


def _annotations(spec: MachineSpec, state: str) -> list[str]:
    st = spec.states[state]
    notes = []
    if st.deadline is not None:
        notes.append(f"deadline {st.deadline.key}")
    if st.budget is not None:
        notes.append(f"budget {st.budget.key}")
    if st.serving:
        notes.append("serving")
    return notes


# -- Mermaid ---------------------------------------------------------------------------


def _mermaid_ids(spec: MachineSpec) -> dict[str, str]:
    return {name: name if _IDENT.match(name) else f"s{i}" for i, name in enumerate(spec.states)}


def _mermaid_text(text: str) -> str:
    # A label runs to the end of the line; ';' and '#' would be read as syntax, ':' as a new label.
    return text.replace(":", " -").replace(";", ",").replace("#", "").replace("\n", " ")


def _mermaid(spec: MachineSpec) -> str:
    ids = _mermaid_ids(spec)
    lines = [
        "stateDiagram-v2",
        f"    %% {spec.name} machine, generated from {_source_name(spec)} by ftstate.core.diagram",
    ]
    for cls, style in _MERMAID_CLASSES.items():
        lines.append(f"    classDef {cls} {style}")
    for name, sid in ids.items():
        if sid != name:
            lines.append(f'    state "{_mermaid_text(name)}" as {sid}')
    for name, sid in ids.items():
        for note in _annotations(spec, name):
            if note != "serving":
                lines.append(f"    {sid} : {_mermaid_text(note)}")
    lines.append(f"    [*] --> {ids[spec.initial]}")
    for src, dst, labels in edges(spec):
        lines.append(f"    {ids[src]} --> {ids[dst]} : {_mermaid_text(', '.join(labels))}")
    for name in spec.states:
        if name in spec.terminal_states:
            lines.append(f"    {ids[name]} --> [*]")
    for trigger, dest, where in wildcards(spec):
        lines.append(f"    note left of {ids[dest]} : {_mermaid_text(f'{trigger} {where}')}")
    serving = [ids[s] for s in spec.states if s in spec.serving_states]
    terminal = [ids[s] for s in spec.states if s in spec.terminal_states]
    if serving:
        lines.append(f"    class {','.join(serving)} serving")
    if terminal:
        lines.append(f"    class {','.join(terminal)} terminal")
    return "\n".join(lines) + "\n"


# -- DOT -------------------------------------------------------------------------------


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot(spec: MachineSpec) -> str:
    q = _dot_quote
    lines = [
        f"// {spec.name} machine, generated from {_source_name(spec)} by ftstate.core.diagram",
        f"digraph {q(spec.name)} {{",
        "    rankdir=LR;",
        '    node [shape=box, style=rounded, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
        '    "__start__" [shape=point, label=""];',
    ]
    for name in spec.states:
        label = "\n".join([name, *_annotations(spec, name)])
        attrs = [f"label={q(label)}"]
        if name in spec.serving_states:
            attrs.append(_DOT_SERVING)
        elif name in spec.terminal_states:
            attrs.append(_DOT_TERMINAL)
        lines.append(f"    {q(name)} [{', '.join(attrs)}];")
    lines.append(f'    "__start__" -> {q(spec.initial)};')
    for src, dst, labels in edges(spec):
        lines.append(f"    {q(src)} -> {q(dst)} [label={q(', '.join(labels))}];")
    collapsed = wildcards(spec)
    if collapsed:
        lines.append('    "__any__" [shape=plaintext, label="any non-terminal state"];')
        for trigger, dest, where in collapsed:
            lines.append(
                f'    "__any__" -> {q(dest)} [label={q(trigger)}, style=dashed, tooltip={q(f"{trigger} {where}")}];'
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def _source_name(spec: MachineSpec) -> str:
    # Only the file name: the text must not depend on where the repository lives.
    src = spec.source.replace("\\", "/")
    return f"machines/{src.rsplit('/', 1)[-1]}" if src.endswith((".yaml", ".yml")) else src


def render_all(specs: Iterable[MachineSpec], fmt: str = "mermaid") -> str:
    """Several diagrams, one after another, separated by a blank line."""
    return "\n".join(render(spec, fmt) for spec in specs)
