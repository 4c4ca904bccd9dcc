"""The machines built from the specs: the card's path, deadlines, budgets, queued events,
audit records. No Ray, no torch, no sleeps: deadlines run on a ManualClock."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from ftstate.core.audit import AuditTrail
from ftstate.core.budget import Budget
from ftstate.core.config import RuntimeConfig
from ftstate.core.deadline import ManualClock
from ftstate.core.errors import (
    FailoverBudgetExhausted,
    FailoverTimeout,
    HeartbeatTimeout,
    InternalError,
    InvalidTransition,
    RendezvousTimeout,
    SyncTimeout,
)
from ftstate.core.machine import StateMachine, compile_spec
from ftstate.core.spec import get_spec


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def audit() -> AuditTrail:
    return AuditTrail()


def config(**dotted) -> RuntimeConfig:
    return RuntimeConfig.from_dict({}, environ={}).replace(**dotted)


def group(clock, audit, **dotted) -> StateMachine:
    return StateMachine(get_spec("group"), member="group", config=config(**dotted), clock=clock, audit=audit)


def worker(clock, audit, member="rollout-1", **dotted) -> StateMachine:
    return StateMachine(
        get_spec("worker"), member=member, role="rollout", rank=1, config=config(**dotted), clock=clock, audit=audit
    )


async def drive(machine: StateMachine, *triggers: str) -> list[str]:
    return [await machine.fire(t) for t in triggers]


def transitions_of(audit: AuditTrail, member: str) -> list[tuple[str, str, str]]:
    return [(r["from"], r["trigger"], r["to"]) for r in audit.records if r["event"] == "transition" and r["member"] == member]


class TestTheCardsPath:
    async def test_group_goes_init_rendezvous_ready_degraded_promoting_resynced_ready(self, clock, audit):
        g = group(clock, audit)
        states = await drive(g, "start", "rendezvous_done", "member_lost", "promote", "promoted", "resume")
        assert states == ["RENDEZVOUS", "READY", "DEGRADED", "PROMOTING", "RESYNCED", "READY"]

    async def test_a_sync_round_trip(self, clock, audit):
        g = group(clock, audit)
        assert await drive(g, "start", "rendezvous_done", "sync_start", "sync_done") == [
            "RENDEZVOUS", "READY", "SYNCING", "READY"]

    async def test_a_new_rollout_serves_only_after_resynced(self, clock, audit):
        w = worker(clock, audit)
        states = await drive(w, "join", "joined", "resync", "verified", "admit")
        assert states == ["RENDEZVOUS", "STALE", "RESYNCING", "RESYNCED", "READY"]
        assert w.serving

    async def test_a_standby_is_promoted_then_resynced_before_serving(self, clock, audit):
        w = worker(clock, audit, member="standby-0")
        states = await drive(w, "warm", "promote", "join", "joined", "resync", "verified", "admit")
        assert states[-2:] == ["RESYNCED", "READY"]

    async def test_the_trainer_joins_as_the_source_of_the_weights(self, clock, audit):
        w = worker(clock, audit, member="trainer-0")
        assert await drive(w, "join", "joined_as_source", "admit") == ["RENDEZVOUS", "RESYNCED", "READY"]


class TestStaleIsTheOnlyWayBack:
    @pytest.mark.parametrize("trigger", ["admit", "committed", "heartbeat_ok", "join"])
    async def test_a_lost_worker_cannot_be_admitted_directly(self, clock, audit, trigger):
        w = worker(clock, audit)
        await drive(w, "join", "joined", "resync", "verified", "admit", "died")
        assert w.state == "LOST"
        if trigger == "join":  # rejoining is allowed, but lands in RENDEZVOUS, not serving
            assert await w.fire("join") == "RENDEZVOUS"
            return
        with pytest.raises(InvalidTransition, match=rf"no transition for trigger '{trigger}' from state LOST"):
            await w.fire(trigger)

    async def test_a_suspect_worker_comes_back_through_resynced(self, clock, audit):
        w = worker(clock, audit)
        await drive(w, "join", "joined", "resync", "verified", "admit", "heartbeat_missed")
        with pytest.raises(InvalidTransition):
            await w.fire("admit")
        assert await drive(w, "verified", "admit") == ["RESYNCED", "READY"]

    async def test_a_failed_sync_leaves_the_worker_stale_not_serving(self, clock, audit):
        w = worker(clock, audit)
        await drive(w, "join", "joined", "resync", "verified", "admit", "sync", "sync_failed")
        assert w.state == "STALE" and not w.serving


class TestDeadlines:
    async def test_rendezvous_expires_after_init_timeout_naming_who_is_missing(self, clock, audit):
        g = group(clock, audit, init_timeout_s=30.0)
        g.group_version = 4
        await g.fire("start")
        g.describe_wait("rendezvous of group 'weights'", missing=["rollout-1"], arrived=["trainer-0", "rollout-0"])
        clock.advance(29.9)
        await g.settle()
        assert g.state == "RENDEZVOUS"
        clock.advance(0.2)
        await g.settle()
        assert g.state == "FAILED"
        assert isinstance(g.error, RendezvousTimeout)
        assert str(g.error) == (
            "rendezvous of group 'weights' timed out after 30s (init_timeout_s); member group; "
            "group version 4; missing: rollout-1; arrived: rollout-0, trainer-0"
        )
        assert g.error.missing == ("rollout-1",)

    async def test_sync_timeout_fails_the_group(self, clock, audit):
        g = group(clock, audit, sync_timeout_s=5.0)
        await drive(g, "start", "rendezvous_done", "sync_start")
        clock.advance(5.0)
        await g.settle()
        assert g.state == "FAILED" and isinstance(g.error, SyncTimeout)

    async def test_failover_timeout_fails_the_group(self, clock, audit):
        g = group(clock, audit, failover_timeout_s=2.0)
        await drive(g, "start", "rendezvous_done", "member_lost", "promote")
        clock.advance(2.5)
        await g.settle()
        assert g.state == "FAILED" and isinstance(g.error, FailoverTimeout)

    async def test_a_suspect_worker_is_lost_after_heartbeat_timeout(self, clock, audit):
        w = worker(clock, audit, heartbeat_timeout_s=10.0)
        await drive(w, "join", "joined", "resync", "verified", "admit", "heartbeat_missed")
        clock.advance(10.0)
        await w.settle()
        assert w.state == "LOST" and isinstance(w.error, HeartbeatTimeout)

    async def test_a_worker_sync_deadline_falls_back_to_stale(self, clock, audit):
        w = worker(clock, audit, sync_timeout_s=1.0)
        await drive(w, "join", "joined", "resync", "verified", "admit", "sync")
        clock.advance(1.0)
        await w.settle()
        assert w.state == "STALE" and isinstance(w.error, SyncTimeout)

    async def test_leaving_the_state_disarms_its_deadline(self, clock, audit):
        g = group(clock, audit, init_timeout_s=30.0)
        await drive(g, "start", "rendezvous_done")
        assert g.deadline is None
        clock.advance(1000)
        await g.settle()
        assert g.state == "READY" and g.error is None

    async def test_reentering_a_state_arms_a_fresh_deadline(self, clock, audit):
        g = group(clock, audit, sync_timeout_s=10.0)
        await drive(g, "start", "rendezvous_done", "sync_start")
        clock.advance(8)
        await drive(g, "sync_done", "sync_start")
        clock.advance(8)  # 16 s after the first entry, 8 s into the second
        await g.settle()
        assert g.state == "SYNCING"
        clock.advance(2)
        await g.settle()
        assert g.state == "FAILED"

    async def test_an_expiry_queued_behind_an_event_that_left_the_state_is_discarded(self, clock, audit):
        g = group(clock, audit, sync_timeout_s=1.0)
        await drive(g, "start", "rendezvous_done", "sync_start")
        clock.advance(1.0)  # the deadline falls due: its expiry is queued, not yet run
        assert g._expiries
        await g.fire("sync_done")  # an event that leaves the state comes first (fire never waits)
        await g.settle()
        assert g.state == "READY" and g.error is None

    async def test_the_expiry_is_audited_with_what_and_how_long(self, clock, audit):
        g = group(clock, audit, init_timeout_s=3.0)
        await g.fire("start")
        g.describe_wait("rendezvous", missing=["rollout-2"])
        clock.advance(3.0)
        await g.settle()
        expiry = next(r for r in audit.records if r["event"] == "deadline_expired")
        assert expiry["key"] == "init_timeout_s" and expiry["seconds"] == 3.0 and expiry["missing"] == ["rollout-2"]
        last = audit.records[-1]
        assert (last["from"], last["trigger"], last["to"], last["error"]) == (
            "RENDEZVOUS", "rendezvous_timeout", "FAILED", "RendezvousTimeout")

    async def test_deadline_scope_cancels_the_work_and_raises_the_typed_error(self, clock, audit):
        g = group(clock, audit, init_timeout_s=5.0)
        await g.fire("start")
        g.describe_wait("group init futures", missing=["rollout-1"])
        never = asyncio.Event()

        async def bounded_wait():
            async with g.deadline_scope():
                await never.wait()

        task = asyncio.create_task(bounded_wait())
        await asyncio.sleep(0)
        clock.advance(5.0)
        with pytest.raises(RendezvousTimeout, match="group init futures timed out after 5s"):
            await task
        assert g.state == "FAILED"

    async def test_deadline_scope_lets_work_that_finishes_in_time_through(self, clock, audit):
        g = group(clock, audit)
        await g.fire("start")
        async with g.deadline_scope() as d:
            assert d.key == "init_timeout_s" and d.seconds == 600.0
        assert g.state == "RENDEZVOUS"

    async def test_wait_for_raises_the_recorded_error_when_the_machine_fails(self, clock, audit):
        g = group(clock, audit, init_timeout_s=1.0)
        await g.fire("start")
        waiter = asyncio.create_task(g.wait_for("READY"))
        await asyncio.sleep(0)
        clock.advance(1.0)
        with pytest.raises(RendezvousTimeout):
            await waiter


class TestBudgets:
    async def test_each_entry_into_promoting_spends_one(self, clock, audit):
        g = group(clock, audit, **{"fault_tolerance.max_failovers": 3})
        await drive(g, "start", "rendezvous_done")
        for _ in range(2):
            await drive(g, "member_lost", "promote", "promoted", "resume")
        budget = g.budgets["fault_tolerance.max_failovers"]
        assert budget.spent == 2 and budget.remaining == 1
        spends = [r for r in audit.records if r["event"] == "budget_spent"]
        assert [r["remaining"] for r in spends] == [2, 1]

    async def test_an_exhausted_budget_fails_the_group_naming_what_it_was_spent_on(self, clock, audit):
        g = group(clock, audit, **{"fault_tolerance.max_failovers": 2})
        await drive(g, "start", "rendezvous_done")
        for who in ("rollout-1", "trainer-0"):
            await g.fire("member_lost")
            await g.fire("promote", reason=f"{who} died")
            await drive(g, "promoted", "resume")
        await g.fire("member_lost")
        assert await g.fire("promote", reason="rollout-0 died") == "FAILED"
        assert isinstance(g.error, FailoverBudgetExhausted)
        assert g.error.spent_on == ("rollout-1 died", "trainer-0 died")
        assert "max_failovers=2 already spent on: rollout-1 died; trainer-0 died" in str(g.error)
        assert [r["event"] for r in audit.records[-2:]] == ["budget_exhausted", "transition"]

    async def test_one_entry_for_a_whole_node_spends_one_unit_per_member(self, clock, audit):
        g = group(clock, audit, **{"fault_tolerance.max_failovers": 3})
        await drive(g, "start", "rendezvous_done", "member_lost")
        assert await g.fire("promote", spend_on=["rollout-0 died", "rollout-1 died"]) == "PROMOTING"
        budget = g.budgets["fault_tolerance.max_failovers"]
        assert budget.spent_on == ["rollout-0 died", "rollout-1 died"]
        assert [r["remaining"] for r in audit.records if r["event"] == "budget_spent"] == [2, 1]
        await drive(g, "promoted", "resume", "member_lost")
        # Two more members at once but one unit left: refused whole, none spent.
        assert await g.fire("promote", spend_on=["trainer-0 died", "rollout-2 died"]) == "FAILED"
        assert isinstance(g.error, FailoverBudgetExhausted) and budget.spent == 2

    async def test_a_round_that_takes_in_another_loss_pays_for_it_in_promoting(self, clock, audit):
        g = group(clock, audit, **{"fault_tolerance.max_failovers": 3})
        await drive(g, "start", "rendezvous_done", "member_lost")
        await g.fire("promote", spend_on=["trainer-1 died"])
        assert await g.spend(["trainer-2 died"]) is True and g.state == "PROMOTING"
        budget = g.budgets["fault_tolerance.max_failovers"]
        assert budget.spent_on == ["trainer-1 died", "trainer-2 died"]
        assert [r["remaining"] for r in audit.records if r["event"] == "budget_spent"] == [2, 1]
        # Two more with one left: refused whole, none spent, the group fails from PROMOTING.
        assert await g.spend(["trainer-0 died", "rollout-0 died"]) is False
        assert g.state == "FAILED" and isinstance(g.error, FailoverBudgetExhausted) and budget.spent == 2
        assert [r["event"] for r in audit.records[-2:]] == ["budget_exhausted", "transition"]

    async def test_spending_outside_a_state_with_a_budget_is_refused(self, clock, audit):
        g = group(clock, audit)
        await drive(g, "start", "rendezvous_done")
        with pytest.raises(InternalError, match="state READY has no budget"):
            await g.spend(["x"])

    async def test_a_zero_budget_fails_on_the_first_loss(self, clock, audit):
        g = group(clock, audit, **{"fault_tolerance.max_failovers": 0})
        await drive(g, "start", "rendezvous_done", "member_lost")
        assert await g.fire("promote") == "FAILED"
        assert isinstance(g.error, FailoverBudgetExhausted)

    async def test_machines_can_share_one_run_wide_budget(self, clock, audit):
        shared = {"fault_tolerance.max_failovers": Budget("fault_tolerance.max_failovers", 1)}
        cfg = config()
        a = StateMachine(get_spec("group"), member="a", config=cfg, clock=clock, audit=audit, budgets=shared)
        b = StateMachine(get_spec("group"), member="b", config=cfg, clock=clock, audit=audit, budgets=shared)
        await drive(a, "start", "rendezvous_done", "member_lost", "promote")
        await drive(b, "start", "rendezvous_done", "member_lost")
        assert await b.fire("promote") == "FAILED"


class TestConcurrentEvents:
    async def test_concurrent_events_are_queued_in_order_and_none_is_dropped(self, clock, audit):
        g = group(clock, audit)
        triggers = ["start", "rendezvous_done", "sync_start", "sync_done", "member_lost", "promote", "promoted", "resume"]
        results = await asyncio.gather(*(g.fire(t) for t in triggers))
        assert results == ["RENDEZVOUS", "READY", "SYNCING", "READY", "DEGRADED", "PROMOTING", "RESYNCED", "READY"]
        assert [t for _, t, _ in transitions_of(audit, "group")] == triggers

    async def test_an_invalid_event_in_a_burst_fails_alone(self, clock, audit):
        g = group(clock, audit)
        results = await asyncio.gather(
            g.fire("start"), g.fire("promote"), g.fire("rendezvous_done"), return_exceptions=True
        )
        assert results[0] == "RENDEZVOUS" and results[2] == "READY"
        assert isinstance(results[1], InvalidTransition)


class TestAudit:
    async def test_every_transition_is_one_record_with_who_and_versions(self, clock, audit):
        w = worker(clock, audit)
        w.bind(pid=1234, node="127.0.0.1")
        w.group_version = 2
        w.now_holds(7)
        clock.advance(1.5)
        await w.fire("join")
        rec = audit.records[-1]
        assert rec["event"] == "transition"
        assert {k: rec[k] for k in ("machine", "member", "role", "rank", "pid", "node", "from", "to", "trigger")} == {
            "machine": "worker", "member": "rollout-1", "role": "rollout", "rank": 1, "pid": 1234,
            "node": "127.0.0.1", "from": "INIT", "to": "RENDEZVOUS", "trigger": "join"}
        assert rec["group_version"] == 2 and rec["weights_version"] == 7
        assert rec["seconds_in_state"] == pytest.approx(1.5)

    async def test_an_event_about_a_version_not_held_yet_names_it_and_leaves_the_held_one(self, clock, audit):
        w = worker(clock, audit)
        w.now_holds(4)
        await w.fire("join", for_version=5)
        assert audit.records[-1]["weights_version"] == 5
        assert w.weights_version == 4
        with pytest.raises(AttributeError):
            w.weights_version = 5  # type: ignore[misc]

    async def test_a_transitions_record_is_written_in_order_and_what_a_worker_said_is_cleaned(self, clock, audit):
        """A transition's record is built from the identity cleaned once at bind (a node address
        comes from the worker's own answer): the same fields, in the same order, as a record
        written field by field, and no terminal escape gets through either way."""
        w = worker(clock, audit)
        w.bind(pid=1234, node="10.0.0.1\x1b[2J\x1b]0;owned\x07", node_id="n1")
        w.group_version = 3
        w.now_holds(9)
        await w.fire("join", reason="first line\nsecond line", checksum="ab\x1b[31mcd")
        rec = audit.records[-1]
        assert list(rec) == ["ts", "t", "event", "machine", "member", "from", "to", "trigger", "role", "rank",
                             "pid", "node", "node_id", "group_version", "weights_version", "seconds_in_state",
                             "checksum", "reason", "detail"]
        assert rec["node"] == "10.0.0.1" and rec["checksum"] == "abcd"
        assert rec["reason"] == "first line" and rec["detail"] == "second line"
        # the generic path writes the same record
        audit.record("transition", machine="worker", member="rollout-1", **{"from": "INIT", "to": "RENDEZVOUS"},
                     trigger="join", role="rollout", rank=1, pid=1234, node="10.0.0.1\x1b[2J\x1b]0;owned\x07",
                     node_id="n1", group_version=3, weights_version=9, seconds_in_state=rec["seconds_in_state"],
                     checksum="ab\x1b[31mcd", reason="first line\nsecond line")
        generic = audit.records[-1]
        assert list(generic) == list(rec)
        assert {k: v for k, v in generic.items() if k not in ("ts", "t")} == \
            {k: v for k, v in rec.items() if k not in ("ts", "t")}

    async def test_an_error_transitions_record_names_the_error(self, clock, audit):
        w = worker(clock, audit)
        await w.fire("join", error=RendezvousTimeout("the join", key="init_timeout_s", seconds=1.0))
        rec = audit.records[-1]
        assert rec["error"] == "RendezvousTimeout" and "the join" in rec["message"]
        assert w.error is not None

    async def test_records_reach_the_file_as_json_lines(self, clock, tmp_path):
        from ftstate.core.audit import read_trail

        path = tmp_path / "trail.jsonl"
        with AuditTrail(path) as trail:
            g = StateMachine(get_spec("group"), member="group", config=config(), clock=clock, audit=trail)
            await drive(g, "start", "rendezvous_done")
        records = [rec for _, rec in read_trail(path)]
        assert [(r["from"], r["to"]) for r in records] == [("INIT", "RENDEZVOUS"), ("RENDEZVOUS", "READY")]
        assert all("ts" in r and "t" in r for r in records)

    def test_a_bounded_trail_keeps_the_latest_records_in_memory_and_every_one_in_its_file(self, tmp_path):
        from ftstate.core.audit import read_trail

        path = tmp_path / "trail.jsonl"
        with AuditTrail(path, keep=5) as trail:
            lengths = []
            for i in range(23):
                trail.record("note", n=i)
                lengths.append(len(trail.records))
            assert max(lengths) < 10 and trail.records[-1]["n"] == 22  # never past 2x, the latest last
            assert [r["n"] for r in trail.records] == list(range(23 - len(trail.records), 23))
            assert len(trail.records) >= 5
        assert [rec["n"] for _, rec in read_trail(path)] == list(range(23))  # the file has them all
        unbounded = AuditTrail(keep=True)
        for i in range(23):
            unbounded.record("note", n=i)
        assert len(unbounded.records) == 23 and AuditTrail(keep=0).records == []

    def test_the_runtime_bounds_its_records_by_its_setting(self):
        from ftstate import RolloutWorker, RuntimeConfig, TrainerWorker
        from ftstate.controller.runtime import Runtime

        cfg = RuntimeConfig.from_dict({"audit_records_kept": 4}, environ={})
        trail = Runtime(cfg, trainer=TrainerWorker, rollout=RolloutWorker).audit  # built, never started
        for i in range(20):
            trail.record("note", n=i)
        assert 4 <= len(trail.records) < 8 and trail.records[-1]["n"] == 19


class TestScale:
    def test_adding_machines_is_not_quadratic(self, clock):
        spec = get_spec("worker")
        cfg = config()
        trail = AuditTrail(keep=False)

        def build(n):
            t0 = time.perf_counter()
            ms = [StateMachine(spec, member=f"w{i}", config=cfg, clock=clock, audit=trail) for i in range(n)]
            elapsed = time.perf_counter() - t0
            for m in ms:
                m.close()
            return elapsed

        build(200)  # warm up
        # The best of three, the collector off: a build now takes milliseconds, and one full
        # collection of the test process (or a neighbour's burst on a shared machine) would
        # otherwise be most of what is measured.
        gc.disable()
        try:
            small = min(build(1000) for _ in range(3))
            large = min(build(8000) for _ in range(3))
        finally:
            gc.enable()
        # Linear would be 8x; a list scan per add makes it ~64x. Allow generous noise.
        assert large / small < 20, (small, large)

    def test_the_transitions_machine_is_built_once_per_spec(self):
        assert compile_spec(get_spec("worker")) is compile_spec(get_spec("worker"))
