"""Human views of an audit trail for ``ftstate audit``: a timeline of every record with a one-line detail per
event, a summary per member, and the maintenance story. :func:`failover_rows` is the one place failover
durations are read, so the picture and the demo report print the same figures. Trail values are untrusted:
each is shown bounded, without markup. Returns ``rich`` renderables; printing is the caller's. Imports neither
Ray nor torch."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from ftstate.core.audit import (
    BUDGET_EXHAUSTED,
    BUDGET_SPENT,
    DEADLINE_EXPIRED,
    ERROR,
    RUN_START,
    TRANSITION,
    as_records,
)
from ftstate.core.events import KINDS, in_story
from ftstate.core.text import bounded, clean

#: Row style per tone of a record kind (:mod:`ftstate.core.events`); transitions into a terminal
#: failure are styled like errors.
TONE_STYLES = {"fatal": "bold red", "fault": "red", "warning": "yellow", "notice": "dark_orange",
               "alert": "bold dark_orange", "failover": "bold magenta", "good": "green", "start": "bold cyan"}
EVENT_STYLES = {name: TONE_STYLES[kind.tone] for name, kind in KINDS.items() if kind.tone in TONE_STYLES}
#: The maintenance and drain events (:mod:`ftstate.controller.notices`, :mod:`ftstate.controller.drain`).
NOTICE_EVENTS = ("maintenance_notice", "maintenance_withdrawn")
DRAIN_ENDS = ("drain_drained", "drain_failed", "drain_cancelled")
_FAILED_STATES = {"FAILED", "LOST"}
_ERROR_EVENTS = {DEADLINE_EXPIRED, ERROR, BUDGET_EXHAUSTED}
#: Group triggers and events that belong to the failover story (``--failovers``).
FAILOVER_TRIGGERS = ("member_lost", "promote", "promoted", "promotion_failed", "resume", "shrink")
FAILOVER_EVENTS = in_story("failover")
#: Fields every record may carry: not repeated in a detail made of the others.
_IDENTITY = {"ts", "t", "event", "machine", "member", "role", "rank", "pid", "node", "node_id", "from", "to",
             "trigger", "group_version", "weights_version", "seconds_in_state", "state", "run"}


def _short(value: Any, limit: int = 160) -> str:
    """A value from the trail as one bounded line of plain text."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(_short(v, 40) for v in value[:8]) + (f", ... ({len(value) - 8} more)" if len(value) > 8 else "")
    elif isinstance(value, dict):
        items = list(value.items())[:8]
        text = ", ".join(f"{_short(k, 30)}={_short(v, 40)}" for k, v in items)
        text += f", ... ({len(value) - 8} more)" if len(value) > 8 else ""
    else:
        text = str(value)
    return bounded(clean(text).replace("\n", " ").replace("\t", " "), limit)


