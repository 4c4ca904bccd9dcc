"""Trails for the audit view and checker tests, written through the real AuditTrail: a run
with every kind of event the runtime writes (a failover after a chaos kill, rewards, retries,
an abandoned transfer), so views and fuzzing start from what a real run leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftstate.core.audit import AuditTrail


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tr(member: str, src: str, trigger: str, dst: str, **kw: Any) -> dict[str, Any]:
    ident = ({"machine": "group"} if member == "group"
             else {"machine": "worker", "role": "trainer" if member.startswith("trainer") else "rollout",
                   "rank": 0 if member.startswith("trainer") else -1 if member.startswith("spare")
                   else int(member.split("-")[1]) + 1})
    return {"member": member, **ident, "from": src, "to": dst, "trigger": trigger, **{**kw}}


def write_run(trail: AuditTrail, clock: _Clock, run: str) -> None:
    """One run: trainer-0, rollout-0, rollout-1 form version 1, sync version 1, rollout-1 is
    SIGKILLed and replaced by spare-rollout-0, then a sync with a retry, rewards."""
    trail.begin_run(run, config_digest="0123456789abcdef", trainer_workers=1, rollout_workers=2,
                    fault_tolerance=True, versions={"ftstate": "0.1.0", "ray": "2.60", "torch": "2.13.0"},
                    nodes=["abcd1234@127.0.0.1 CPU=2"])

    def at(t: float, event: str, **kw: Any) -> None:
        clock.now = t
        trail.record(event, **kw)

    def tr(t: float, *args: Any, **kw: Any) -> None:
        at(t, "transition", **_tr(*args, **kw))

    tr(0.1, "group", "INIT", "start", "RENDEZVOUS", group_version=1, weights_version=0)
    for m in ("trainer-0", "rollout-0", "rollout-1"):
        tr(0.2, m, "INIT", "join", "RENDEZVOUS", group_version=1, weights_version=0)
    tr(0.3, "spare-rollout-0", "INIT", "warm", "STANDBY", group_version=0, weights_version=0)
    tr(0.5, "group", "RENDEZVOUS", "rendezvous_done", "READY", group_version=1, weights_version=0)
    tr(0.5, "trainer-0", "RENDEZVOUS", "joined_as_source", "RESYNCED", group_version=1, weights_version=0)
    tr(0.5, "trainer-0", "RESYNCED", "admit", "READY", group_version=1, weights_version=0)
    for m in ("rollout-0", "rollout-1"):
        tr(0.5, m, "RENDEZVOUS", "joined", "STALE", group_version=1, weights_version=0)
    # sync 1
    tr(1.0, "group", "READY", "sync_start", "SYNCING", group_version=1, weights_version=1)
    tr(1.0, "trainer-0", "READY", "sync", "SYNCING", group_version=1, weights_version=0)
    for m in ("rollout-0", "rollout-1"):
        tr(1.0, m, "STALE", "resync", "RESYNCING", group_version=1, weights_version=0)
        tr(1.2, m, "RESYNCING", "verified", "RESYNCED", group_version=1, weights_version=1, checksum="c1")
        tr(1.2, m, "RESYNCED", "admit", "READY", group_version=1, weights_version=1, checksum="c1")
    tr(1.2, "trainer-0", "SYNCING", "committed", "READY", group_version=1, weights_version=1, checksum="c1")
    tr(1.2, "group", "SYNCING", "sync_done", "READY", group_version=1, weights_version=1, checksum="c1",
       nbytes=1024)
    at(1.5, "reward", step=1, reward=0.125)
    # a kill, the loss, the failover
    at(2.0, "chaos", member="rollout-1", fault="kill", pid=4242)
    tr(2.07, "rollout-1", "READY", "died", "LOST", group_version=1, weights_version=1,
       reason="process died during vigil(): The actor died unexpectedly")
    tr(2.08, "group", "READY", "member_lost", "DEGRADED", group_version=1, weights_version=1,
       reason="rollout-1: process died during vigil()")
    tr(2.08, "group", "DEGRADED", "promote", "PROMOTING", group_version=1, weights_version=1,
       reason="rollout-1: process died during vigil()")
    at(2.08, "budget_spent", machine="group", member="group", budget="max_failovers", spent=1, limit=5)
    tr(2.09, "rollout-1", "LOST", "retire", "RETIRED", group_version=1, weights_version=1)
    tr(2.09, "spare-rollout-0", "STANDBY", "promote", "PROMOTING", group_version=0, weights_version=0)
    tr(2.09, "spare-rollout-0", "PROMOTING", "join", "RENDEZVOUS", group_version=2, weights_version=0, rank=2)
    at(2.12, "group_formed", machine="group", member="group", group_version=2, weights_version=1,
       members=["trainer-0", "rollout-0", "spare-rollout-0"])
    tr(2.12, "spare-rollout-0", "RENDEZVOUS", "joined", "STALE", group_version=2, weights_version=0, rank=2)
    tr(2.12, "spare-rollout-0", "STALE", "resync", "RESYNCING", group_version=2, weights_version=0, rank=2)
    tr(2.15, "spare-rollout-0", "RESYNCING", "verified", "RESYNCED", group_version=2, weights_version=1,
       checksum="c1", rank=2)
    tr(2.15, "spare-rollout-0", "RESYNCED", "admit", "READY", group_version=2, weights_version=1, checksum="c1",
       rank=2)
    tr(2.15, "group", "PROMOTING", "promoted", "RESYNCED", group_version=2, weights_version=1)
    tr(2.15, "group", "RESYNCED", "resume", "READY", group_version=2, weights_version=1)
    at(2.15, "failover", lost="rollout-1", replacement="spare-rollout-0", role="rollout", rerendezvous_s=0.04,
       transfer_s=0.03, total_s=0.08, group_version=2, weights_version=1, resynced=True, batch=1)
    # a sync that fails once (a transient transport error), then completes
    tr(3.0, "group", "READY", "sync_start", "SYNCING", group_version=2, weights_version=2)
    at(3.1, "transfer_abandoned", reason="rollout-0: PeerLost: bucket 2/4", members=["spare-rollout-0"])
    tr(3.1, "group", "SYNCING", "sync_failed", "READY", group_version=2, weights_version=1,
       reason="PeerLost: bucket 2/4")
    at(3.1, "sync_retry", reason="PeerLost: rollout-0: a peer was lost during bucket 2/4",
       membership_changed=False, transient_retries=1, weights_version=1, group_version=2)
    at(3.2, "call_retry", method="generate", items=4, attempt=1)
    at(3.5, "reward", step=2, reward=0.5)
    for m in ("trainer-0", "rollout-0", "spare-rollout-0"):
        tr(9.0, m, "READY", "stop", "STOPPED", group_version=2, weights_version=1)
    tr(9.0, "group", "READY", "stop", "STOPPED", group_version=2, weights_version=1)


def write_trail(path: Path, runs: tuple[str, ...] = ("run-a",)) -> Path:
    """A file with ``runs`` written one after another, each through its own AuditTrail
    (as two programs with the same audit_log would)."""
    for run in runs:
        clock = _Clock()
        with AuditTrail(path, clock=clock) as trail:
            write_run(trail, clock, run)
    return path
