"""The watchdog's per-node lists (``NodeRounds``): kept from round to round only while the
members to poll are the same, so keeping them never changes who is polled."""

from __future__ import annotations

from dataclasses import dataclass, field

from ftstate.controller.watchdog import NodeRounds


@dataclass
class _Machine:
    state: str = "READY"


@dataclass(eq=False)
class _Member:
    name: str
    node_id: str | None
    machine: _Machine = field(default_factory=_Machine)
    handle: object = field(default_factory=object)

    @property
    def gone(self) -> bool:
        return self.machine.state in ("LOST", "RETIRED")


def polled(rounds) -> dict[str | None, list[str]]:
    return {r.node_id: r.names for r in rounds}


def everyone(rounds) -> set[str]:
    return {name for r in rounds for name in r.names}


def test_the_same_members_get_the_same_lists_and_any_change_is_in_the_next_round():
    ms = [_Member(f"rollout-{i}", f"n{i % 2}") for i in range(6)]
    rounds = NodeRounds()
    first = rounds.of(ms)
    assert polled(first) == {"n0": ["rollout-0", "rollout-2", "rollout-4"], "n1": ["rollout-1", "rollout-3", "rollout-5"]}
    assert [r.handles for r in first] == [[m.handle for m in ms[0::2]], [m.handle for m in ms[1::2]]]
    again = rounds.of(ms)
    assert again is first and all(a is b for a, b in zip(again, first, strict=True))  # nothing rebuilt

    ms[3].machine.state = "LOST"  # gone: not polled from this round on
    assert polled(rounds.of(ms))["n1"] == ["rollout-1", "rollout-5"]

    newcomer = _Member("rollout-6", None, _Machine("INIT"))
    ms.append(newcomer)
    assert "rollout-6" not in everyone(rounds.of(ms))  # still constructing
    newcomer.machine.state = "STANDBY"
    newcomer.node_id = "n2"  # located when it came up
    assert polled(rounds.of(ms))["n2"] == ["rollout-6"]

    ms[0].node_id = "n2"  # a member reported on another node is polled there
    got = polled(rounds.of(ms))
    assert got["n2"] == ["rollout-0", "rollout-6"] and got["n0"] == ["rollout-2", "rollout-4"]

    ms.pop()  # a member taken out of the membership
    assert "rollout-6" not in everyone(rounds.of(ms))


def test_a_round_hands_out_the_plain_arguments_for_every_member():
    ms = [_Member(f"rollout-{i}", "n0") for i in range(4)]
    [node] = NodeRounds().of(ms)
    assert node.ask == [(False, True)] * 4 and node.members == ms
