"""The demo's live terminal view, in the driver: every worker's state, the versions, reward, progress and
maintenance, redrawn by rich from the runtime's machines and records (nothing polled from workers). Off a
terminal it prints plain lines instead: each phase, step and failover."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

_STYLE = {"READY": "green", "SYNCING": "cyan", "STANDBY": "dim", "STALE": "yellow", "SUSPECT": "yellow",
          "RESYNCING": "cyan", "RESYNCED": "cyan", "LOST": "red", "RETIRED": "dim red", "FAILED": "bold red",
          "PROMOTING": "magenta", "RENDEZVOUS": "blue", "INIT": "blue", "STOPPED": "dim",
          "DRAINING": "bold dark_orange"}

#: The audit events the maintenance panel shows, and how many lines of them it keeps.
MAINTENANCE_EVENTS = ("maintenance_announced", "maintenance_notice", "maintenance_withdrawn", "maintenance_problem",
                      "drain_started", "drain_drained", "drain_failed", "drain_cancelled")
_PANEL_LINES = 6


def short_node(node_id: Any, names: Mapping[str, str] | None = None) -> str:
    """A node as a person reads it: its name in the local cluster, else the id's first 8 characters."""
    if not node_id:
        return "?"
    if names and node_id in names:
        return str(names[node_id])
    return str(node_id)[:8]


def _seen_at(rec: Mapping[str, Any], now: float | None) -> float:
    """Epoch seconds the record was written (its ``ts``), else ``now``, else the present."""
    stamp = rec.get("ts")
    if isinstance(stamp, str):
        with contextlib.suppress(ValueError):
            return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return now if now is not None else time.time()


def describe_event(rec: Mapping[str, Any], names: Mapping[str, str] | None = None, now: float | None = None) -> str:
    """One line (rich markup) for a maintenance or drain record of the audit trail."""
    event = rec.get("event")
    node = short_node(rec.get("node_id") or rec.get("node"), names)
    if event == "maintenance_announced":
        return (f"[dark_orange]announced[/] {escape(str(rec.get('source')))} {escape(str(rec.get('kind')))} "
                f"on node {escape(str(rec.get('name') or node))} (step {rec.get('step')})")
    if event == "maintenance_notice":
        deadline = rec.get("deadline")
        left = ""
        if isinstance(deadline, (int, float)):
            left = f", deadline {deadline - _seen_at(rec, now):.0f} s ahead"
        return (f"[bold dark_orange]notice[/] {escape(str(rec.get('source')))} {escape(str(rec.get('kind')))} "
                f"node {escape(node)}{left}: {escape(str(rec.get('action', '')))}")
    if event == "maintenance_withdrawn":
        return f"[yellow]withdrawn[/] {escape(str(rec.get('source')))} {escape(str(rec.get('kind')))} node {escape(node)}"
    if event == "maintenance_problem":
        return f"[yellow]warning[/] {escape(str(rec.get('message') or rec.get('reason') or ''))[:100]}"
    if event == "drain_started":
        who = ", ".join(rec.get("members") or []) or "no members"
        return f"[dark_orange]drain[/] node {escape(node)}: {escape(who)} DRAINING, serving on"
    outcome = str(event).removeprefix("drain_")
    moved = rec.get("moved") or {}
    what = ", ".join(f"{a} -> {b}" for a, b in moved.items()) or escape(str(rec.get("reason", "")))[:80]
    style = {"drained": "green", "failed": "red", "cancelled": "yellow"}.get(outcome, "")
    secs = rec.get("seconds")
    took = f" in {secs:.2f} s" if isinstance(secs, (int, float)) else ""
    return f"[{style}]{outcome}[/] node {escape(node)}{took}: {what}"