def _secs(value: Any) -> str:
    return f"{value:.3f}s" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def failover_rows(records: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per ``failover`` record: t, lost, replacement, role, cause (the lost member's LOST reason),
    detection_s (LOST minus the last injected fault into it, or None), rerendezvous_s, transfer_s, total_s,
    group_version."""
    lost_at: dict[str, tuple[float, str]] = {}
    injected: dict[str, float] = {}
    rows = []
    for rec in as_records(records):
        event, member, t = rec.get("event"), rec.get("member"), rec.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            continue
        if event == "chaos" and isinstance(member, str):
            injected[member] = float(t)
        elif event == TRANSITION and rec.get("to") == "LOST" and isinstance(member, str):
            lost_at[member] = (float(t), _short(rec.get("reason") or rec.get("message") or rec.get("trigger") or ""))
        elif event == "failover" and isinstance(rec.get("lost"), str):
            lost = rec["lost"]
            when, cause = lost_at.get(lost, (None, ""))
            detection = when - injected[lost] if when is not None and lost in injected and injected[lost] <= when                 else None
            rows.append({"t": float(t), "lost": lost, "replacement": rec.get("replacement"), "role": rec.get("role"),
                         "cause": cause, "detection_s": detection,
                         **{k: rec.get(k) if isinstance(rec.get(k), (int, float)) else None
                            for k in ("rerendezvous_s", "transfer_s", "total_s")},
                         "group_version": rec.get("group_version")})
    return rows


def describe_failover(row: Mapping[str, Any]) -> str:
    """A failover row (:func:`failover_rows`) as one line."""
    det = _secs(row["detection_s"]) if row.get("detection_s") is not None else "n/a"
    cause = f"; cause: {row['cause']}" if row.get("cause") else ""
    return (f"{_short(row.get('lost'), 40)} -> {_short(row.get('replacement'), 40)}: detection {det}, "
            f"re-rendezvous {_secs(row.get('rerendezvous_s'))}, transfer {_secs(row.get('transfer_s'))}, "
            f"total {_secs(row.get('total_s'))}{cause}")




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
    return _short(value)[:12] if value else "?"


def _deadline(rec: Mapping[str, Any]) -> str:
    """A notice's deadline as UTC time (and how far from the record it was), or 'none given'."""
    deadline = rec.get("deadline")
    if not isinstance(deadline, (int, float)):
        return "no deadline given"
    import datetime as dt

    try:
        when = dt.datetime.fromtimestamp(deadline, dt.UTC)
    except (OverflowError, OSError, ValueError):  # a deadline no clock can show
        return f"deadline {_short(deadline)} (not a time)"
    stamp = rec.get("ts")
    left = ""
    if isinstance(stamp, str):
        try:
            left = f", {deadline - dt.datetime.fromisoformat(stamp.replace('Z', '+00:00')).timestamp():.0f}s ahead"
        except (ValueError, OverflowError):
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
        members = _short(rec.get("members") or []) or "no members"
        return f"node {_node(rec.get('node'))} ({rec.get('source')} {rec.get('kind')}): {members} DRAINING"
    if event in DRAIN_ENDS:
        moved = rec.get("moved") if isinstance(rec.get("moved"), dict) else {}
        what = ", ".join(f"{_short(a, 40)} -> {_short(b, 40)}" for a, b in moved.items()) if moved \
            else _short(rec.get("reason") or "")
        secs = rec.get("seconds")
        took = f" in {secs:.3f}s" if isinstance(secs, (int, float)) else ""
        return f"node {_node(rec.get('node'))}{took}: {what}"
    return None


def _detail(rec: Mapping[str, Any], failovers: Mapping[Any, Mapping[str, Any]] | None = None) -> str:
    """What the record holds, in one line; ``failovers``: the trail's failover rows by record key."""
    event = rec.get("event")
    maintenance = _maintenance_detail(rec)
    if maintenance is not None:
        return _short(maintenance, 400)
    if event == "failover":
        row = (failovers or {}).get(_failover_key(rec))
        if row is None:
            row = {"lost": rec.get("lost"), "replacement": rec.get("replacement"), "cause": "", "detection_s": None,
                   **{k: rec.get(k) for k in ("rerendezvous_s", "transfer_s", "total_s")}}
        return _short(describe_failover(row), 400)
    if event == "chaos":
        return _short(f"{rec.get('fault', '?')} injected into {rec.get('member', '?')} (pid {rec.get('pid', '?')})")
    if event == "reward":
        reward = rec.get("reward")
        return f"step {_short(rec.get('step'))}: reward {reward:.4f}" if isinstance(reward, (int, float)) \
            else f"step {_short(rec.get('step'))}: reward {_short(reward)}"
    if event in ("sync_retry", "call_retry", "sync_gave_up"):
        bits = [f"{k} {_short(rec[k], 40)}" for k in ("method", "attempt", "items", "transient_retries", "retries")
                if rec.get(k) is not None]
        if rec.get("membership_changed") is not None:
            bits.append("membership changed" if rec["membership_changed"] else "nobody lost")
        reason = f": {_short(rec['reason'], 240)}" if rec.get("reason") else ""
        return ", ".join(bits) + reason
    if event == "transfer_abandoned":
        return _short(f"{rec.get('reason', '')}; abandoned by {_short(rec.get('members') or [], 120)}", 400)
    if event == RUN_START:
        versions = rec.get("versions") if isinstance(rec.get("versions"), dict) else {}
        vers = " ".join(f"{_short(k, 20)} {_short(v, 20)}" for k, v in list(versions.items())[:6])
        return _short(f"run {rec.get('run', '?')}: {rec.get('trainer_workers', '?')} trainer(s), "
                      f"{rec.get('rollout_workers', '?')} rollout(s), config {rec.get('config_digest', '?')}; {vers}; "
                      f"nodes {_short(rec.get('nodes') or [], 120)}", 400)
    parts = []
    if event in (BUDGET_SPENT, BUDGET_EXHAUSTED) and rec.get("budget"):
        spent = rec.get("spent")
        limit = rec.get("limit")
        parts.append(
            f"{_short(rec['budget'], 40)} {_short(spent) if spent is not None else ''}/"
            f"{_short(limit) if limit is not None else ''}".strip()
            + (f", {_short(rec['in_window'])} in the window" if rec.get("in_window") is not None else "")
            + (f", slot {_short(rec['slot'], 40)}" if rec.get("slot") else "")
        )
    if rec.get("message"):
        parts.append(_short(rec["message"], 400))
    elif rec.get("error"):
        parts.append(_short(rec["error"], 400))
    if rec.get("reason") and not rec.get("message"):
        parts.append(_short(rec["reason"], 400))
    if not parts and event != TRANSITION:
        # An event without a reading of its own: its fields, so no row is blank.
        rest = [(k, v) for k, v in rec.items() if k not in _IDENTITY and v is not None and v != ""]
        parts.extend(f"{_short(k, 30)}={_short(v, 80)}" for k, v in rest[:10])
    return "; ".join(parts)


def select(
    records: Iterable[Any], *, members: Sequence[str] = (), events: Sequence[str] = (), since: float | None = None,
    until: float | None = None, failovers: bool = False,
) -> list[dict[str, Any]]:
    """The records that pass every filter given: ``members`` and ``events`` (names or shell patterns; a group
    record passes when it names the member), ``since``/``until`` (``t``, inclusive) and ``failovers`` (only
    the failover story)."""
    out = []
    for rec in as_records(records):
        if members:
            names = [rec.get("member"), rec.get("lost"), rec.get("replacement")]
            if not any(isinstance(n, str) and fnmatch.fnmatchcase(n, pat) for n in names for pat in members):
                continue
        if events:
            keys = [rec.get("event"), rec.get("trigger")]
            if not any(isinstance(k, str) and fnmatch.fnmatchcase(k, pat) for k in keys for pat in events):
                continue
        t = rec.get("t")
        if since is not None or until is not None:
            if not isinstance(t, (int, float)) or isinstance(t, bool):
                continue
            if (since is not None and t < since) or (until is not None and t > until):
                continue
        if failovers and not _in_failover_story(rec):
            continue
        out.append(rec)
    return out


def _in_failover_story(rec: Mapping[str, Any]) -> bool:
    event = rec.get("event")
    if event in FAILOVER_EVENTS:
        return True
    if event == TRANSITION:
        if rec.get("to") in ("LOST", "PROMOTING", "DEGRADED") or rec.get("from") in ("PROMOTING",):
            return True
        return rec.get("machine") == "group" and rec.get("trigger") in FAILOVER_TRIGGERS
    return False


def _cells(rec: Mapping[str, Any], rows: Mapping[Any, Mapping[str, Any]]) -> tuple[str, ...]:
    event = _short(rec.get("event", ""), 40)
    if rec.get("event") == TRANSITION:
        move = f"{_short(rec.get('from', '?'), 20)} → {_short(rec.get('to', '?'), 20)}"
    else:
        move = _short(rec.get("state", ""), 20)
    return (_num(rec.get("t")), _short(rec.get("member", ""), 40), event, move,
            _short(rec.get("trigger", "") or "", 40), _versions(rec), _num(rec.get("seconds_in_state")),
            _detail(rec, rows))


def _rows_by_record(records: list[dict[str, Any]], context: Iterable[Any] | None) -> dict[Any, Mapping[str, Any]]:
    """Failover rows keyed by (t, lost, replacement) over the whole run ``context``."""
    source = as_records(context) if context is not None else records
    return {(row["t"], _short(row["lost"]), _short(row["replacement"])): row for row in failover_rows(source)}


def _failover_key(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    t = rec.get("t")
    # Every part hashable and plain, whatever the record holds (a hostile ``lost`` may be a list).
    return (float(t) if isinstance(t, (int, float)) else None, _short(rec.get("lost")), _short(rec.get("replacement")))


def plain_lines(records: Iterable[Any], *, context: Iterable[Any] | None = None) -> Iterator[str]:
    """The timeline without a terminal: a header, then one tab-separated line per record, for ``grep``."""
    recs = as_records(records)
    rows = _rows_by_record(recs, context)
    yield "\t".join(("t", "member", "event", "from→to", "trigger", "g/w", "in_state", "detail"))
    for rec in recs:
        yield "\t".join(_cells(rec, rows))


def render_timeline(records: Iterable[Any], *, title: str | None = "audit timeline",
                    context: Iterable[Any] | None = None) -> Table:
    """A table with one row per record and its detail; ``context``: the whole run when ``records`` is a
    filtered part of it."""
    table = Table(title=title, show_lines=False, header_style="bold", expand=False)
    table.add_column("t (s)", justify="right", no_wrap=True)
    table.add_column("member", no_wrap=True)
    table.add_column("event", overflow="fold")
    table.add_column("from → to", overflow="fold")
    table.add_column("trigger", overflow="fold")
    table.add_column("g/w ver", justify="right", no_wrap=True)
    table.add_column("in state (s)", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold", ratio=1, min_width=20)
    recs = as_records(records)
    rows = _rows_by_record(recs, context)
    for rec in recs:
        event = str(rec.get("event", ""))
        style = EVENT_STYLES.get(event)
        if event == TRANSITION and rec.get("to") in _FAILED_STATES:
            style = "red"
        # Text, not str: a message with brackets must not be read as rich markup.
        table.add_row(*(Text(c) for c in _cells(rec, rows)), style=style)
    return table


def summarize(records: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per member, in order of appearance: machine, role, rank, pid, states visited, seconds per state,
    transitions, final state and error messages."""
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
            s["errors"].append(_short(rec.get("message") or rec.get("error") or event, 400))
    return out


def render_summary(records: Iterable[Any], *, title: str | None = "per member") -> Table:
    """A table with one row per member (see :func:`summarize`)."""
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
        final = _short(s["final"] or "", 30)
        final_text = Text(final, style="red" if final in _FAILED_STATES else "green" if final else "")
        errors = s["errors"][:5] + ([f"... {len(s['errors']) - 5} more"] if len(s["errors"]) > 5 else [])
        error_text = Text("; ".join(errors), style="red") if errors else Text("")
        table.add_row(
            Text(_short(member, 60)),
            Text(_short(s["role"] or s["machine"] or "", 30)),
            Text(_num(s["rank"])),
            Text(_num(s["pid"])),
            Text(_short(" → ".join(s["states"]), 400)),
            Text(_short(", ".join(f"{state} {secs:.3f}" for state, secs in s["seconds"].items()), 400)),
            Text(str(s["transitions"])),
            final_text,
            error_text,
        )
    return table


def maintenance_rows(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The trail's notices, withdrawals, source problems and drain outcomes, in order."""
    rows = []
    for rec in as_records(records):
        event = str(rec.get("event", ""))
        if event not in (*NOTICE_EVENTS, "maintenance_problem", *DRAIN_ENDS):
            continue
        if event == "maintenance_problem":
            detail = _short(rec.get("message") or rec.get("reason") or "", 400)
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
    """A table of :func:`maintenance_rows`; None when the trail has none."""
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


__all__ = ["EVENT_STYLES", "describe_failover", "failover_rows", "maintenance_rows", "plain_lines", "render_maintenance",
           "render_summary", "render_timeline", "select", "summarize"]
