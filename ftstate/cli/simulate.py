"""``ftstate simulate``: a job's goodput under a published failure mix, ftstate against the
status quo (restart from the last checkpoint), and its picture.

The failures are drawn from the mix (:mod:`ftstate.simulation.mix`), replayed through the real
controller on a simulated cluster in virtual time (:func:`ftstate.simulation.goodput.replay_ftstate`)
and costed for the status quo (:func:`ftstate.simulation.goodput.status_quo`). The picture
(matplotlib, the ``plot`` extra, imported only here) is progress against time for both, a
mark at each failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from ftstate.core.errors import FTError
from ftstate.simulation import clock
from ftstate.simulation.costs import Costs
from ftstate.simulation.goodput import Result, StatusQuo, replay_ftstate, status_quo
from ftstate.simulation.mix import draw_schedule, get_mix
from ftstate.simulation.scenario import Shape


@dataclasses.dataclass(frozen=True)
class SimulateOptions:
    """What ``ftstate simulate`` was asked (see its ``--help``)."""

    members: int = 1000
    nodes: int | None = None
    days: float = 7.0
    mix: str = "llama3"
    seed: int = 1
    gpus_per_member: float = 1.0
    max_failovers: int | None = None
    costs: Costs = dataclasses.field(default_factory=Costs)
    status_quo: StatusQuo = dataclasses.field(default_factory=StatusQuo)
    plot: str | None = None
    json_path: str | None = None
    audit: str | None = None


def simulate(opts: SimulateOptions) -> tuple[list[str], dict[str, Any]]:
    """Run the comparison; returns the report's lines and its figures."""
    mix = get_mix(opts.mix)
    shape = Shape.of(opts.members, nodes=opts.nodes)
    seconds = opts.days * 86400.0
    schedule = draw_schedule(mix, gpus=shape.members * opts.gpus_per_member, seconds=seconds, seed=opts.seed)
    overrides = {} if opts.max_failovers is None else {"fault_tolerance": {"max_failovers": opts.max_failovers}}
    ours = clock.run(replay_ftstate(schedule, seconds, shape=shape, costs=opts.costs, overrides=overrides,
                                    seed=opts.seed, audit_path=opts.audit))
    theirs = status_quo(schedule, seconds, opts.status_quo)
    effects = Counter(f.effect for f in schedule)
    from ftstate.simulation.scenario import config_for

    budget = config_for(shape, overrides).fault_tolerance.max_failovers
    lines = [
        f"job: {shape.members} members ({shape.rollouts} rollouts, {shape.trainers} trainer rank(s), {shape.spares} spare(s) per role) on "
        f"{shape.nodes} nodes, {opts.days:g} days; mix {mix.name} ({mix.source})",
        f"failures drawn (seed {opts.seed}): {len(schedule)} "
        f"({', '.join(f'{n} {e}' for e, n in sorted(effects.items())) or 'none'})",
        f"ftstate goodput:    {ours.goodput:.5f}  ({sum(o.downtime_s for o in ours.outcomes):.1f} s lost"
        + (f"; the job ended at {ours.ended_at / 3600:.1f} h: {ours.error}" if ours.ended_at is not None else "")
        + f"; max_failovers {budget})",
        f"status quo goodput: {theirs.goodput:.5f}  ({sum(o.downtime_s for o in theirs.outcomes):.1f} s lost; restart "
        f"from a checkpoint every {opts.status_quo.checkpoint_interval_s:g} s, {opts.status_quo.restart_s:g} s a restart)",
    ]
    figures = {
        "shape": dataclasses.asdict(shape), "days": opts.days, "mix": mix.name, "seed": opts.seed,
        "failures": [dataclasses.asdict(f) for f in schedule],
        "ftstate": _figures(ours), "status_quo": _figures(theirs),
        "costs": dataclasses.asdict(opts.costs), "status_quo_inputs": dataclasses.asdict(opts.status_quo),
    }
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(figures, indent=1))
        lines.append(f"figures: {opts.json_path}")
    if opts.plot:
        lines.append(f"picture: {plot_goodput(ours, theirs, seconds, opts.plot)}")
    return lines, figures


def _figures(r: Result) -> dict[str, Any]:
    return {"goodput": r.goodput, "ended_at": r.ended_at, "error": r.error,
            "outcomes": [dataclasses.asdict(o) for o in r.outcomes]}


def plot_goodput(ours: Result, theirs: Result, seconds: float, out: str | os.PathLike[str]) -> Path:
    """Progress against time, ftstate and the status quo, a mark at each failure (PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise FTError(f"the goodput picture needs matplotlib ({exc}): pip install 'ftstate[plot]'") from None

    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    hours = 3600.0
    for result, label, color in ((ours, "ftstate", "tab:green"), (theirs, "restart from checkpoint", "tab:red")):
        xs, ys = zip(*result.progress_curve(seconds), strict=True)
        ax.plot([x / hours for x in xs], [(x - y) / 60 for x, y in zip(xs, ys, strict=True)], color=color,
                label=f"{label}: goodput {result.goodput:.4f}", drawstyle="steps-post")
    for o in theirs.outcomes:
        ax.axvline(o.at / hours, color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("job time (hours)")
    ax.set_ylabel("time lost to failures (minutes)")
    ax.set_title("time lost to failures: ftstate vs restart from the last checkpoint")
    ax.legend(loc="upper left")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


__all__ = ["SimulateOptions", "plot_goodput", "simulate"]