class LiveView:
    """rt: the runtime; steps: the run's length; enabled: draw at all (and only on a terminal);
    node_names: node id -> a short name (the local cluster's), which adds a node column."""

    def __init__(self, rt: Any, steps: int, console: Any, *, enabled: bool = True,
                 node_names: Mapping[str, str] | None = None) -> None:
        self.rt = rt
        self.console = console
        self.enabled = enabled and console.is_terminal
        self.node_names = node_names
        self.reward: float | None = None
        self.note = ""
        self.progress = Progress(TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=console)
        self.task = self.progress.add_task("steps", total=steps)
        self._live: Live | None = None
        self._seen = 0
        self._events: list[str] = []
        self._pending: set[str] = set()  # nodes a notice asked to drain, until the drain ends
        #: Off a terminal: plain lines (start-up, each step, each failover) instead of the live view.
        self.plain = not console.is_terminal
        self.steps = steps
        self._startup = ""
        self._failovers_told = 0
        progress = getattr(rt, "progress", None)
        if progress is not None:
            progress.listen(self._on_progress)

    def _on_progress(self, event: Any) -> None:
        if event.phase in ("sync", "failover"):
            return  # the view shows each step and failover its own way (``update``)
        self._startup = event.message
        if self.plain:
            self._say(("warning: " if event.level == "warning" else "") + event.message)

    def _say(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _tell_failovers(self) -> None:
        failovers = list(getattr(self.rt, "failovers", []) or [])
        for i, f in enumerate(failovers[self._failovers_told:], self._failovers_told + 1):
            self._say(f"failover {i}: {f.lost} -> {f.replacement}: re-rendezvous {f.rerendezvous_s:.3f}s, "
                      f"transfer {f.transfer_s:.3f}s, total {f.total_s:.3f}s (cause: {f.reason})")
        self._failovers_told = len(failovers)

    def update(self, *, step: int | None = None, reward: float | None = None, note: str | None = None) -> None:
        if step is not None:
            self.progress.update(self.task, completed=step)
        if reward is not None:
            self.reward = reward
        if note is not None:
            self.note = note
        if self.plain:
            self._tell_failovers()
            if step is not None and reward is not None:
                rt = self.rt
                version = f", weights version {rt.weights_version}" if rt.group is not None else ""
                self._say(f"step {step}/{self.steps}: reward {reward:.3f}{version}")
            elif note:
                self._say(f"step {(step or 0) + 1}/{self.steps}: {note}")

    def maintenance_lines(self) -> list[str]:
        """The latest maintenance and drain events, one line each (read from the audit
        records written since the last call)."""
        audit = getattr(self.rt, "audit", None)
        records = getattr(audit, "records", None) or []
        for rec in records[self._seen:]:
            event = rec.get("event")
            if event not in MAINTENANCE_EVENTS:
                continue
            node = str(rec.get("node_id") or rec.get("node"))
            if event == "maintenance_notice" and rec.get("action") == "drain":
                if node in self._pending:  # a second notice for a node already being drained
                    rec = {**rec, "action": "covered by the drain under way"}
                self._pending.add(node)
            elif event in ("drain_drained", "drain_failed", "drain_cancelled"):
                self._pending.discard(node)
            self._events.append(describe_event(rec, self.node_names))
        self._seen = len(records)
        del self._events[:-_PANEL_LINES]
        return list(self._events)

    def __rich__(self) -> Group:
        rt = self.rt
        header = Table.grid(padding=(0, 2))
        if rt.group is None or rt.state in ("INIT", "RENDEZVOUS"):
            header.add_row(f"[bold]{escape(self._startup or 'starting')}[/]")
        elif rt.group is not None:
            reward = f"{self.reward:.3f}" if self.reward is not None else "-"
            header.add_row(f"group [bold]{rt.state}[/]", f"group version {rt.group_version}",
                           f"weights version {rt.weights_version}", f"reward {reward}",
                           f"failovers {len(rt.failovers)}", f"drains {len(rt.drains)}",
                           f"[magenta]{escape(self.note)}[/]")
        table = Table(show_edge=False, pad_edge=False)
        columns = ["worker", "role", "rank", "state", "weights v", "group v", "pid"]
        if self.node_names is not None:
            columns.append("node")
        for col in columns:
            table.add_column(col)
        if rt.group is not None:
            for m in rt.members():
                style = _STYLE.get(m.state, "")
                row = [m.member, m.role, str(m.rank), f"[{style}]{m.state}[/]", str(m.weights_version),
                       str(m.group_version), str(m.pid or "")]
                if self.node_names is not None:
                    row.append(short_node(getattr(m, "node_id", None), self.node_names))
                table.add_row(*row)
        parts: list[Any] = [header, table]
        lines = self.maintenance_lines()
        if lines:
            panel = Table.grid()
            panel.add_column()
            panel.add_row("[bold]maintenance[/]")
            for line in lines:
                panel.add_row(line)
            parts.append(panel)
        parts.append(self.progress)
        return Group(*parts)

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.plain:
            self._tell_failovers()
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
