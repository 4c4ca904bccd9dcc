"""The demo's live terminal view: every worker's state, the versions, the reward, progress.

Redrawn a few times a second by rich from the runtime's own machines (nothing is polled
from the workers for it). Off a terminal (CI, a pipe) it stays silent: the final report
says everything.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

_STYLE = {"READY": "green", "SYNCING": "cyan", "STANDBY": "dim", "STALE": "yellow", "SUSPECT": "yellow",
          "RESYNCING": "cyan", "RESYNCED": "cyan", "LOST": "red", "RETIRED": "dim red", "FAILED": "bold red",
          "PROMOTING": "magenta", "RENDEZVOUS": "blue", "INIT": "blue", "STOPPED": "dim"}


class LiveView:
    """rt: the runtime; steps: the run's length; enabled: draw at all (and only on a terminal)."""

    def __init__(self, rt: Any, steps: int, console: Any, *, enabled: bool = True) -> None:
        self.rt = rt
        self.console = console
        self.enabled = enabled and console.is_terminal
        self.reward: float | None = None
        self.note = ""
        self.progress = Progress(TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=console)
        self.task = self.progress.add_task("steps", total=steps)
        self._live: Live | None = None

    def update(self, *, step: int | None = None, reward: float | None = None, note: str | None = None) -> None:
        if step is not None:
            self.progress.update(self.task, completed=step)
        if reward is not None:
            self.reward = reward
        if note is not None:
            self.note = note

    def __rich__(self) -> Group:
        rt = self.rt
        header = Table.grid(padding=(0, 2))
        if rt.group is not None:
            reward = f"{self.reward:.3f}" if self.reward is not None else "-"
            header.add_row(f"group [bold]{rt.state}[/]", f"group version {rt.group_version}",
                           f"weights version {rt.weights_version}", f"reward {reward}",
                           f"failovers {len(rt.failovers)}", f"[magenta]{self.note}[/]")
        table = Table(show_edge=False, pad_edge=False)
        for col in ("worker", "role", "rank", "state", "weights v", "group v", "pid"):
            table.add_column(col)
        if rt.group is not None:
            for m in rt.members():
                style = _STYLE.get(m.state, "")
                table.add_row(m.member, m.role, str(m.rank), f"[{style}]{m.state}[/]", str(m.weights_version),
                              str(m.group_version), str(m.pid or ""))
        return Group(header, table, self.progress)

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
