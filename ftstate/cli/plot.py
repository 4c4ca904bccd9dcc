"""The timeline picture of an audit trail, drawn in the CLI's process: one lane per worker coloured by state,
the group's lane on top, failovers and drains as labelled bands, deadline expiries as red crosses, notices as
lines, and the demo's reward curve beneath on the same time axis.

Colours are fixed per state so two pictures read alike; a very short state (a 5 ms ``LOST``) is drawn at least
0.2 % of the axis wide. matplotlib (the ``plot`` extra) is imported only inside :func:`plot_timeline`, on an
Agg canvas, so ``import ftstate`` stays light."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftstate.core.audit import DEADLINE_EXPIRED, TRANSITION, as_records
from ftstate.core.errors import ExtraUnavailable

#: How to get the picture on an install without matplotlib (the ``plot`` extra).
INSTALL_HINT = "pip install 'ftstate[plot]'"

#: The event name of the demo's per-step reward records.
REWARD = "reward"

#: A fixed colour per state (worker and group machines).
STATE_COLORS: dict[str, str] = {
    "INIT": "#c9d3e0",
    "RENDEZVOUS": "#6f9fd8",
    "STANDBY": "#9e9e9e",
    "PROMOTING": "#9c6ade",
    "STALE": "#f2b134",
    "SUSPECT": "#e8891c",
    "RESYNCING": "#5cc1c9",
    "RESYNCED": "#1f8f99",
    "READY": "#3aa655",
    "SYNCING": "#9bd88a",
    "DRAINING": "#8a9a1b",
    "DEGRADED": "#f7d27a",
    "LOST": "#d62728",
    "FAILED": "#8b0000",
    "RETIRED": "#dcdcdc",
    "STOPPED": "#5f5f5f",
}
_SERVING_FALLBACK = "#7cc47f"
_OTHER_FALLBACK = "#b39ddb"
_FAILOVER_BAND = "#9c6ade"
_DRAIN = "#e8730c"
#: The events that end a drain, and what each says about it.
DRAIN_ENDS = {"drain_drained": "drained", "drain_failed": "failed", "drain_cancelled": "cancelled"}
NOTICE = "maintenance_notice"
_DEADLINE = "#c00000"
_LABEL_BOX = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85}

#: Picture geometry: a fixed width; the height grows with the lanes (and the reward panel).
WIDTH_IN = 12.0
DPI = 100
_LANE_IN = 0.42
_BASE_IN = 1.6
_REWARD_IN = 2.2
_MIN_WIDTH_FRACTION = 0.002
#: The least width of a LOST or FAILED segment, as a fraction of the time span.
LOST_MIN_WIDTH_FRACTION = 0.008
_LOSS_STATES = ("LOST", "FAILED")
#: Rows of failover labels above the lanes (they take turns, so neighbours never overlap).
_LABEL_ROWS = 3


@dataclasses.dataclass
class _Lane:
    member: str
    label: str
    rank: float
    first_t: float
    segments: list[tuple[float, float, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Failover:
    number: int
    start: float
    end: float
    reason: str
    finished: bool


@dataclasses.dataclass
class _Drain:
    number: int
    start: float
    end: float
    node: str
    outcome: str | None  # None: the trail ends before the drain did
    moved: dict[str, str]
    reason: str


@dataclasses.dataclass
class _Notice:
    t: float
    label: str
    node: str


def _drains(records: list[Mapping[str, Any]], end: float) -> list[_Drain]:
    """Every drain, from its ``drain_started`` to the record that ended it (by node)."""
    out: list[_Drain] = []
    running: dict[str, _Drain] = {}
    for rec in records:
        event = rec.get("event")
        t = _num(rec.get("t"))
        if t is None:
            continue
        node = str(rec.get("node") or "?")
        if event == "drain_started":
            running[node] = _Drain(len(out) + 1, t, end, node, None, {}, str(rec.get("reason") or ""))
            out.append(running[node])
        elif event in DRAIN_ENDS:
            drain = running.pop(node, None)
            if drain is None:  # an end without a start (a trail cut at its head): a moment's band
                drain = _Drain(len(out) + 1, t, t, node, None, {}, "")
                out.append(drain)
            drain.end, drain.outcome = t, DRAIN_ENDS[str(event)]
            moved = rec.get("moved")
            drain.moved = dict(moved) if isinstance(moved, Mapping) else {}
            drain.reason = str(rec.get("reason") or drain.reason)
    return out


def _notices(records: list[Mapping[str, Any]]) -> list[_Notice]:
    out = []
    for rec in records:
        t = _num(rec.get("t"))
        if rec.get("event") != NOTICE or t is None:
            continue
        node = str(rec.get("node_id") or rec.get("node") or "?")
        out.append(_Notice(t, f"{rec.get('source', '?')} {rec.get('kind', '?')}", node))
    return out


def figure_size(lanes: int, reward: bool) -> tuple[int, int]:
    """The picture's size in pixels for ``lanes`` worker lanes, with or without the reward panel."""
    height = _BASE_IN + _LANE_IN * (lanes + 1) + (_REWARD_IN if reward else 0.0)
    return round(WIDTH_IN * DPI), round(height * DPI)




