"""The membership, held by the controller: who is in the run, at which rank, in which state, holding which
versions; one per runtime, passed to every part that needs it. Its ``epoch`` is bumped on every loss or change
of shape, so "did membership change while I tried" is one integer compare. No I/O: the launcher starts actors,
the formation forms versions."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Iterator
from typing import Any

from ftstate.core.errors import InvalidTransition, MemberLost, UsageError
from ftstate.core.liveness import Liveness
from ftstate.core.machine import StateMachine
from ftstate.core.protocol import Located

#: The weight-sync group's name (its store keys live under ``weights/v{N}``).
GROUP = "weights"
#: Worker states that hold no place in the group: nothing is sent to them or asked of them.
GONE = frozenset({"LOST", "RETIRED", "FAILED", "STOPPED"})
#: States whose entry or exit changes whom the watchdog polls or asks to prove: they move the roster.
_ROSTER_STATES = GONE | {"INIT", "SUSPECT"}
#: The sort key of the lists by rank (read in C: a sort of 10,000 members was 10,000 lambda calls).
_BY_RANK = operator.attrgetter("rank")


async def walk_proven(machine: StateMachine, target: str, **fields: Any) -> None:
    """Take a member whose load of the current version was proven to ``target`` (RESYNCED or READY) by its
    machine's own edges, from wherever the watchdog moved it meanwhile (SUSPECT, STALE), so the failover goes
    the legal way round. ``fields`` go on every edge's record. Raises MemberLost when it was lost or stopped
    meanwhile."""
    order = ("RESYNCED", "READY")
    step = {"STALE": "resync", "RESYNCING": "verified", "SUSPECT": "verified", "RESYNCED": "admit"}
    for _ in range(8):  # each pass moves one edge forward unless the watchdog moved it too
        state = machine.state
        if state in order and order.index(state) >= order.index(target):
            return
        trigger = step.get(state)
        if trigger is None:
            raise MemberLost(machine.member, f"{state} while being resynced", group_version=machine.group_version)
        with contextlib.suppress(InvalidTransition):  # moved between the look and the fire: look again
            await machine.fire(trigger, reason="current version loaded and verified", **fields)
    raise MemberLost(machine.member, f"could not be admitted: still {machine.state}", group_version=machine.group_version)


@dataclasses.dataclass(eq=False, slots=True)
class Member:
    """One worker actor: ``rank`` in the current group version (-1 for a spare), ``pool``/``slot``,
    ``pid``/``node``/``node_id`` once known; ``reserved_bytes``: a spare's ready staging;
    ``pending_version``/``pending_since``: a committed version held back for a safe point."""

    name: str
    role: str
    rank: int
    machine: StateMachine
    handle: Any
    liveness: Liveness
    pool: str = ""
    slot: int = 0
    pid: int | None = None
    node: str | None = None
    node_id: str | None = None
    reserved_bytes: int = 0
    holds_weights: bool = False
    pending_version: int | None = None
    pending_since: float = 0.0

    @property
    def gone(self) -> bool:
        return self.machine.state in GONE

    def set_rank(self, rank: int) -> None:
        self.rank = rank
        if self.machine.identity.get("rank") != rank:  # every member of a new group version keeps its rank
            self.machine.bind(rank=rank)

    def located(self, info: Located) -> None:
        """Record where its process runs; every later record of its machine carries it."""
        self.pid, self.node, self.node_id = info.pid, info.node, info.node_id
        self.holds_weights = info.holds_weights
        self.machine.bind(pid=self.pid, node=self.node, node_id=self.node_id)


@dataclasses.dataclass(frozen=True)
class TrainerCall:
    """A user call on the trainer since the last committed sync (replayed on a replacement)."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CommittedParts:
    """Several trainer ranks: who owned what in the current version and each rank's part's checksum as sent
    (None: owned nothing), so a replaced rank's part is proven."""

    ownership: dict[str, Any]
    checksums: dict[int, str | None]


