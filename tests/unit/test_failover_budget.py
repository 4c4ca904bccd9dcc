"""The failover budget with a time dimension and a place (issue 43): a rate over a sliding
window, a limit per member slot (a crash loop), a quarantine per node, a node lost whole as one
unit, and the total of ``max_failovers`` for those who set it. Pure: an injected clock."""

from __future__ import annotations

import pytest

from ftstate.core.budget import FAILOVER_KEY, Budget, Charge, budget_for
from ftstate.core.config import RuntimeConfig
from ftstate.core.deadline import ManualClock
from ftstate.core.errors import CrashLoop, FailoverBudgetExhausted
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec


def windowed(**kw) -> Budget:
    args = {"key": FAILOVER_KEY, "limit": None, "window_s": 100.0, "per_window": 4, "per_slot": 2, "per_node": 3}
    return Budget(**{**args, **kw})


def slot(name: str, n: int = 0) -> Charge:
    return Charge(reason=f"{name} died #{n}", slot=name, cls="BadRollout")


class TestTheRateIsOverASlidingWindow:
    def test_failures_spread_over_time_never_exhaust_it(self):
        b = windowed()
        for i in range(1000):  # one failure every 30 s for over 8 hours: 4 in any 100 s at most
            now = 30.0 * i
            assert b.refusal([Charge(f"f{i}", slot=f"rollout-{i}")], now) is None
            b.spend(Charge(f"f{i}", slot=f"rollout-{i}"), now)
        assert b.spent == 1000 and b.in_window(30.0 * 999) <= 4

    def test_a_storm_faster_than_the_window_is_refused_naming_the_rate(self):
        b = windowed()
        for i in range(4):
            b.spend(Charge(f"f{i}", slot=f"rollout-{i}"), float(i))
        refused = b.refusal([Charge("f4", slot="rollout-4")], 4.0)
        assert refused is not None and refused.kind == "rate"
        assert refused.key == "fault_tolerance.max_failovers_per_window" and refused.limit == 4
        assert refused.spent_on == ("f0", "f1", "f2", "f3")
        # once the first ones leave the window, there is room again
        assert b.refusal([Charge("f4", slot="rollout-4")], 100.5) is None


class TestASlotReplacedTooOftenIsACrashLoop:
    def test_the_slot_limit_is_checked_before_the_rate(self):
        b = windowed(per_window=100)
        b.spend(slot("rollout-2", 0), 0.0)
        b.spend(slot("rollout-2", 1), 1.0)
        refused = b.refusal([slot("rollout-2", 2)], 2.0)
        assert refused is not None and refused.kind == "slot" and refused.subject == "rollout-2"
        assert refused.cls == "BadRollout" and len(refused.spent_on) == 3

    def test_other_slots_are_not_held_back(self):
        b = windowed(per_window=100)
        b.spend(slot("rollout-2", 0), 0.0)
        b.spend(slot("rollout-2", 1), 1.0)
        assert b.refusal([slot("rollout-3")], 2.0) is None

    def test_a_slot_replaced_rarely_is_fine(self):
        b = windowed()
        for i in range(10):
            assert b.refusal([slot("rollout-2", i)], 60.0 * i) is None
            b.spend(slot("rollout-2", i), 60.0 * i)


class TestANodeThatKeepsLosingMembersIsQuarantined:
    def test_at_the_third_strike_inside_the_window(self):
        b = windowed()
        assert not b.strike("n1", 0.0, "a") and not b.strike("n1", 10.0, "b")
        assert b.strike("n1", 20.0, "c")
        assert "n1" in b.quarantined and not b.strike("n1", 21.0, "d")  # once

    def test_strikes_far_apart_are_attrition_not_a_bad_node(self):
        b = windowed()
        for i in range(10):
            assert not b.strike("n1", 60.0 * i, "x")
        assert not b.quarantined

    def test_strikes_on_different_nodes_quarantine_none(self):
        b = windowed()
        assert not any(b.strike(f"n{i}", float(i), "x") for i in range(10))


