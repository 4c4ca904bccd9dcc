"""The chaos runner's schedules (tests/chaos/schedule.py): a seed replays bit for bit, a
schedule survives its JSON, bad JSON is refused by field, and shrinking finds the smallest
failing schedule. Pure: no Ray."""

from __future__ import annotations

import json

import pytest

from tests.chaos.schedule import KINDS, WHEN_FOR, Fault, Schedule, draw, shrink


def test_a_seed_draws_the_same_schedule_every_time_and_seeds_differ() -> None:
    assert draw(7, 8).to_json() == draw(7, 8).to_json()
    drawn = {draw(seed, 8).to_json() for seed in range(20)}
    assert len(drawn) == 20


def test_drawn_faults_cover_the_menu_and_respect_when_each_may_land() -> None:
    faults = [f for seed in range(200) for f in draw(seed, 6).faults]
    assert {f.kind for f in faults} == set(KINDS)
    assert {f.when for f in faults} == {"before", "mid-step", "mid-sync", "mid-failover"}
    assert any(f.together for f in faults)
    for f in faults:
        assert f.when in WHEN_FOR[f.kind], f
    for seed in range(50):
        s = draw(seed, 6)
        assert s.steps == 7 and all(f.step < s.steps - 1 for f in s.faults)  # the last step runs clean
        assert [f.step for f in s.faults] == sorted(f.step for f in s.faults)
        for prev, f in zip(s.faults, s.faults[1:], strict=False):
            if f.together:
                assert (f.step, f.when) == (prev.step, prev.when)


def test_a_schedule_survives_its_json() -> None:
    s = draw(3, 5)
    again = Schedule.from_json(s.to_json())
    assert again == s


@pytest.mark.parametrize(("text", "expected"), [
    ("[]", "JSON object"),
    ('{"steps": 0, "faults": []}', "'steps'"),
    ('{"steps": 2, "faults": [{"step": 5, "kind": "kill", "target": "rollout", "pick": 0}]}', "below 'steps'"),
    ('{"steps": 2, "faults": [{"step": 0, "kind": "explode", "target": "rollout", "pick": 0}]}', "kind 'explode'"),
    ('{"steps": 2, "faults": [{"step": 0, "kind": "kill", "target": "gpu", "pick": 0}]}', "target 'gpu'"),
    ('{"steps": 2, "faults": [{"step": 0, "kind": "kill", "target": "rollout", "pick": -1}]}', "pick"),
])
def test_bad_schedules_are_refused_naming_the_field(text: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        Schedule.from_json(text)


def test_shrinking_drops_every_fault_the_failure_does_not_need() -> None:
    s = Schedule(1, 6, (
        Fault(0, "kill", "rollout", 1), Fault(1, "stop", "rollout", 2), Fault(1, "corrupt", "rollout", 0),
        Fault(2, "node", "node", 3, "mid-sync"), Fault(3, "slow", "trainer", 0), Fault(4, "kill", "spare", 5),
    ))
    runs: list[Schedule] = []

    def fails(c: Schedule) -> bool:  # the failure needs a stop and, after it, a node loss
        runs.append(c)
        kinds = [f.kind for f in c.faults]
        return "stop" in kinds and "node" in kinds and kinds.index("stop") < kinds.index("node")

    smallest = shrink(s, fails)
    assert [f.kind for f in smallest.faults] == ["stop", "node"]
    assert smallest.seed is None and smallest.steps == 6
    assert fails(smallest)
    # one run per candidate: each fault tried once, and the survivors once more at the end
    assert len(runs) <= len(s.faults) + 2


def test_dropping_a_fault_sets_its_partner_free() -> None:
    s = Schedule(1, 3, (Fault(0, "kill", "rollout", 0, "mid-sync"), Fault(0, "node", "node", 0, "mid-sync", True)))
    rest = s.without(0)
    assert rest.faults == (Fault(0, "node", "node", 0, "mid-sync", False),)
    assert json.loads(rest.to_json())["seed"] is None
