"""A newcomer whose load was proven is walked to serving by legal edges, wherever the
watchdog left it (the race that stalled the 512 MB trainer failover benchmark: a missed
heartbeat during the reverse transfer made the new trainer SUSPECT, its answer made it STALE,
and the failover's `verified` no longer had an edge). Pure machines, no Ray."""

from __future__ import annotations

import pytest

from ftstate.controller.membership import walk_proven
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.deadline import ManualClock
from ftstate.core.errors import MemberLost
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec


async def newcomer(*triggers: str) -> tuple[StateMachine, AuditTrail]:
    audit = AuditTrail()
    m = StateMachine(get_spec("worker"), member="spare-trainer-0", role="trainer", rank=0,
                     config=RuntimeConfig.from_dict({}, environ={}), clock=ManualClock(), audit=audit)
    for t in ("warm", "promote", "join", "joined", "resync", *triggers):
        await m.fire(t)
    return m, audit


def path(audit: AuditTrail) -> list[tuple[str, str, str]]:
    return [(r["from"], r["trigger"], r["to"]) for r in audit.records if r["event"] == "transition"]


@pytest.mark.parametrize(
    ("watchdog", "expected"),
    [
        ((), [("RESYNCING", "verified", "RESYNCED"), ("RESYNCED", "admit", "READY")]),
        (("heartbeat_missed",), [("SUSPECT", "verified", "RESYNCED"), ("RESYNCED", "admit", "READY")]),
        (
            ("heartbeat_missed", "alive_stale"),
            [("STALE", "resync", "RESYNCING"), ("RESYNCING", "verified", "RESYNCED"), ("RESYNCED", "admit", "READY")],
        ),
    ],
    ids=["undisturbed", "suspected", "suspected-then-stale"],
)
async def test_walks_to_ready_by_legal_edges(watchdog, expected):
    m, audit = await newcomer(*watchdog)
    before = len(path(audit))
    await walk_proven(m, "RESYNCED", checksum="00ff")
    assert m.state == "RESYNCED"
    await walk_proven(m, "READY")
    assert m.state == "READY"
    assert path(audit)[before:] == expected
    verified = [r for r in audit.records if r.get("trigger") == "verified"]
    assert verified[-1]["checksum"] == "00ff"


async def test_already_admitted_by_the_watchdog_is_left_alone():
    m, audit = await newcomer("verified", "admit")
    n = len(audit.records)
    await walk_proven(m, "RESYNCED")
    assert m.state == "READY" and len(audit.records) == n


@pytest.mark.parametrize("fault", ["died", "stop"])
async def test_a_newcomer_gone_meanwhile_is_reported_lost(fault):
    m, _ = await newcomer(fault)
    with pytest.raises(MemberLost, match="spare-trainer-0"):
        await walk_proven(m, "READY")
