"""Budgets: what a run may spend on failures and what it was spent on, spent by the state machines. A state
with a budget spends a unit on entry; a unit that would break a limit (total, rate in ``failover_window_s``,
per slot, or a node quarantine) takes ``on_exhausted`` instead (docs/concepts.md, "Budgets"). Pure: the caller
passes ``now``."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

#: The failover budget's config key (the one whose window and places apply).
FAILOVER_KEY = "fault_tolerance.max_failovers"


@dataclasses.dataclass(frozen=True)
class Charge:
    """One unit of a budget: ``reason``; ``slot`` (``rollout-3``) and its ``cls``; or ``node``, lost whole
    (then ``slot`` is None)."""

    reason: str
    slot: str | None = None
    cls: str | None = None
    node: str | None = None


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why units were refused: ``kind`` (``total``, ``rate`` or ``slot``), its config ``key`` and ``limit``,
    the ``subject`` slot and ``cls``, and the reasons counted against it."""

    kind: str
    key: str
    limit: int
    window_s: float | None
    spent_on: tuple[str, ...]
    subject: str | None = None
    cls: str | None = None


@dataclasses.dataclass
class Budget:
    """``key``: its config key; ``limit``: units for the whole run (None: no total); ``window_s``,
    ``per_window``, ``per_slot``, ``per_node``: the sliding window and its limits (None: off)."""

    key: str
    limit: int | None
    window_s: float | None = None
    per_window: int | None = None
    per_slot: int | None = None
    per_node: int | None = None
    spent_on: list[str] = dataclasses.field(default_factory=list)
    #: (time, charge) of each unit still inside the window, oldest first.
    recent: collections.deque[tuple[float, Charge]] = dataclasses.field(default_factory=collections.deque)
    #: node -> times a member was lost there, inside the window.
    strikes: dict[str, collections.deque[float]] = dataclasses.field(default_factory=dict)
    #: node -> (time, why) it was quarantined; a quarantine is for the rest of the run.
    quarantined: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)

    @property
    def spent(self) -> int:
        return len(self.spent_on)

    @property
    def remaining(self) -> int | None:
        """Units left of the total (None: no total)."""
        return None if self.limit is None else max(0, self.limit - self.spent)

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.spent >= self.limit

    def _prune(self, now: float) -> None:
        if self.window_s is None:
            return
        start = now - self.window_s
        while self.recent and self.recent[0][0] <= start:
            self.recent.popleft()
        for node in [n for n, times in self.strikes.items() if _prune_times(times, start)]:
            del self.strikes[node]

    def refusal(self, units: list[str | Charge] | tuple[str | Charge, ...], now: float = 0.0) -> Refusal | None:
        """Why spending ``units`` at ``now`` would break a limit (the slot's first), or None."""
        self._prune(now)
        charges = [_charge(u) for u in units]
        if self.per_slot is not None:
            for c in charges:
                if c.slot is None:
                    continue
                before = [ch.reason for _, ch in self.recent if ch.slot == c.slot]
                same = sum(1 for x in charges if x.slot == c.slot)
                if len(before) + same > self.per_slot:
                    return Refusal("slot", _sibling(self.key, "max_slot_failovers"), self.per_slot, self.window_s,
                                   (*before, c.reason), subject=c.slot, cls=c.cls)
        if self.per_window is not None and len(self.recent) + len(charges) > self.per_window:
            return Refusal("rate", _sibling(self.key, "max_failovers_per_window"), self.per_window, self.window_s,
                           tuple(ch.reason for _, ch in self.recent))
        if self.limit is not None and self.spent + max(1, len(charges)) > self.limit:
            return Refusal("total", self.key, self.limit, None, tuple(self.spent_on))
        return None

    def spend(self, unit: str | Charge, now: float = 0.0) -> int | None:
        """Spend one unit on ``unit``; returns what remains of the total. Callers check
        :meth:`refusal` first."""
        if self.exhausted:
            raise RuntimeError(f"budget {self.key} spent beyond its limit {self.limit}")  # a machine bug
        charge = _charge(unit)
        self.spent_on.append(charge.reason)
        if self.window_s is not None:
            self._prune(now)
            self.recent.append((now, charge))
        return self.remaining

    def strike(self, node: str, now: float = 0.0, why: str = "", *, elsewhere: bool = True) -> bool:
        """A member on ``node`` was lost at ``now``; True when this quarantines the node. ``elsewhere``:
        whether another node could take its members (else no quarantine)."""
        if self.per_node is None or node in self.quarantined:
            return False
        self._prune(now)
        times = self.strikes.setdefault(node, collections.deque())
        times.append(now)
        if len(times) < self.per_node or not elsewhere:
            return False
        self.quarantined[node] = (now, why)
        del self.strikes[node]
        return True

    def skip(self, seconds: float) -> None:
        """Time the caller's clock did not see (a simulation's jump): every unit and strike ages by it."""
        if seconds <= 0:
            return
        self.recent = collections.deque((t - seconds, c) for t, c in self.recent)
        self.strikes = {n: collections.deque(t - seconds for t in times) for n, times in self.strikes.items()}

    def in_window(self, now: float) -> int:
        """Units spent inside the window ending at ``now``."""
        self._prune(now)
        return len(self.recent)

    def state(self, now: float) -> dict[str, Any]:
        """What the budget holds at ``now``, for records and reports."""
        self._prune(now)
        slots = collections.Counter(ch.slot for _, ch in self.recent if ch.slot is not None)
        return {
            "spent": self.spent, "limit": self.limit, "in_window": len(self.recent), "window_s": self.window_s,
            "per_window": self.per_window, "per_slot": self.per_slot, "per_node": self.per_node,
            "slots": {s: n for s, n in sorted(slots.items()) if n > 1},
            "node_strikes": {n: len(t) for n, t in sorted(self.strikes.items())},
            "quarantined": sorted(self.quarantined),
        }


def budget_for(key: str, config: Any) -> Budget:
    """The budget of config key ``key``: the failover budget with its window and places, any other a total."""
    limit = config.get(key)
    if key != FAILOVER_KEY:
        return Budget(key=key, limit=None if limit is None else int(limit))
    ft = config.fault_tolerance
    return Budget(key=key, limit=limit, window_s=ft.failover_window_s, per_window=ft.max_failovers_per_window,
                  per_slot=ft.max_slot_failovers, per_node=ft.max_node_failures)


def _charge(unit: str | Charge) -> Charge:
    return unit if isinstance(unit, Charge) else Charge(reason=unit)


def _sibling(key: str, name: str) -> str:
    return f"{key.rpartition('.')[0]}.{name}" if "." in key else name


def _prune_times(times: collections.deque[float], start: float) -> bool:
    """Drop the times at or before ``start``; True when none is left."""
    while times and times[0] <= start:
        times.popleft()
    return not times