def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _spec_flags() -> tuple[set[str], list[str]]:
    """(serving states, every state in spec order) of the loaded machines; empty when they cannot load."""
    from ftstate.core.errors import SpecError
    from ftstate.core.spec import load_machines

    try:
        specs = load_machines()
    except SpecError:
        return set(), []
    serving: set[str] = set()
    order: list[str] = []
    for name in ("worker", "group", *sorted(specs)):
        spec = specs.get(name)
        if spec is None:
            continue
        serving |= set(spec.serving_states)
        order += [s for s in spec.states if s not in order]
    return serving, order


def _color(state: str, serving: set[str]) -> str:
    if state in STATE_COLORS:
        return STATE_COLORS[state]
    return _SERVING_FALLBACK if state in serving else _OTHER_FALLBACK


def _lanes(records: list[Mapping[str, Any]], machine: str, end: float) -> list[_Lane]:
    lanes: dict[str, _Lane] = {}
    for rec in records:
        if rec.get("event") != TRANSITION or rec.get("machine") != machine or not rec.get("member"):
            continue
        t = _num(rec.get("t"))
        if t is None:
            continue
        member = str(rec["member"])
        lane = lanes.get(member)
        if lane is None:
            rank = _num(rec.get("rank"))
            role = rec.get("role")
            label = member if not role or str(role) in member else f"{member} ({role})"
            lane = lanes[member] = _Lane(member, label, rank if rank is not None else float("inf"), t)
        if lane.segments:
            start, _, state = lane.segments[-1]
            lane.segments[-1] = (start, t, state)
        lane.segments.append((t, end, str(rec.get("to", "?"))))
    # Trainer first, then by rank, then by first appearance.
    return sorted(lanes.values(), key=lambda ln: (ln.rank, ln.first_t))


def _failovers(records: list[Mapping[str, Any]], end: float) -> list[_Failover]:
    out: list[_Failover] = []
    current: _Failover | None = None
    for rec in records:
        if rec.get("event") != TRANSITION or rec.get("machine") != "group":
            continue
        t = _num(rec.get("t"))
        if t is None:
            continue
        to = rec.get("to")
        if current is None and to == "PROMOTING":
            current = _Failover(
                len(out) + 1, t, end, str(rec.get("reason") or rec.get("trigger") or ""), False
            )
        elif current is not None and to in ("READY", "FAILED", "STOPPED"):
            current.end, current.finished = t, to == "READY"
            out.append(current)
            current = None
    if current is not None:
        out.append(current)
    # The runtime's `failover` records: who replaced whom and LOST-to-serving time, as the report prints it.
    from ftstate.cli.audit_view import failover_rows

    for fo, row in zip(out, failover_rows(records), strict=False):
        fo.reason = f"{row['lost']} -> {row['replacement']}"
        if isinstance(row.get("total_s"), (int, float)) and fo.finished:
            fo.start, fo.end = row["t"] - row["total_s"], row["t"]
    for fo in out:
        if len(fo.reason) > 48:
            fo.reason = fo.reason[:45] + "..."
    return out


