"""Human views of an audit trail: a timeline of every record and a summary per member.

Both take the records as :func:`ftstate.core.audit.read_trail` or
:func:`ftstate.core.audit_check.load_records` give them (``(line, record)`` pairs) or as plain
dicts (``AuditTrail.records``), and return a ``rich`` renderable; printing is the caller's
business (``ftstate audit``). Deadline expiries, errors and budget events are highlighted,
so the record that explains a failed run stands out among the transitions; so are maintenance
notices and drains, which :func:`render_maintenance` also lists on their own (each notice with
its source, kind, node and deadline, each drain with what moved where, how it ended and how
long it took).

This module imports neither Ray nor torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.table import Table
from rich.text import Text

from ftstate.core.audit import BUDGET_EXHAUSTED, BUDGET_SPENT, DEADLINE_EXPIRED, ERROR, TRANSITION, as_records

#: Row style per event; transitions into a terminal failure are styled like errors.
EVENT_STYLES = {
    DEADLINE_EXPIRED: "bold red",
    ERROR: "red",
    BUDGET_EXHAUSTED: "bold red",
    BUDGET_SPENT: "yellow",
    "maintenance_announced": "dark_orange",
    "maintenance_notice": "bold dark_orange",
    "maintenance_withdrawn": "yellow",
    "maintenance_problem": "yellow",
    "drain_started": "dark_orange",
    "drain_drained": "green",
    "drain_failed": "red",
    "drain_cancelled": "yellow",
}
#: The maintenance and drain events (:mod:`ftstate.controller.notices`, :mod:`ftstate.controller.drain`).
NOTICE_EVENTS = ("maintenance_notice", "maintenance_withdrawn")
DRAIN_ENDS = ("drain_drained", "drain_failed", "drain_cancelled")
_FAILED_STATES = {"FAILED", "LOST"}
_ERROR_EVENTS = {DEADLINE_EXPIRED, ERROR, BUDGET_EXHAUSTED}




def _num(value: Any, digits: int = 3) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _versions(rec: Mapping[str, Any]) -> str:
    g, w = rec.get("group_version"), rec.get("weights_version")
    if g is None and w is None:
        return ""
    return f"{_num(g) or '-'}/{_num(w) or '-'}"


def _node(value: Any) -> str:
    return str(value)[:12] if value else "?"


def _deadline(rec: Mapping[str, Any]) -> str:
    """A notice's deadline as UTC time (and how far from the record it was), or 'none given'."""
    deadline = rec.get("deadline")
    if not isinstance(deadline, (int, float)):
        return "no deadline given"
    import datetime as dt

    when = dt.datetime.fromtimestamp(deadline, dt.UTC)
    stamp = rec.get("ts")
    left = ""
    if isinstance(stamp, str):
        try:
            left = f", {deadline - dt.datetime.fromisoformat(stamp.replace('Z', '+00:00')).timestamp():.0f}s ahead"
        except ValueError:
            left = ""
    return f"deadline {when:%H:%M:%S} UTC{left}"


def _maintenance_detail(rec: Mapping[str, Any]) -> str | None:
    event = rec.get("event")
    if event in NOTICE_EVENTS:
        what = f"{rec.get('source')} {rec.get('kind')} on node {_node(rec.get('node_id') or rec.get('node'))}"
        if event == "maintenance_withdrawn":
            return f"{what} withdrawn"
        return f"{what}, {_deadline(rec)}: {rec.get('action') or ''}".rstrip(": ")
    if event == "maintenance_announced":  # the demo's own record: what its metadata server now says
        return f"node {rec.get('name') or _node(rec.get('node_id'))}: {rec.get('reason') or ''}".rstrip(": ")
    if event == "drain_started":
        members = ", ".join(rec.get("members") or []) or "no members"
        return f"node {_node(rec.get('node'))} ({rec.get('source')} {rec.get('kind')}): {members} DRAINING"
    if event in DRAIN_ENDS:
        moved = rec.get("moved") or {}
        what = ", ".join(f"{a} -> {b}" for a, b in moved.items()) if moved else str(rec.get("reason") or "")
        secs = rec.get("seconds")
        took = f" in {secs:.3f}s" if isinstance(secs, (int, float)) else ""
        return f"node {_node(rec.get('node'))}{took}: {what}"
    return None


def _detail(rec: Mapping[str, Any]) -> str:
    event = rec.get("event")
    maintenance = _maintenance_detail(rec)
    if maintenance is not None:
        return maintenance
    parts = []
    if event in (BUDGET_SPENT, BUDGET_EXHAUSTED) and rec.get("budget"):
        spent = rec.get("spent")
        limit = rec.get("limit")
        parts.append(
            f"{rec['budget']} {spent if spent is not None else ''}/{limit if limit is not None else ''}".strip()
        )
    if rec.get("message"):
        parts.append(str(rec["message"]))
    elif rec.get("error"):
        parts.append(str(rec["error"]))
    if rec.get("reason") and event == TRANSITION and not rec.get("message"):
        parts.append(str(rec["reason"]))
    return "; ".join(parts)


