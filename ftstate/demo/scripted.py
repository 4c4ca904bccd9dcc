"""``ftstate demo``: the machines on the embedded default, end to end, with the audit trail.

This first version drives the group and worker machines through a scripted run (rendezvous,
syncs, a rollout lost and replaced by a standby, a rendezvous deadline expiring) with an
accelerated clock, writes the audit trail and the diagrams to the output folder, checks
the trail against the machines' invariants and prints its timeline. The Ray-backed demo
replaces the script once the runtime lands.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ftstate.audit import AuditTrail
from ftstate.config import RuntimeConfig
from ftstate.deadline import ManualClock
from ftstate.machine import StateMachine
from ftstate.spec import get_spec, load_machines


async def _scripted_run(trail: AuditTrail, steps: int, faults: bool) -> StateMachine:
    clock = ManualClock()
    cfg = RuntimeConfig.from_dict({"fault_tolerance": {"enable": True}}, environ={})
    group = StateMachine(get_spec("group"), member="group", config=cfg, audit=trail, clock=clock)
    workers = {
        name: StateMachine(get_spec("worker"), member=name, role=role, rank=rank, config=cfg, audit=trail, clock=clock)
        for name, role, rank in [("trainer-0", "trainer", 0), ("rollout-0", "rollout", 1),
                                 ("rollout-1", "rollout", 2), ("standby-0", "rollout", 3)]
    }
    group.group_version = 1
    for w in workers.values():
        w.group_version = 1
    await group.fire("start")
    await workers["standby-0"].fire("warm")
    for name in ("trainer-0", "rollout-0", "rollout-1"):
        await workers[name].fire("join")
    await group.fire("rendezvous_done")
    await workers["trainer-0"].fire("joined_as_source")
    await workers["trainer-0"].fire("admit")
    for name in ("rollout-0", "rollout-1"):
        await workers[name].fire("joined")
    members = ["rollout-0", "rollout-1"]
    for step in range(1, steps + 1):
        clock.advance(1.0)
        group.weights_version = step
        await group.fire("sync_start")
        await workers["trainer-0"].fire("sync")
        for name in members:
            w = workers[name]
            await w.fire("sync" if w.state == "READY" else "resync")
        for name in members:
            w = workers[name]
            w.weights_version = step
            if w.state == "SYNCING":
                await w.fire("committed")
            else:
                await w.fire("verified")
                await w.fire("admit")
        workers["trainer-0"].weights_version = step
        await workers["trainer-0"].fire("committed")
        await group.fire("sync_done")
        if faults and step == steps // 2:
            await workers["rollout-1"].fire("died", reason="SIGKILL (scripted)")
            await group.fire("member_lost", reason="rollout-1 died")
            await group.fire("promote", reason="rollout-1 died")
            spare = workers["standby-0"]
            await spare.fire("promote")
            group.group_version += 1
            for w in workers.values():
                w.group_version = group.group_version
            await spare.fire("join")
            await spare.fire("joined")
            await spare.fire("resync")
            spare.weights_version = step
            await spare.fire("verified")
            await spare.fire("admit")
            await group.fire("promoted")
            await group.fire("resume")
            await workers["rollout-1"].fire("retire")
            members = ["rollout-0", "standby-0"]
    for w in workers.values():
        if not w.terminal:
            await w.fire("stop")
    await group.fire("stop")
    return group


def run_demo(out: str = "ftstate-demo", steps: int = 0, faults: bool = True) -> int:
    """Run the demo; returns the process exit code (0: the trail passed every check)."""
    from rich.console import Console

    from ftstate.audit_check import check_trail
    from ftstate.audit_view import render_summary, render_timeline
    from ftstate.diagram import render

    console = Console()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    trail_path = folder / "audit.jsonl"
    trail_path.unlink(missing_ok=True)
    with AuditTrail(trail_path) as trail:
        asyncio.run(_scripted_run(trail, steps or 4, faults))
    for name, spec in load_machines().items():
        (folder / f"{name}.mmd").write_text(render(spec, "mermaid"))
    records = trail.records
    console.print(render_timeline(records))
    console.print(render_summary(records))
    violations = check_trail(trail_path)
    for v in violations:
        console.print(f"[red]violation[/red] line {v.line}: {v.problem}")
    console.print(f"audit trail: {trail_path} ({len(records)} records); diagrams: {folder}/*.mmd")
    return 1 if violations else 0
