"""The demo's report: ``report.json``, the machines' diagrams, the timeline picture and the
verdict printed at the end (did the run survive, and is it bit-identical to the fault-free
reference?).

:func:`write_report` is called once a run ends, by the dict-of-tensors job
(:mod:`ftstate.cli.demo.run`) and the engine job (:mod:`ftstate.cli.demo.engine_run`); the
helpers read the run's members and audit trail. Runs in the driver process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ftstate.cli.demo.options import NODES, NOTICE_DEADLINE_S, DemoOptions
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import FTError

#: Worker states of a member that no longer holds its rank.
GONE = frozenset({"LOST", "RETIRED", "FAILED"})


def trainer_ranks(first: list[Any], last: list[Any]) -> list[dict[str, Any]]:
    """Each trainer rank's member and pid at the start and at the end of the run (a rank whose
    process survived every failover keeps its pid)."""
    def by_rank(members: list[Any]) -> dict[int, Any]:
        return {m.rank: m for m in members if m.role == "trainer" and m.rank >= 0 and m.state not in GONE}

    start, end = by_rank(first), by_rank(last)
    rows = []
    for rank in sorted(set(start) | set(end)):
        a, b = start.get(rank), end.get(rank)
        rows.append({"rank": rank, "member_start": a.member if a else None, "pid_start": a.pid if a else None,
                     "member_end": b.member if b else None, "pid_end": b.pid if b else None,
                     "same_process": bool(a and b and a.pid is not None and a.pid == b.pid)})
    return rows


def run_nodes(rt: Any, members: list[Any]) -> dict[str, Any]:
    """On how many nodes the run's workers ran: the distinct Ray node ids of every member it
    started (spares and replaced members included), beside the nodes alive in the cluster.
    A member's ``node_id`` where :class:`~ftstate.controller.runtime.MemberInfo` has one,
    else the node the GCS placed its actor on."""
    import ray

    ids: dict[str, str] = {}
    for m in members:
        node_id = getattr(m, "node_id", None)
        if node_id is None:
            try:
                actor_id = rt.handle(m.member)._actor_id.hex()
                node_id = ray._private.state.actors(actor_id=actor_id)["Address"]["NodeID"] or None
            except Exception:  # noqa: BLE001 - a count, best effort; an unknown node is left out
                node_id = None
        if node_id:
            ids[m.member] = node_id
    try:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    except Exception:  # noqa: BLE001 - Ray already down
        alive = None
    return {"count": len(set(ids.values())), "cluster_nodes": alive, "by_member": ids}


def notice_rows(records: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """Every maintenance notice of the trail, with what came of it: ``handled_by``, the
    number of the notice whose drain of the same node was already under way when it came
    (one poll can bring two notices for one node: GCE's maintenance-event and the
    upcoming-maintenance window), None for a notice that started a drain of its own."""
    from ftstate.cli.demo.live import short_node

    out: list[dict[str, Any]] = []
    under_way: dict[str, int] = {}  # node id -> the notice whose drain runs
    for r in records:
        event = r.get("event")
        if event in ("drain_drained", "drain_failed", "drain_cancelled"):
            under_way.pop(str(r.get("node")), None)
        if event != "maintenance_notice":
            continue
        node = r.get("node_id")
        n = {k: r.get(k) for k in ("t", "source", "kind", "deadline", "node_id", "raw", "action")}
        n["node"] = short_node(node or r.get("node"), names)
        n["handled_by"] = under_way.get(str(node)) if node else None
        out.append(n)
        if node and n["handled_by"] is None:
            under_way[str(node)] = len(out)
    return out


def explain_failed_syncs(records: list[dict[str, Any]]) -> list[str]:
    """Each sync attempt the group left by a failure, explained: which version it was pushing,
    why it failed, and whether that version was then committed (the runtime makes a failed
    sync again after a failover: ``rt.sync()`` returned once, for every rollout)."""
    out = []
    target = None
    committed = {r.get("weights_version") for r in records if r.get("event") == "transition"
                 and r.get("machine") == "group" and r.get("trigger") == "sync_done"}
    for r in records:
        if r.get("event") != "transition" or r.get("machine") != "group":
            continue
        if r.get("trigger") == "sync_start":
            target = r.get("weights_version")
        elif r.get("from") == "SYNCING" and r.get("trigger") in ("sync_failed", "sync_timeout"):
            why = str(r.get("reason") or r.get("trigger"))
            why = why if len(why) <= 90 else why[:87] + "..."
            then = ("made again after the failover and committed on every serving rollout" if target in committed
                    else "never committed")
            out.append(f"the sync to weights version {target} ({why}): {then}")
    return out


def write_report(opts: DemoOptions, console: Any, folder: Path, rewards: list[float], syncs: list[Any],
            failovers: list[Any], injected: list[tuple[float, str, str]], members: list[Any],
            final_checksum: str | None, serving: list[str], reference: dict[str, Any] | None,
            error: FTError | None, seconds: float, cfg: RuntimeConfig, nodes: dict[str, Any] | None = None,
            maintenance: dict[str, Any] | None = None, trainer_ranks: list[dict[str, Any]] | None = None,
            engine: dict[str, Any] | None = None, in_flight: dict[str, Any] | None = None) -> int:
    """Write report.json and print the report; the exit code. engine: the engine demo's proof
    (``held_after_sync``: each sync's trainer checksum beside every serving engine's held one;
    ``held_all_equal``), in the report under ``engine`` and part of the verdict. in_flight:
    ``--async``'s stamps (the reference is their replay; a stamp problem fails the run)."""
    from rich.markup import escape
    from rich.table import Table

    from ftstate.cli.demo.live import short_node
    from ftstate.cli.plot import plot_timeline
    from ftstate.core.audit import as_records
    from ftstate.core.audit_check import check_trail
    from ftstate.core.diagram import render
    from ftstate.core.spec import load_machines

    for name, spec in load_machines().items():
        (folder / f"{name}.mmd").write_text(render(spec, "mermaid"))
    trail = folder / "audit.jsonl"
    violations = check_trail(trail)
    picture: Path | None = None
    picture_skipped: str | None = None
    records = as_records(trail) if trail.exists() else []
    announced = (maintenance or {}).get("announced")
    title = f"ftstate demo: {opts.steps} steps"
    if announced:
        title += f", GCE maintenance announced on node {announced['node']} at step {announced['step']}"
    try:
        picture = plot_timeline(trail, folder / "timeline.png", title=title)
    except (ValueError, FTError) as exc:  # FTError: no matplotlib (the plot extra), said in one line
        picture_skipped = str(exc)
        console.print(f"[yellow]skipped:[/] {escape(picture_skipped)}", highlight=False, soft_wrap=True)

    # Every failover figure from the trail, read where the picture and `ftstate audit` read
    # them (audit_view.failover_rows): detection is the fault's chaos record to its LOST one.
    from ftstate.cli.audit_view import describe_failover, failover_rows

    rows = [{k: row[k] for k in ("lost", "replacement", "role", "detection_s", "rerendezvous_s", "transfer_s",
                                 "total_s", "group_version", "cause")} for row in failover_rows(records)]
    failed_syncs = explain_failed_syncs(records)
    nodes = nodes or {"count": None, "cluster_nodes": None, "by_member": {}}
    # A sync that failed: the group left SYNCING by a failure (a sync retried after one
    # counts here too, though rt.sync() itself returned).
    syncs_failed = sum(1 for r in records if r.get("event") == "transition" and r.get("machine") == "group"
                       and r.get("from") == "SYNCING" and r.get("trigger") in ("sync_failed", "sync_timeout"))
    names = (maintenance or {}).get("node_names") or {}
    notices = notice_rows(records, names)
    drains = [{**dataclasses.asdict(d), "node_name": short_node(d.node, names)}
              for d in (maintenance or {}).get("drains", [])]
    maintenance_summary = None
    if maintenance is not None:
        maintenance_summary = {
            "announced": announced,
            "notices": notices,
            "withdrawn": sum(1 for r in records if r.get("event") == "maintenance_withdrawn"),
            "problems": [r.get("message") for r in records if r.get("event") == "maintenance_problem"],
            "sources": [{k: r.get(k) for k in ("place", "node", "sources", "message")}
                        for r in records if r.get("event") == "maintenance_sources"],
            "node_names": names,
        }
    identical = (reference is not None and final_checksum == reference["checksum"]
                 and rewards == reference["rewards"] and all(c == final_checksum for c in serving)
                 and not (in_flight or {}).get("replay_problems"))
    summary = {
        "steps_done": len(rewards),
        "steps": opts.steps,
        "trainers": opts.trainers,
        "trainer_ranks": trainer_ranks or [],
        "trainer_ranks_recovered": [{k: r.get(k) for k in ("t", "weights_version", "newcomers", "restored",
                                                          "untouched", "replayed")}
                                    for r in records if r.get("event") == "trainer_ranks_recovered"],
        "syncs": len(syncs),
        "bytes_synced": sum(r.nbytes for r in syncs),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "rewards": rewards,
        "faults_injected": [{"member": m, "fault": f} for _, m, f in injected],
        "failovers": rows,
        "drains": drains,
        # every change of the fleet (rt.add_rollouts / remove_rollouts): who, fed by whom, how long
        "scaling": [{k: r.get(k) for k in ("event", "members", "sources", "trainer_sources", "restarted", "seconds",
                                           "group_version", "weights_version") if k in r}
                    for r in records if r.get("event") in ("rollouts_added", "rollouts_removed")],
        "syncs_failed": syncs_failed,
        "syncs_failed_explained": failed_syncs,
        "maintenance": maintenance_summary,
        "budget_left": None if cfg.fault_tolerance.max_failovers is None else
        cfg.fault_tolerance.max_failovers - (failovers[-1].budget or {}).get("spent", 0) if failovers else
        cfg.fault_tolerance.max_failovers,
        # the failover budget after the last failover (spent, in the window, quarantined nodes)
        "budget": failovers[-1].budget if failovers else None,
        "final_checksum": final_checksum,
        "serving_checksums": serving,
        "fault_free_checksum": reference["checksum"] if reference else None,
        "fault_free_rewards": reference["rewards"] if reference else None,
        "identical_to_fault_free": identical,
        "audit_violations": [f"line {v.line}: {v.problem}" for v in violations],
        "error": f"{type(error).__name__}: {error}" if error else None,
        "seconds": seconds,
        "timeline_picture": str(picture) if picture else None,
        "timeline_picture_skipped": picture_skipped,
        "address": cfg.address,
        "nodes": nodes["count"],
        "cluster_nodes": nodes["cluster_nodes"],
        "members": [{**dataclasses.asdict(m), "node_id": nodes["by_member"].get(m.member)} for m in members],
        "engine": engine,
        "in_flight": in_flight,
    }
    (folder / "report.json").write_text(json.dumps(summary, indent=2, default=str))

    table = Table(title="ftstate demo report", show_header=False)
    table.add_row("steps", f"{len(rewards)}/{opts.steps}")
    table.add_row("syncs", f"{len(syncs)} ({summary['bytes_synced'] / 2**20:.1f} MiB in all)")
    if rewards:
        table.add_row("mean reward", f"{rewards[0]:.3f} -> {rewards[-1]:.3f}")
    for i, r in enumerate(rows, 1):
        table.add_row(f"failover {i}", escape(describe_failover({**r, "cause": ""})))
    if maintenance_summary is not None:
        if announced:
            table.add_row("maintenance", f"announced by node {announced['node']}'s GCE metadata server at step "
                          f"{announced['step']}: TERMINATE_ON_HOST_MAINTENANCE, window in {NOTICE_DEADLINE_S:.0f}s")
        else:
            table.add_row("maintenance", "not announced (the run ended first)")
        for i, n in enumerate(notices, 1):
            left = (f", deadline {n['deadline'] - announced['at']:.0f}s after the announcement"
                    if announced and isinstance(n["deadline"], (int, float)) else "")
            action = f"covered by notice {n['handled_by']}'s drain" if n["handled_by"] else n["action"]
            table.add_row(f"notice {i}", escape(f"{n['source']} {n['kind']} on node {n['node']}{left}: {action}"))
        if not notices and announced:
            table.add_row("notice", "[red]none seen[/]")
        for i, d in enumerate(drains, 1):
            style = {"drained": "green", "failed": "red", "cancelled": "yellow"}.get(d["outcome"], "")
            moved = ", ".join(f"{a} -> {b}" for a, b in d["moved"].items()) or escape(d["reason"])
            table.add_row(f"drain {i}", f"[{style}]{d['outcome']}[/] node {d['node_name']} in {d['seconds']:.3f}s: "
                          f"{moved} (no budget spent)")
        if maintenance_summary["problems"]:
            table.add_row("maintenance warnings", str(len(maintenance_summary["problems"])))
    if opts.trainers > 1:
        for t in trainer_ranks or []:
            kept = ("same process" if t["same_process"]
                    else f"replaced: {t['member_end']} pid {t['pid_end']}")
            table.add_row(f"trainer rank {t['rank']}", f"{t['member_start']} pid {t['pid_start']} -> {kept}")
    for i, c in enumerate(summary["scaling"], 1):
        fed = sorted({str(v) for v in (c.get("sources") or {}).values()})
        table.add_row(f"scaling {i}", escape(f"{'added' if c['event'] == 'rollouts_added' else 'removed'} "
                                             f"{', '.join(c['members'])} in {c['seconds']:.2f}s"
                                             + (f", fed by {', '.join(fed)} (trainer bytes: none)"
                                                if fed and not c.get("trainer_sources") else "")))
    table.add_row("syncs failed", escape(f"{syncs_failed}" + (f": {'; '.join(failed_syncs)}" if failed_syncs else "")))
    if nodes["count"] is not None:
        where = f" of {nodes['cluster_nodes']} in the cluster" if nodes["cluster_nodes"] else ""
        place = cfg.address or (f"a local {len(NODES)}-node cluster" if maintenance is not None else "a local cluster")
        table.add_row("nodes", f"{nodes['count']}{where} ({place})")
    budget = summary["budget"] or {"spent": 0, "in_window": 0, "quarantined": []}
    left = (f"{summary['budget_left']} of {cfg.fault_tolerance.max_failovers} left; "
            if summary["budget_left"] is not None else "")
    table.add_row("failover budget", f"{left}{budget['spent']} spent, {budget['in_window']} in the last "
                  f"{cfg.fault_tolerance.failover_window_s:g} s; quarantined: "
                  f"{', '.join(n[:12] for n in budget['quarantined']) or 'none'}")
    table.add_row("audit --check", "passed" if not violations else f"{len(violations)} violations")
    held_ok = engine is None or engine["held_all_equal"]
    if engine is not None:
        proofs = engine["held_after_sync"]
        bad = sum(1 for h in proofs if not h["equal"])
        table.add_row("engines' held weights", ("[green]equal to the trainer's[/]" if held_ok else f"[red]{bad} syncs "
                      "DIFFERENT[/]") + f" after every one of {len(proofs)} syncs (read back from each vLLM engine)")
    if in_flight is not None:
        by = in_flight["samples_by_staleness"]
        mid = (f", {in_flight['swapped_mid_answer']} swapped mid-answer" if "swapped_mid_answer" in in_flight
               else "")
        table.add_row("in-flight samples", f"{by.get('0', 0)} on the version pushed, {by.get('1', 0)} one behind{mid} "
                      f"(max_staleness {in_flight['max_staleness']}); the reference replays their stamps"
                      + (f"; [red]{len(in_flight['stamp_problems'])} stamps out of bounds[/]"
                         if in_flight["stamp_problems"] else "")
                      + (f"; [red]{len(in_flight['replay_problems'])} replayed otherwise[/]"
                         if in_flight.get("replay_problems") else ""))
    idle = (engine or {}).get("trainer_idle")
    if idle and idle["median_without_faults_s"] is not None:
        table.add_row("trainer idle", f"{idle['median_without_faults_s']:.3f}s a step (median of the steps after the "
                      f"first without a fault; {idle['mode']}: waiting for samples + inside rt.sync())")
    elif idle:
        table.add_row("trainer idle", "every step after the first had a fault in it or the step before: see "
                      "engine.trainer_idle in report.json")
    if error is not None:
        table.add_row("error", f"[red]{escape(summary['error'])}[/]")
    elif reference is None:
        table.add_row("vs fault-free run", "[red]not replayed[/]: " + escape("; ".join(
            (in_flight or {}).get("stamp_problems", [])[:3])))
    else:
        verdict = "[green]identical[/]" if identical else "[red]DIFFERENT[/]"
        table.add_row("vs fault-free run" if in_flight is None else "vs its stamps' replay", f"{verdict} (weights {final_checksum} vs {reference['checksum']}, "
                      f"reward curve {'equal' if rewards == reference['rewards'] else 'differs'})")
    table.add_row("took", f"{seconds:.1f}s")
    table.add_row("output", f"{folder}/ (audit.jsonl, group.mmd, worker.mmd, "
                  f"{'timeline.png, ' if picture else ''}report.json)")
    console.print(table)
    if error is not None:
        console.print(f"[bold red]demo failed:[/] {escape(summary['error'])}")
        return 2
    if violations:
        for v in violations:
            console.print(f"[red]audit violation[/] line {v.line}: {escape(v.problem)}")
        return 1
    return 0 if identical and held_ok else 1