def render_timeline(records: Iterable[Any], *, title: str | None = "audit timeline") -> Table:
    """A table with one row per record: t, member, event, from → to, trigger, versions
    (group/weights), seconds in the state left, and the detail (error message, budget)."""
    table = Table(title=title, show_lines=False, header_style="bold", expand=False)
    table.add_column("t (s)", justify="right", no_wrap=True)
    table.add_column("member", no_wrap=True)
    table.add_column("event", overflow="fold")
    table.add_column("from → to", overflow="fold")
    table.add_column("trigger", overflow="fold")
    table.add_column("g/w ver", justify="right", no_wrap=True)
    table.add_column("in state (s)", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for rec in as_records(records):
        event = str(rec.get("event", ""))
        style = EVENT_STYLES.get(event)
        if event == TRANSITION:
            move = f"{rec.get('from', '?')} → {rec.get('to', '?')}"
            if rec.get("to") in _FAILED_STATES:
                style = "red"
        else:
            move = str(rec.get("state", ""))
        cells = (
            _num(rec.get("t")),
            str(rec.get("member", "")),
            event,
            move,
            str(rec.get("trigger", "") or ""),
            _versions(rec),
            _num(rec.get("seconds_in_state")),
            _detail(rec),
        )
        # Text, not str: a message with brackets must not be read as rich markup.
        table.add_row(*(Text(c) for c in cells), style=style)
    return table


def summarize(records: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per member (in order of first appearance): machine, role, rank, pid, states visited,
    seconds spent per state (from ``seconds_in_state`` of the records leaving it),
    transition count, final state and errors (messages of expiries, errors and exhausted budgets)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in as_records(records):
        member = rec.get("member")
        if not member:
            continue
        s = out.get(member)
        if s is None:
            s = out[member] = {
                "machine": rec.get("machine", ""),
                "role": None,
                "rank": None,
                "pid": None,
                "states": [],
                "seconds": {},
                "transitions": 0,
                "final": None,
                "errors": [],
            }
        for key in ("role", "rank", "pid"):
            if rec.get(key) is not None:
                s[key] = rec[key]
        event = rec.get("event")
        if event == TRANSITION:
            src, dst = rec.get("from"), rec.get("to")
            for state in (src, dst):
                if state and state not in s["states"]:
                    s["states"].append(state)
            if src and isinstance(rec.get("seconds_in_state"), (int, float)):
                s["seconds"][src] = s["seconds"].get(src, 0.0) + float(rec["seconds_in_state"])
            s["transitions"] += 1
            s["final"] = dst
        elif event in _ERROR_EVENTS:
            s["errors"].append(str(rec.get("message") or rec.get("error") or event))
    return out


def render_summary(records: Iterable[Any], *, title: str | None = "per member") -> Table:
    """A table with one row per member: role, rank, pid, states visited, time per state,
    transitions, final state and errors."""
    table = Table(title=title, header_style="bold", expand=False)
    table.add_column("member", no_wrap=True)
    table.add_column("role", no_wrap=True)
    table.add_column("rank", justify="right")
    table.add_column("pid", justify="right")
    table.add_column("states visited")
    table.add_column("time per state (s)")
    table.add_column("transitions", justify="right")
    table.add_column("final", no_wrap=True)
    table.add_column("errors", overflow="fold")
    for member, s in summarize(records).items():
        final = s["final"] or ""
        final_text = Text(final, style="red" if final in _FAILED_STATES else "green" if final else "")
        errors = s["errors"]
        error_text = Text("; ".join(errors), style="red") if errors else Text("")
        table.add_row(
            Text(member),
            Text(str(s["role"] or s["machine"] or "")),
            Text(_num(s["rank"])),
            Text(_num(s["pid"])),
            Text(" → ".join(s["states"])),
            Text(", ".join(f"{state} {secs:.3f}" for state, secs in s["seconds"].items())),
            Text(str(s["transitions"])),
            final_text,
            error_text,
        )
    return table


def maintenance_rows(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The trail's maintenance story in order: every notice, withdrawal, source problem and
    drain outcome, as ``{t, what, node, detail, style}``."""
    rows = []
    for rec in as_records(records):
        event = str(rec.get("event", ""))
        if event not in (*NOTICE_EVENTS, "maintenance_problem", *DRAIN_ENDS):
            continue
        if event == "maintenance_problem":
            detail = str(rec.get("message") or rec.get("reason") or "")
            node = rec.get("node")
        else:
            detail = _maintenance_detail(rec) or ""
            node = rec.get("node_id") or rec.get("node")
        what = {"maintenance_notice": "notice", "maintenance_withdrawn": "withdrawn",
                "maintenance_problem": "warning"}.get(event, event.replace("_", " "))
        rows.append({"t": rec.get("t"), "what": what, "node": _node(node) if node else "",
                     "detail": detail, "style": EVENT_STYLES.get(event, "")})
    return rows


def render_maintenance(records: Iterable[Any], *, title: str | None = "maintenance") -> Table | None:
    """A table of the trail's maintenance notices, withdrawals, warnings and drains (see
    :func:`maintenance_rows`); None when the trail has none."""
    rows = maintenance_rows(records)
    if not rows:
        return None
    table = Table(title=title, header_style="bold", expand=False)
    table.add_column("t (s)", justify="right", no_wrap=True)
    table.add_column("what", no_wrap=True)
    table.add_column("node", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in rows:
        table.add_row(Text(_num(r["t"])), Text(r["what"]), Text(r["node"]), Text(r["detail"]), style=r["style"])
    return table


__all__ = ["EVENT_STYLES", "maintenance_rows", "render_maintenance", "render_summary", "render_timeline",
           "summarize"]