class TestTheTotalKeepsItsMeaning:
    def test_max_failovers_set_is_a_total_over_the_run(self):
        b = windowed(limit=3, window_s=1.0)
        for i in range(3):
            b.spend(Charge(f"f{i}"), 100.0 * i)
        refused = b.refusal([Charge("f3")], 1000.0)
        assert refused is not None and refused.kind == "total" and refused.key == FAILOVER_KEY

    def test_the_config_builds_the_windowed_budget_with_no_total_by_default(self):
        b = budget_for(FAILOVER_KEY, RuntimeConfig())
        ft = RuntimeConfig().fault_tolerance
        assert b.limit is None and b.window_s == ft.failover_window_s
        assert (b.per_window, b.per_slot, b.per_node) == (ft.max_failovers_per_window, ft.max_slot_failovers,
                                                          ft.max_node_failures)


def group(**ft) -> tuple[StateMachine, ManualClock]:
    clock = ManualClock()
    cfg = RuntimeConfig.from_dict({"fault_tolerance": {"enable": True, **ft}}, environ={})
    m = StateMachine(get_spec("group"), member="group", config=cfg, clock=clock)
    return m, clock


async def through_a_failover(m: StateMachine, charges: list[Charge]) -> str:
    for trigger in ("start", "rendezvoused"):
        if m.can(trigger):
            await m.fire(trigger)
    await m.fire("member_lost", reason="x")
    state = await m.fire("promote", reason="x", spend_on=charges)
    if state == "PROMOTING":
        await m.fire("promoted")
        await m.fire("resume")
    return state


class TestTheGroupMachineSpendsIt:
    async def test_a_crash_loop_fails_the_group_with_crashloop_naming_slot_and_class(self):
        m, clock = group(max_slot_failovers=2)
        for i in range(2):
            clock.advance(1.0)
            assert await through_a_failover(m, [slot("rollout-1", i)]) == "PROMOTING"
        clock.advance(1.0)
        assert await through_a_failover(m, [slot("rollout-1", 2)]) == "FAILED"
        assert isinstance(m.error, CrashLoop) and isinstance(m.error, FailoverBudgetExhausted)
        assert m.error.slot == "rollout-1" and m.error.cls == "BadRollout"
        with pytest.raises(CrashLoop, match=r"slot rollout-1 \(class BadRollout\) lost 3 times"):
            raise m.error
        assert m.budget(FAILOVER_KEY).spent == 2  # nothing of the window spent on the refused loss

    async def test_a_node_lost_whole_is_one_unit(self):
        m, _ = group(max_failovers=1)
        assert await through_a_failover(m, [Charge("node n1 lost: rollout-1, rollout-2, ...", node="n1")]) \
            == "PROMOTING"
        assert m.budget(FAILOVER_KEY).spent == 1


class TestMessagesStayReadable:
    def test_a_long_list_shows_the_first_few_and_how_many_more(self):
        spent = [f"rollout-{i}: process died during load_weights()" for i in range(300)]
        exc = FailoverBudgetExhausted(limit=300, spent_on=spent, member="group")
        assert len(str(exc)) < 600 and "and 295 more" in str(exc)
        assert exc.spent_on == tuple(spent)  # all of them, in the attributes

    def test_the_total_keeps_its_message(self):
        exc = FailoverBudgetExhausted(limit=1, spent_on=["rollout-0: died"], member="group")
        assert "max_failovers=1 already spent on: rollout-0: died" in str(exc)


class TestTheLastNodeIsNeverQuarantined:
    def test_strikes_count_but_without_another_node_nothing_is_quarantined(self):
        b = windowed()
        assert not any(b.strike("only", float(i), "x", elsewhere=False) for i in range(5))
        assert not b.quarantined


class TestTimeTheClockDidNotSee:
    def test_skipped_time_ages_units_and_strikes_out_of_the_window(self):
        b = windowed()
        for i in range(4):
            b.spend(Charge(f"f{i}", slot=f"rollout-{i}"), float(i))
        b.strike("n1", 3.0)
        b.strike("n1", 3.0)
        assert b.refusal([Charge("f4")], 5.0) is not None
        b.skip(100.0)  # a simulation jumped over the quiet hours between failures
        assert b.refusal([Charge("f4")], 5.0) is None and b.in_window(5.0) == 0
        assert not b.strike("n1", 5.0)  # the old strikes left the window with it