class Membership:
    """The run's members and versions. group: the group machine."""

    def __init__(self, group: StateMachine) -> None:
        self.group = group
        self._members: dict[str, Member] = {}
        #: Checksum of the current weights version (None before the first sync).
        self.checksum: str | None = None
        #: Every committed version's checksum → that version (a trainer's checkpoint is matched to it).
        self.versions_by_checksum: dict[str, int] = {}
        #: Trainer calls since the last committed sync, in order.
        self.trainer_calls: list[TrainerCall] = []
        #: Several trainer ranks: the current version's ownership and parts (None before the first sync).
        self.parts: CommittedParts | None = None
        #: Bumped on every loss and every change of the group's shape.
        self.epoch = 0
        #: Bumped whenever whom the watchdog polls, where, or whom it asks to prove may have changed;
        #: while it holds, the watchdog's per-node lists hold without a walk of the members.
        self.roster = 0

    # -- changing ----------------------------------------------------------------------

    def add(self, member: Member) -> None:
        self._members[member.name] = member
        member.machine.listen(self._on_transition)
        self.roster += 1

    def located(self, member: Member, info: Located) -> None:
        """``member`` said where its process runs (:meth:`Member.located`)."""
        member.located(info)
        self.roster += 1

    def _on_transition(self, machine: StateMachine, src: str, dest: str, trigger: str) -> None:
        if src in _ROSTER_STATES or dest in _ROSTER_STATES:
            self.roster += 1

    def changed(self) -> None:
        self.epoch += 1

    def current(self, weights_version: int, checksum: str | None) -> None:
        """Make ``weights_version`` with ``checksum`` current; the two change together, since a suspect's
        heartbeat is judged against the pair."""
        self.group.now_holds(weights_version)
        self.checksum = checksum

    def committed(self, weights_version: int, checksum: str) -> None:
        """A sync committed ``weights_version``: it is current and the trainer has nothing left to replay."""
        self.current(weights_version, checksum)
        self.versions_by_checksum[checksum] = weights_version
        self.trainer_calls.clear()

    # -- reading -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Member]:
        return iter(list(self._members.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def get(self, name: str) -> Member:
        try:
            return self._members[name]
        except KeyError:
            raise UsageError(f"no member named {name!r}; members: {', '.join(self._members) or 'none'}") from None

    def find(self, name: str) -> Member | None:
        return self._members.get(name)

    @property
    def weights_version(self) -> int:
        return self.group.weights_version

    @property
    def group_version(self) -> int:
        return self.group.group_version

    def role(self, role: str) -> list[Member]:
        """Group members of a role (spares excluded, the gone included), by rank."""
        return sorted([m for m in self._members.values() if m.role == role and m.rank >= 0], key=_BY_RANK)

    def live(self, role: str) -> list[Member]:
        # filtered before the (stable) sort, not after: the same list, fewer to sort
        return sorted([m for m in self._members.values() if m.role == role and m.rank >= 0
                       and m.machine.state not in GONE], key=_BY_RANK)

    def any_in(self, state: str) -> bool:
        """Whether any member (spares and the gone included) is in ``state``: one walk, no list."""
        return any(m.machine.state == state for m in self._members.values())

    def group_members(self) -> list[Member]:
        """The members of the weight-sync group (not spares, not the gone), by rank."""
        return sorted([m for m in self._members.values() if m.rank >= 0 and not m.gone
                       and m.machine.state != "STANDBY"], key=_BY_RANK)

    def spares(self, role: str, *states: str) -> list[Member]:
        """Spares of ``role`` (rank -1) in any of ``states``, by name."""
        return sorted((m for m in self._members.values()
                       if m.role == role and m.rank < 0 and m.machine.state in states), key=lambda m: m.name)

    def trainer(self) -> Member:
        """The live trainer; MemberLost when there is none."""
        live = self.live("trainer")
        if not live:
            raise MemberLost("trainer-0", "no live trainer", group_version=self.group_version)
        return live[0]

    def trainer_ranks(self, expected: int, why: str) -> list[Member]:
        """The live trainer ranks when all ``expected`` are there; else MemberLost naming the missing."""
        live = self.live("trainer")
        if len(live) >= expected:
            return live
        have = {m.rank for m in live}
        missing = [r for r in range(expected) if r not in have]
        last = {m.rank: m.name for m in self.role("trainer") if m.gone}
        raise MemberLost(", ".join(last.get(r, f"trainer rank {r}") for r in missing),
                         f"trainer ranks {missing} are gone and not replaced yet: {why}",
                         group_version=self.group_version)

    def serving_rollouts(self, max_lag: int = 0) -> list[str]:
        """Rollouts serving the current version, by rank; ``max_lag`` (in-flight updates) admits those at most
        that many versions behind."""
        version = self.weights_version
        return [m.name for m in self.role("rollout") if m.machine.serving
                and version - max_lag <= m.machine.weights_version <= version]

    def holders(self, exclude: Member | None = None) -> list[Member]:
        """Serving rollouts holding the current version, loaded or awaiting a safe point: resync sources."""
        version = self.weights_version
        return [m for m in self.role("rollout") if m is not exclude and m.machine.serving
                and version in (m.machine.weights_version, m.pending_version)]

    def pending_swaps(self) -> list[Member]:
        """Rollouts holding a committed version back for a safe point (``rollout_updates: in_flight``)."""
        # a walk, once every heartbeat round: the few found are sorted, not the 10,000 walked
        return sorted([m for m in self._members.values() if m.pending_version is not None and m.role == "rollout"
                       and m.rank >= 0 and not m.gone], key=_BY_RANK)

    def on_node(self, node_id: str) -> list[Member]:
        """Every member not gone whose process runs on node ``node_id`` (spares included)."""
        return [m for m in self._members.values() if m.node_id == node_id and not m.gone]

    def states_text(self) -> str:
        return ", ".join(f"{m.name}={m.machine.state}@v{m.machine.weights_version}" for m in self.role("rollout"))
