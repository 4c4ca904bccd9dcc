"""Budgets: a count of something a run may spend (``max_failovers``), and what it was spent on.

A state that declares a budget in its spec spends one unit on every entry. When nothing is
left, the machine does not enter that state: it takes the spec's ``on_exhausted`` trigger
instead and records the error, which lists every failure the budget went to, so the
operator sees why the run stopped and not only that it did.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Budget:
    """key: the config key it came from; limit: how many units the run may spend."""

    key: str
    limit: int
    spent_on: list[str] = dataclasses.field(default_factory=list)

    @property
    def spent(self) -> int:
        return len(self.spent_on)

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.spent)

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.limit

    def spend(self, reason: str) -> int:
        """Spend one unit on ``reason``; returns what remains. Callers check :attr:`exhausted` first."""
        if self.exhausted:
            raise RuntimeError(f"budget {self.key} spent beyond its limit {self.limit}")  # a machine bug
        self.spent_on.append(reason)
        return self.remaining
