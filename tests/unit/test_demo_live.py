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
