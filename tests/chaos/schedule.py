"""Fault schedules: drawn from a seed, written as JSON, replayed exactly, shrunk when they fail.

A :class:`Schedule` is a list of :class:`Fault` s over a number of steps (one step: a train step
and a sync). A fault names *what* (``kind``), *whom* (``target`` role and ``pick``, an index
resolved at run time against the live candidates in name order, so the same schedule on the
same history picks the same member), *when* within its step (``before`` the step, ``mid-step``,
``mid-sync``, ``mid-failover``) and whether it lands ``together`` with the fault before it (two
at once). :func:`draw` makes a schedule from a seed with :class:`random.Random` only, so a seed
replays bit for bit (FoundationDB's and TigerBeetle's rule: every failure is found by a seed that
replays it). :func:`shrink` reduces a failing schedule to one from which no single fault can be
dropped without the failure going away (hypothesis's first shrinking pass).

Pure: no Ray, no torch, no clock.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

#: What a fault does: SIGKILL, SIGSTOP (hung: alive, silent), a whole node lost (its raylet and
#: every process it started SIGKILLed; a fresh node added afterwards), a maintenance drain of a
#: node, one corrupted bucket at a rollout, a slow trainer (its next state_dict() takes seconds).
KINDS = ("kill", "stop", "node", "drain", "corrupt", "slow")
#: Whom a kill or a stop hits.
TARGETS = ("rollout", "trainer", "spare")
#: When within its step a fault lands.
WHENS = ("before", "mid-step", "mid-sync", "mid-failover")

#: The default menu: (kind, target, weight). Kinds that need no target use "node" or "rollout".
MENU: tuple[tuple[str, str, float], ...] = (
    ("kill", "rollout", 4.0),
    ("kill", "trainer", 2.0),
    ("kill", "spare", 1.0),
    ("stop", "rollout", 2.0),
    ("stop", "trainer", 1.0),
    ("stop", "spare", 0.5),
    ("node", "node", 2.0),
    ("drain", "node", 1.0),
    ("corrupt", "rollout", 1.5),
    ("slow", "trainer", 1.0),
)
#: When each kind may land (a drain waits for the sync lock, so it lands between steps only;
#: a slow trainer is slow in its next sync, so it is set before it).
WHEN_FOR = {
    "kill": WHENS, "stop": WHENS, "node": WHENS, "drain": ("before",),
    "corrupt": ("before",), "slow": ("before",),
}
#: Weights of the moments, for kinds that may land at any of them.
WHEN_WEIGHTS = {"before": 3.0, "mid-step": 1.0, "mid-sync": 2.0, "mid-failover": 1.0}
#: The chance that a fault lands together with the one drawn before it (same step, same moment).
TOGETHER_P = 0.2


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault. step: the step it lands in (0-based); kind / target: see :data:`KINDS`,
    :data:`TARGETS` (``node`` for node faults); pick: which candidate (index modulo their
    number, in name order); when: see :data:`WHENS`; together: lands at the same moment as the
    fault before it."""

    step: int
    kind: str
    target: str
    pick: int
    when: str = "before"
    together: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.when not in WHENS:
            raise ValueError(f"fault when {self.when!r}: expected one of {', '.join(WHENS)}")
        if self.kind in ("kill", "stop") and self.target not in TARGETS:
            raise ValueError(f"fault target {self.target!r}: expected one of {', '.join(TARGETS)}")
        if not (isinstance(self.step, int) and self.step >= 0 and isinstance(self.pick, int) and self.pick >= 0):
            raise ValueError(f"fault step and pick must be integers >= 0, got {self.step!r}, {self.pick!r}")

    def describe(self) -> str:
        who = f"{self.target}[{self.pick}]"
        return f"step {self.step} {self.when}{' (together)' if self.together else ''}: {self.kind} {who}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A seed's faults over ``steps`` steps. seed: what drew it (None once shrunk or edited)."""

    seed: int | None
    steps: int
    faults: tuple[Fault, ...]

    def at(self, step: int) -> list[Fault]:
        return [f for f in self.faults if f.step == step]

    def without(self, index: int) -> Schedule:
        faults = self.faults[:index] + self.faults[index + 1:]
        if index < len(faults) and faults[index].together:
            # the fault it landed together with is gone: it lands on its own
            faults = (*faults[:index], dataclasses.replace(faults[index], together=False), *faults[index + 1:])
        return Schedule(None, self.steps, faults)

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "steps": self.steps,
                           "faults": [dataclasses.asdict(f) for f in self.faults]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data: Any = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("faults"), list):
            raise ValueError("a schedule is a JSON object with 'seed', 'steps' and a list 'faults'")
        steps = data.get("steps")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"schedule 'steps' must be an integer >= 1, got {steps!r}")
        faults = tuple(Fault(**f) for f in data["faults"])
        if any(f.step >= steps for f in faults):
            raise ValueError(f"every fault's step must be below 'steps' ({steps})")
        return cls(data.get("seed"), steps, faults)

    def describe(self) -> str:
        head = f"seed {self.seed}" if self.seed is not None else "schedule"
        return f"{head}, {self.steps} steps, {len(self.faults)} faults:\n" + "\n".join(
            f"  {f.describe()}" for f in self.faults)


def _weighted(rng: random.Random, items: Sequence[Any], weights: Sequence[float]) -> Any:
    return rng.choices(list(items), weights=list(weights), k=1)[0]


def draw(seed: int, faults: int, steps: int | None = None,
         menu: Sequence[tuple[str, str, float]] = MENU) -> Schedule:
    """The schedule of ``seed``: ``faults`` faults from ``menu`` over ``steps`` steps (default:
    one more step than faults, so the run goes on after the last one). Deterministic."""
    if faults < 0:
        raise ValueError(f"faults must be >= 0, got {faults}")
    steps = steps if steps is not None else faults + 1
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rng = random.Random(seed)
    out: list[Fault] = []
    for _ in range(faults):
        kind, target, _w = _weighted(rng, menu, [w for *_, w in menu])
        prev = out[-1] if out else None
        if prev is not None and rng.random() < TOGETHER_P and prev.when in WHEN_FOR[kind]:
            out.append(Fault(prev.step, kind, target, rng.randrange(1 << 16), prev.when, together=True))
            continue
        whens = WHEN_FOR[kind]
        when = _weighted(rng, whens, [WHEN_WEIGHTS[w] for w in whens])
        out.append(Fault(rng.randrange(steps - 1 if steps > 1 else 1), kind, target, rng.randrange(1 << 16), when))
    out.sort(key=lambda f: f.step)  # stable: a fault drawn together stays right after its partner
    return Schedule(seed, steps, tuple(out))


def shrink(schedule: Schedule, fails: Callable[[Schedule], bool], *,
           on_try: Callable[[Schedule, bool], None] | None = None) -> Schedule:
    """The smallest schedule reachable from ``schedule`` by dropping faults one at a time while
    ``fails`` still holds (``schedule`` itself is taken to fail). Each candidate costs a run;
    ``on_try`` is told each candidate and its outcome."""
    current = schedule
    i = 0
    while i < len(current.faults):
        candidate = current.without(i)
        failed = fails(candidate)
        if on_try is not None:
            on_try(candidate, failed)
        if failed:
            current = candidate  # the same index now holds the next fault
        else:
            i += 1
    return current
