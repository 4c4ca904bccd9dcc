"""``ftstate simulate``, from the CLI: a job's goodput under a failure mix, ftstate (replayed through the real
controller in virtual time) against restarting from the last checkpoint, and its picture (matplotlib, the
``plot`` extra, imported only here)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from ftstate.core.errors import ConfigError, ExtraUnavailable
from ftstate.core.text import bounded, listed
from ftstate.simulation import clock
from ftstate.simulation.costs import Costs
from ftstate.simulation.goodput import Result, StatusQuo, replay_ftstate, status_quo
from ftstate.simulation.mix import add_poisoned_nodes, draw_schedule, get_mix
from ftstate.simulation.scenario import Shape, config_for


@dataclasses.dataclass(frozen=True)
class SimulateOptions:
    """What ``ftstate simulate`` was asked (see its ``--help``). seeds: several seeds, each a
    run of its own (the report gives each and the spread); seed is used when it is empty."""

    members: int = 1000
    nodes: int | None = None
    days: float = 7.0
    mix: str = "llama3"
    seed: int = 1
    seeds: tuple[int, ...] = ()
    gpus_per_member: float = 1.0
    max_failovers: int | None = None
    poisoned_nodes: int = 0
    costs: Costs = dataclasses.field(default_factory=Costs)
    status_quo: StatusQuo = dataclasses.field(default_factory=StatusQuo)
    plot: str | None = None
    json_path: str | None = None
    audit: str | None = None


def parse_seeds(text: str) -> tuple[int, ...]:
    """``1-5`` or ``1,3,7`` (or both: ``1-3,9``) as seeds; ConfigError naming ``seeds`` otherwise."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if last < first or last - first >= 1000:
                raise ValueError(part)
            seeds += range(first, last + 1)
    except ValueError:
        raise ConfigError("seeds", f"{text!r}: expected seeds as 1-5 or 1,3,7") from None
    return tuple(seeds)


def simulate(opts: SimulateOptions) -> tuple[list[str], dict[str, Any]]:
    """Run the comparison (for each seed); returns the report's lines and its figures."""
    mix = get_mix(opts.mix)
    shape = Shape.of(opts.members, nodes=opts.nodes)
    seconds = opts.days * 86400.0
    overrides = {} if opts.max_failovers is None else {"fault_tolerance": {"max_failovers": opts.max_failovers}}
    ft = config_for(shape, overrides).fault_tolerance
    budget = (f"max_failovers {ft.max_failovers}; " if ft.max_failovers is not None else "") + (
        f"{ft.max_failovers_per_window} a {ft.failover_window_s:g} s window, {ft.max_slot_failovers} a slot, "
        f"quarantine at {ft.max_node_failures} a node")
    lines = [f"job: {shape.members} members ({shape.rollouts} rollouts, {shape.trainers} trainer rank(s), "
             f"{shape.spares} spare(s) per role) on {shape.nodes} nodes, {opts.days:g} days; mix {mix.name} "
             f"({mix.source}); failover budget: {budget}"]
    runs = []
    for seed in opts.seeds or (opts.seed,):
        schedule = draw_schedule(mix, gpus=shape.members * opts.gpus_per_member, seconds=seconds, seed=seed)
        schedule = add_poisoned_nodes(schedule, opts.poisoned_nodes, seconds=seconds, seed=seed)
        ours = clock.run(replay_ftstate(schedule, seconds, shape=shape, costs=opts.costs, overrides=overrides,
                                        seed=seed, audit_path=opts.audit))
        theirs = status_quo(schedule, seconds, opts.status_quo)
        lines += _seed_lines(seed, schedule, ours, theirs, opts)
        runs.append({"seed": seed, "failures": [dataclasses.asdict(f) for f in schedule],
                     "ftstate": _figures(ours), "status_quo": _figures(theirs), "_results": (ours, theirs)})
    if len(runs) > 1:
        for name in ("ftstate", "status_quo"):
            g = sorted(r[name]["goodput"] for r in runs)
            lines.append(f"{name.replace('_', ' ')} over {len(runs)} seeds: min {g[0]:.5f}, median "
                         f"{statistics.median(g):.5f}, max {g[-1]:.5f}")
        wins = sum(r["ftstate"]["goodput"] > r["status_quo"]["goodput"] for r in runs)
        lines.append(f"ftstate above the status quo in {wins} of {len(runs)} seeds")
    first_ours, first_theirs = runs[0].pop("_results")
    for r in runs[1:]:
        r.pop("_results")
    figures = {
        "shape": dataclasses.asdict(shape), "days": opts.days, "mix": mix.name, "seed": runs[0]["seed"],
        "failures": runs[0]["failures"], "ftstate": runs[0]["ftstate"], "status_quo": runs[0]["status_quo"],
        "seeds": runs, "costs": dataclasses.asdict(opts.costs), "status_quo_inputs": dataclasses.asdict(opts.status_quo),
    }
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(figures, indent=1))
        lines.append(f"figures: {opts.json_path}")
    if opts.plot:
        lines.append(f"picture (seed {runs[0]['seed']}): {plot_goodput(first_ours, first_theirs, seconds, opts.plot)}")
    return lines, figures


def _seed_lines(seed: int, schedule: list[Any], ours: Result, theirs: Result, opts: SimulateOptions) -> list[str]:
    effects = Counter(f.effect for f in schedule)
    lines = [
        f"seed {seed}: failures drawn: {len(schedule)} "
        f"({', '.join(f'{n} {e}' for e, n in sorted(effects.items())) or 'none'})",
        f"  ftstate goodput:    {ours.goodput:.5f}  ({sum(o.downtime_s for o in ours.outcomes):.1f} s lost"
        + (f"; the job ended at {ours.ended_at / 3600:.1f} h: {bounded(ours.error or '', 300)}"
           if ours.ended_at is not None else "") + ")",
        f"  status quo goodput: {theirs.goodput:.5f}  ({sum(o.downtime_s for o in theirs.outcomes):.1f} s lost; "
        f"restart from a checkpoint every {opts.status_quo.checkpoint_interval_s:g} s, "
        f"{opts.status_quo.restart_s:g} s a restart)",
    ]
    b = ours.budget
    if b is not None:
        poisoned = [o.target for o in ours.outcomes if o.effect == "poison"]
        caught = [n for n in poisoned if n in b["quarantined"]]
        lines.append(f"  failover budget: {b['spent']} spent, {b['in_window']} in the last window; quarantined: "
                     f"{listed(b['quarantined']) or 'none'}"
                     + (f" ({len(caught)} of {len(poisoned)} poisoned nodes quarantined, each once "
                        f"{b['per_node']} members died there)" if poisoned else ""))
    return lines


def _figures(r: Result) -> dict[str, Any]:
    return {"goodput": r.goodput, "ended_at": r.ended_at, "error": r.error, "budget": r.budget,
            "outcomes": [dataclasses.asdict(o) for o in r.outcomes]}


def plot_goodput(ours: Result, theirs: Result, seconds: float, out: str | os.PathLike[str]) -> Path:
    """Progress against time, ftstate and the status quo, a mark at each failure (PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ExtraUnavailable(feature="the goodput picture", package="matplotlib", extra="plot",
                               cause=str(exc)) from None

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


__all__ = ["SimulateOptions", "parse_seeds", "plot_goodput", "simulate"]
