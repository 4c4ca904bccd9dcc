"""Group formation is all or nothing, and the trainer always sorts first (issue 22).

The real controller's GroupFormation and StoreServer (a TCPStore on 127.0.0.1) with pure
machines; only the members' ``join`` calls are stood in for (no Ray here): they record the
rank and world size each member was asked to join with, or fail like an unreachable actor.
"""

from __future__ import annotations

import asyncio

import pytest

from ftstate.controller.formation import GroupFormation
from ftstate.controller.membership import GROUP, Member, Membership
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.deadline import ManualClock
from ftstate.core.errors import MemberLost
from ftstate.core.liveness import Liveness
from ftstate.core.machine import StateMachine
from ftstate.core.protocol import Join, Joined
from ftstate.core.spec import get_spec


class Joins:
    """Stands in for ActorCalls: ``join`` records (member, rank, world size); a member in
    ``unreachable`` fails as Ray's ActorUnavailableError is reported, after ``delay_s``."""

    def __init__(self, unreachable: set[str] = frozenset(), delay_s: float = 0.0) -> None:
        self.unreachable = set(unreachable)
        self.delay_s = delay_s
        self.joined: list[tuple[str, int, int, int]] = []

    async def call(self, member, handle, req, timeout=None):
        assert isinstance(req, Join)
        group, version, rank, world = req.group, req.version, req.rank, req.world_size
        assert group == GROUP
        await asyncio.sleep(self.delay_s)
        if member in self.unreachable:
            raise MemberLost(member, "unreachable during join(): the actor is temporarily unavailable")
        self.joined.append((member, version, rank, world))
        return Joined(group_version=version, rank=rank)

    async def fan_out(self, targets, requests, on_end=None):
        """ActorCalls.fan_out's contract: every call at once, each outcome (result or error) in
        order, ``on_end(i, outcome)`` as each ends."""
        out = [None] * len(targets)

        async def one(i):
            try:
                outcome = await self.call(targets[i].name, targets[i].handle, requests[i])
            except Exception as exc:  # noqa: BLE001 - the member's own outcome, handed back
                outcome = exc
            out[i] = outcome
            if on_end is not None:
                on_end(i, outcome)

        await asyncio.gather(*(one(i) for i in range(len(targets))))
        return out


def build(names_roles: list[tuple[str, str, int]], calls: Joins, **cfg):
    config = RuntimeConfig.from_dict(cfg, environ={})
    audit = AuditTrail()
    group = StateMachine(get_spec("group"), member="group", config=config, clock=ManualClock(), audit=audit)
    ms = Membership(group)
    for name, role, rank in names_roles:
        machine = StateMachine(get_spec("worker"), member=name, role=role, rank=rank, config=config,
                               clock=ManualClock(), audit=audit)
        ms.add(Member(name, role, rank, machine, handle=None, liveness=Liveness(1.0, 10.0)))
    formation = GroupFormation(config=config, audit=audit, membership=ms, calls=calls, host="127.0.0.1")
    return formation, ms, audit


async def test_the_trainer_sorts_first_even_behind_a_rollout_numbered_0():
    # An interim version formed while the trainer was gone numbered the rollouts from 0; its
    # replacement takes the lost trainer's rank 0.
    calls = Joins()
    formation, ms, _ = build([("rollout-0", "rollout", 0), ("rollout-1", "rollout", 1),
                              ("spare-trainer-1", "trainer", 0)], calls)
    try:
        await formation.reform()
        ranks = {name: rank for name, _v, rank, _w in calls.joined}
        assert ranks == {"spare-trainer-1": 0, "rollout-0": 1, "rollout-1": 2}
        assert {m.name: m.rank for m in ms} == ranks
        assert formation.usable and formation.formed == ms.group.group_version == 1
    finally:
        formation.close()


async def test_a_failed_join_fences_the_version_names_who_and_leaves_it_unusable():
    calls = Joins(unreachable={"rollout-1"}, delay_s=0.01)
    formation, ms, audit = build([("trainer-0", "trainer", 0), ("rollout-0", "rollout", 1),
                                  ("rollout-1", "rollout", 2)], calls)
    try:
        with pytest.raises(MemberLost, match="rollout-1") as info:
            await formation.reform()
        assert info.value.member == "rollout-1"
        assert ms.group.group_version == 1 and formation.formed == 0 and not formation.usable
        # Superseded: whoever still waits in version 1 is released (StaleGroupVersion).
        assert formation.store.current_version(GROUP) == 2
        failed = [r for r in audit.records if r["event"] == "group_form_failed"]
        assert len(failed) == 1 and list(failed[0]["failed"]) == ["rollout-1"]
        assert not any(r["event"] == "group_formed" for r in audit.records)
        # Once it answers again, the next sync's ensure_formed forms the next version.
        calls.unreachable.clear()
        await formation.ensure_formed()
        assert formation.usable and formation.formed == ms.group.group_version == 2
        assert any(r["event"] == "group_reform" for r in audit.records)
    finally:
        formation.close()


async def test_a_spoiled_version_is_replaced_before_the_next_transfer_and_a_usable_one_kept():
    calls = Joins()
    formation, ms, audit = build([("trainer-0", "trainer", 0), ("rollout-0", "rollout", 1)], calls)
    try:
        await formation.reform()
        await formation.ensure_formed()
        assert ms.group.group_version == 1, "a usable version is not formed again"
        formation.spoil("transfer of weights version 2 abandoned: rollout-0: PeerLost")
        assert not formation.usable
        await formation.ensure_formed()
        assert formation.usable and ms.group.group_version == 2
        reform = next(r for r in audit.records if r["event"] == "group_reform")
        assert "abandoned" in reform["reason"]
    finally:
        formation.close()


async def test_with_several_trainer_ranks_no_version_forms_without_every_rank():
    calls = Joins()
    formation, ms, _ = build([("trainer-1", "trainer", 1), ("rollout-0", "rollout", 2)], calls,
                             trainer_workers=2, fault_tolerance={"enable": True, "reverse_weight_sync": True})
    try:
        with pytest.raises(MemberLost, match=r"trainer ranks \[0\]"):
            await formation.reform()
        assert calls.joined == [] and ms.group.group_version == 0
    finally:
        formation.close()