def _seconds(x: float) -> str:
    if x >= 10:
        return f"{x:.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1000:.3g} ms"


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _rewards(records: list[Mapping[str, Any]]) -> list[tuple[float, float, Any]]:
    """``(t, reward, step)`` of every reward record, in time order."""
    out = []
    for rec in records:
        if rec.get("event") != REWARD:
            continue
        t, r = _num(rec.get("t")), _num(rec.get("reward"))
        if t is not None and r is not None:
            out.append((t, r, rec.get("step")))
    return sorted(out, key=lambda x: x[0])


def _no_matplotlib(exc: ImportError) -> ExtraUnavailable:
    return ExtraUnavailable(feature="the timeline picture", package="matplotlib", extra="plot", cause=str(exc))


def require_matplotlib() -> None:
    """Raise :class:`~ftstate.core.errors.FTError` naming the ``plot`` extra unless matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise _no_matplotlib(exc) from None


def plot_timeline(records: Any, out_path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Draw the timeline of ``records`` (a trail path, an ``AuditTrail``, records or ``(line, record)`` pairs)
    to the PNG ``out_path``; returns its path. Raises ValueError with no worker transitions to draw, and
    :class:`~ftstate.core.errors.FTError` (ending in :data:`INSTALL_HINT`) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise _no_matplotlib(exc) from None

    recs = as_records(records)
    times = [t for t in (_num(r.get("t")) for r in recs) if t is not None]
    if not times:
        raise ValueError(f"audit trail has no timed records (got {len(recs)} records): nothing to draw")
    t0, last = min(times), max(times)
    span = max(last - t0, 1e-6)
    end = last + span * 0.01
    workers = _lanes(recs, "worker", end)
    if not workers:
        raise ValueError(
            f"audit trail has no worker lanes: none of its {len(recs)} records is a transition "
            "with machine='worker', so there is nothing to draw"
        )
    group = _lanes(recs, "group", end)
    failovers = _failovers(recs, end)
    drains = _drains(recs, end)
    notices = _notices(recs)
    rewards = _rewards(recs)
    serving, order = _spec_flags()

    width_px, height_px = figure_size(len(workers), bool(rewards))
    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    heights = [_LANE_IN * (len(workers) + 1)] + ([_REWARD_IN - 0.5] if rewards else [])
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights, hspace=0.18)
    # Room under the title for the failover labels' rows (10 pt each, above the lanes).
    top = 1 - (0.55 + _LABEL_ROWS * 10 / 72) / (height_px / DPI)
    bottom = 0.5 / (height_px / DPI)
    fig.subplots_adjust(left=0.14, right=0.83, top=top, bottom=bottom)
    ax = fig.add_subplot(grid[0])

    min_width = span * _MIN_WIDTH_FRACTION
    lanes = [*group, *workers]
    seen_states: set[str] = set()
    ylabels = []
    for i, lane in enumerate(lanes):
        y = len(lanes) - 1 - i
        is_group = lane in group
        height = 0.4 if is_group else 0.7
        # A loss lasts milliseconds: drawn at least LOST_MIN_WIDTH_FRACTION wide, so it shows.
        bars = [(start, max(stop - start, span * LOST_MIN_WIDTH_FRACTION if state in _LOSS_STATES else min_width))
                for start, stop, state in lane.segments]
        colors = [_color(state, serving) for _, _, state in lane.segments]
        ax.broken_barh(bars, (y - height / 2, height), facecolors=colors, edgecolor="white", linewidth=0.4)
        losses = [(bar, c) for bar, c, (_, _, state) in zip(bars, colors, lane.segments, strict=True)
                  if state in _LOSS_STATES]
        if losses:  # on top: the segment after a loss (RETIRED) starts milliseconds later and would hide it
            ax.broken_barh([b for b, _ in losses], (y - height / 2, height), facecolors=[c for _, c in losses],
                           edgecolor="black", linewidth=0.4, zorder=3)
        seen_states.update(state for _, _, state in lane.segments)
        ylabels.append((y, "group" if is_group else lane.label))
    ax.set_yticks([y for y, _ in ylabels], [label for _, label in ylabels])
    if group:
        ax.axhline(len(workers) - 0.5, color="#888888", linewidth=0.6)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(t0 - span * 0.01, end)
    ax.grid(axis="x", color="#e5e5e5", linewidth=0.6)
    ax.set_axisbelow(True)

    reward_ax = None
    if rewards:
        reward_ax = fig.add_subplot(grid[1], sharex=ax)
        reward_ax.plot(
            [t for t, _, _ in rewards], [r for _, r, _ in rewards], "-o", color="#1f4e99", markersize=3
        )
        reward_ax.set_ylabel("mean reward")
        reward_ax.set_xlabel("time (s since the trail opened)")
        reward_ax.grid(color="#e5e5e5", linewidth=0.6)
        lo, hi = min(r for _, r, _ in rewards), max(r for _, r, _ in rewards)
        pad = max((hi - lo) * 0.15, 0.02)
        reward_ax.set_ylim(min(0.0, lo - pad), hi + pad)
        last_t, last_r, last_step = rewards[-1]
        if last_step is not None:
            reward_ax.annotate(
                f"step {last_step}: {last_r:.2f}",
                (last_t, last_r),
                textcoords="offset points",
                xytext=(-4, 6),
                ha="right",
                fontsize=8,
                color="#1f4e99",
            )
        ax.tick_params(labelbottom=False)
    else:
        ax.set_xlabel("time (s since the trail opened)")

    def place(t: float, gap: float) -> tuple[float, str]:
        """A label's x offset and alignment: right of ``t``, or left of it near the legend."""
        return (gap, "left") if t < t0 + span * 0.75 else (-gap, "right")

    axis_px = width_px * 0.69  # subplots_adjust(left=0.14, right=0.83)

    def place_text(t: float, gap: float, text: str, fontsize: float = 8) -> tuple[float, str]:
        """Like ``place``, from the label's own width."""
        x_px = (t - (t0 - span * 0.01)) / (end - (t0 - span * 0.01)) * axis_px
        fits = x_px + gap + len(text) * fontsize * DPI / 72 * 0.6 < axis_px
        return (gap, "left") if fits else (-gap, "right")

    for fo in failovers:
        for a in (ax, reward_ax):
            if a is not None:
                a.axvspan(fo.start, fo.end, color=_FAILOVER_BAND, alpha=0.15, linewidth=0)
        took = _seconds(fo.end - fo.start) if fo.finished else "unfinished"
        label = (
            f"failover {fo.number}: {fo.reason} ({took})" if fo.reason else f"failover {fo.number} ({took})"
        )
        dx, ha = place(fo.start, 2)
        ax.annotate(
            label,
            (fo.start, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(dx, 3 + 10 * ((fo.number - 1) % _LABEL_ROWS)),  # rows in turn: neighbours never overlap
            textcoords="offset points",
            fontsize=8,
            color="#5b2a9e",
            va="bottom",
            ha=ha,
        )

    # Notices: one line each; the notices of one poll (same node, same instant) share a label.
    labelled: dict[tuple[str, float], list[str]] = {}
    for n in notices:
        for a in (ax, reward_ax):
            if a is not None:
                a.axvline(n.t, color=_DRAIN, linestyle="-.", linewidth=1.1, zorder=4)
        ax.plot([n.t], [1.0], marker="v", color=_DRAIN, markersize=8, transform=ax.get_xaxis_transform(),
                clip_on=False, zorder=6)
        key = next((k for k in labelled if k[0] == n.node and abs(k[1] - n.t) < span * 0.01), (n.node, n.t))
        labelled.setdefault(key, []).append(n.label)
    # The demo names its nodes (``maintenance_announced``: name, node_id); else an id's first characters.
    node_names = {str(r["node_id"]): str(r["name"]) for r in recs
                  if r.get("event") == "maintenance_announced" and r.get("node_id") and r.get("name")}
    for i, ((node, t), kinds) in enumerate(labelled.items()):
        text = f"notice: {' + '.join(kinds)}, node {node_names.get(node, node[:8])}"
        dx, ha = place_text(t, 6, text)
        ax.annotate(text, (t, 1.0), xycoords=("data", "axes fraction"), xytext=(dx, -12 - 10 * (i % 2)),
                    textcoords="offset points", fontsize=8, color=_DRAIN, va="top", ha=ha, bbox=_LABEL_BOX,
                    zorder=7)
    for d in drains:
        for a in (ax, reward_ax):
            if a is not None:
                a.axvspan(d.start, max(d.end, d.start + min_width), color=_DRAIN, alpha=0.14, linewidth=0,
                          hatch=None if d.outcome == "drained" else "//")
        took = _seconds(d.end - d.start) if d.outcome is not None else "unfinished"
        what = ", ".join(f"{a} -> {b}" for a, b in d.moved.items())
        if d.outcome != "drained":
            what = d.reason if len(d.reason) <= 48 else d.reason[:45] + "..."
        label = f"drain {d.number} {d.outcome or 'running'}: {what} ({took})" if what else (
            f"drain {d.number} {d.outcome or 'running'} ({took})")
        dx, ha = place_text(d.start, 2, label)
        ax.annotate(label, (d.start, 0.0), xycoords=("data", "axes fraction"),
                    xytext=(dx, -3 - 10 * ((d.number - 1) % 2)), textcoords="offset points", fontsize=8,
                    color="#a04a00", va="top", ha=ha, bbox=_LABEL_BOX, zorder=7)

    lane_y = {lane.member: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    expiries = group_expiries = 0

    def expiry_label(text: str, t: float, y: float, offset: int) -> None:
        dx, ha = place(t, offset)
        ax.annotate(text, (t, y), xytext=(dx, 4), textcoords="offset points", ha=ha, fontsize=7,
                    color=_DEADLINE, bbox=_LABEL_BOX, zorder=6)
    for rec in recs:
        if rec.get("event") != DEADLINE_EXPIRED:
            continue
        t = _num(rec.get("t"))
        if t is None:
            continue
        expiries += 1
        what = str(rec.get("key") or rec.get("error") or "deadline")
        member = rec.get("member")
        if rec.get("machine") == "worker" and member in lane_y:
            ax.plot(
                [t],
                [lane_y[member]],
                marker="X",
                color=_DEADLINE,
                markersize=9,
                markeredgecolor="white",
                zorder=5,
            )
            expiry_label(what, t, lane_y[member], 7)
        else:
            for a in (ax, reward_ax):
                if a is not None:
                    a.axvline(t, color=_DEADLINE, linestyle="--", linewidth=1)
            group_expiries += 1
            expiry_label(f"{member or 'group'}: {what}", t, lane_y.get(str(member), len(lanes) - 1), 4)

    # Legend in the fixed colour order (the way a worker lives), then states only a spec knows.
    known = [s for s in STATE_COLORS if s in seen_states]
    ordered = known + [s for s in order if s in seen_states and s not in known]
    ordered += sorted(s for s in seen_states if s not in ordered)
    handles: list[Any] = [
        Patch(facecolor=_color(s, serving), edgecolor="#777777", linewidth=0.4, label=s) for s in ordered
    ]
    if failovers:
        handles.append(Patch(facecolor=_FAILOVER_BAND, alpha=0.25, label="failover"))
    if notices:
        handles.append(Line2D([], [], color=_DRAIN, linestyle="-.", marker="v", label="maintenance notice"))
    if drains:
        handles.append(Patch(facecolor=_DRAIN, alpha=0.3, label="drain"))
    if expiries > group_expiries:
        handles.append(
            Line2D([], [], marker="X", color=_DEADLINE, linestyle="none", label="deadline expired")
        )
    if group_expiries:
        handles.append(Line2D([], [], color=_DEADLINE, linestyle="--", label="group deadline expired"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
        title="state",
        title_fontsize=8,
        borderaxespad=0.0,
    )

    if title is None:
        name = Path(records).name if isinstance(records, (str, os.PathLike)) else "audit trail"
        title = ", ".join(
            [f"{name}: {_plural(len(workers), 'worker')}", _plural(len(failovers), "failover")]
            + ([_plural(len(drains), "drain")] if drains else [])
            + ([_plural(expiries, "deadline expiry", "deadline expiries")] if expiries else [])
            + [_seconds(last - t0)]
        )
    fig.suptitle(title, fontsize=11, y=1 - 0.12 / (height_px / DPI), va="top")

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=DPI)
    return out


__all__ = ["DPI", "REWARD", "STATE_COLORS", "WIDTH_IN", "figure_size", "plot_timeline"]
