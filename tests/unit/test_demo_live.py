"""The demo's live view in the maintenance scenario: the node each worker runs on, DRAINING
styled, and the notices and drains as they arrive in the audit trail (without Ray)."""

from __future__ import annotations

import io
import types

from rich.console import Console

from ftstate.cli.demo.live import LiveView, describe_event
from ftstate.controller.runtime import MemberInfo
from ftstate.core.audit import AuditTrail

NODE = "96b723fd9531ab0c"


def fake_runtime(trail: AuditTrail, members: list[MemberInfo]) -> types.SimpleNamespace:
    return types.SimpleNamespace(group=object(), state="READY", group_version=3, weights_version=9, failovers=[],
                                 drains=[], members=lambda: members, audit=trail)


def test_the_view_shows_the_nodes_and_the_maintenance_as_it_happens() -> None:
    trail = AuditTrail(None)
    members = [MemberInfo("trainer-0", "trainer", 0, "READY", 9, 3, 11, "127.0.0.1", "a" * 16),
               MemberInfo("rollout-0", "rollout", 1, "DRAINING", 9, 3, 12, "127.0.0.1", NODE)]
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=True, color_system=None)
    view = LiveView(fake_runtime(trail, members), 6, console, node_names={NODE: "b"})
    console.print(view)
    assert "DRAINING" in out.getvalue() and "maintenance" not in out.getvalue()
    trail.record("maintenance_notice", source="gce", kind="terminate", deadline=4e9, node=NODE, node_id=NODE,
                 action="drain")
    trail.record("maintenance_notice", source="gce", kind="maintenance", deadline=4e9, node=NODE, node_id=NODE,
                 action="drain")
    trail.record("drain_started", node=NODE, source="gce", kind="terminate", members=["rollout-0"])
    trail.record("drain_drained", node=NODE, source="gce", kind="terminate", moved={"rollout-0": "rollout-3"},
                 seconds=0.42)
    out.truncate(0)
    console.print(view)
    text = out.getvalue()
    assert "maintenance" in text and "notice gce terminate node b" in text
    assert "notice gce maintenance node b, deadline" in text and "covered by the drain under way" in text
    assert "rollout-0 DRAINING, serving on" in text and "drained node b in 0.42 s: rollout-0 -> rollout-3" in text
    rows = {line.split()[0]: line.rstrip() for line in text.splitlines() if line.startswith(("trainer-0", "rollout-0"))}
    assert rows["rollout-0"].endswith(" b") and rows["trainer-0"].endswith(" aaaaaaaa")  # the node column


def test_each_event_reads_as_one_line() -> None:
    names = {NODE: "b"}
    assert "deadline 120 s ahead" in describe_event(
        {"event": "maintenance_notice", "source": "gce", "kind": "terminate", "deadline": 1120.0, "node_id": NODE,
         "action": "drain"}, names, now=1000.0)
    assert "no room" in describe_event({"event": "drain_failed", "node": NODE, "reason": "no room", "moved": {}},
                                       names)
    assert describe_event({"event": "maintenance_withdrawn", "source": "gce", "kind": "terminate",
                           "node_id": NODE}, names).endswith("node b")
    assert "unreachable" in describe_event({"event": "maintenance_problem", "message": "gce: unreachable"})


def starting_runtime(trail: AuditTrail) -> types.SimpleNamespace:
    from ftstate.controller.progress import Progress

    return types.SimpleNamespace(group=None, state="INIT", group_version=0, weights_version=0, failovers=[],
                                 drains=[], members=lambda: [], audit=trail, progress=Progress())


def test_on_a_terminal_the_header_says_what_start_up_waits_for() -> None:
    rt = starting_runtime(AuditTrail(None))
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=True, color_system=None)
    view = LiveView(rt, 6, console)
    rt.progress.report("workers", "starting 24 workers: 7 ready", workers=24, ready=7)
    console.print(view)
    assert "starting 24 workers: 7 ready" in out.getvalue()
    assert "step" not in out.getvalue().split("RL steps")[0]  # nothing printed as plain lines on a terminal


def test_without_a_terminal_each_phase_step_and_failover_is_one_plain_line() -> None:
    rt = starting_runtime(AuditTrail(None))
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False)
    view = LiveView(rt, 2, console)
    with view:
        rt.progress.report("workers", "starting 3 workers: 0 ready")
        rt.progress.report("oversubscribed", "9 worker processes requested on a cluster of 2 CPUs", level="warning")
        rt.group, rt.state, rt.weights_version = object(), "READY", 2
        view.update(step=1, reward=0.25)
        rt.failovers = [types.SimpleNamespace(lost="rollout-1", replacement="spare-rollout-0", rerendezvous_s=0.04,
                                              transfer_s=0.03, total_s=0.08, reason="process died during vigil()")]
        view.update(step=2, reward=0.5)
    assert out.getvalue().splitlines() == [
        "starting 3 workers: 0 ready",
        "warning: 9 worker processes requested on a cluster of 2 CPUs",
        "step 1/2: reward 0.250, weights version 2",
        "failover 1: rollout-1 -> spare-rollout-0: re-rendezvous 0.040s, transfer 0.030s, total 0.080s "
        "(cause: process died during vigil())",
        "step 2/2: reward 0.500, weights version 2",
    ]
