"""What every maintenance watcher returns, in the watcher's process: a :class:`Notice` (a node will go away or
be disturbed), a :class:`PollProblem` (a source that could not be read: a warning, never an exception) and the
:class:`PollResult` carrying both; plus the providers' date parsers."""

from __future__ import annotations

import dataclasses
import datetime as dt
import email.utils
import re
from typing import Any, Literal, Protocol

#: Where notices come from (the values of ``fault_tolerance.maintenance_sources``).
SOURCES = ("gce", "aws", "azure", "ray", "file")

#: What a notice announces: migrate (live migration), terminate, preempt (spot reclaimed), drain
#: (Ray), reboot, redeploy, freeze, stop, hibernate, rebalance (AWS spot risk, no deadline), or a
#: maintenance whose effect the provider does not state.
KINDS = (
    "migrate",
    "terminate",
    "preempt",
    "drain",
    "reboot",
    "redeploy",
    "freeze",
    "stop",
    "hibernate",
    "rebalance",
    "maintenance",
)

#: Longest ``raw`` kept in a notice (the audit trail wants one short line).
RAW_MAX = 200

ProblemKind = Literal["unreachable", "timeout", "http_status", "malformed", "too_large", "bad_url", "error"]


def short(text: str, limit: int = RAW_MAX) -> str:
    """One line of at most ``limit`` characters."""
    one = " ".join(str(text).split())
    return one if len(one) <= limit else one[: limit - 1] + "…"


@dataclasses.dataclass(frozen=True)
class Notice:
    """One maintenance or preemption notice. ``deadline``: epoch seconds by which the node is disturbed (None:
    not given); ``node``: the node it concerns (None: the watcher's); ``event_id``: the provider's."""

    source: str
    kind: str
    deadline: float | None = None
    node: str | None = None
    event_id: str | None = None
    raw: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"notice source must be one of {SOURCES}, got {self.source!r}")
        if self.kind not in KINDS:
            raise ValueError(f"notice kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "raw", short(self.raw))

    @property
    def key(self) -> tuple[str, str, str | None, str | None]:
        """What makes two polls' notices the same: source, kind, node, event id (not the movable deadline)."""
        return (self.source, self.kind, self.node, self.event_id)

    def on_node(self, node: str) -> Notice:
        """This notice with ``node`` filled in where the watcher left it unknown."""
        return self if self.node is not None else dataclasses.replace(self, node=node)

    def fields(self) -> dict[str, Any]:
        """The notice as audit-record fields."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PollProblem:
    """A source that could not be read this time: ``where`` failed, ``problem`` (its kind), ``detail`` (one
    line) and ``seconds`` the request took."""

    source: str
    where: str
    problem: ProblemKind
    detail: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "detail", short(self.detail))

    @property
    def signature(self) -> tuple[str, str, str]:
        """What makes two polls' problems the same problem (for reporting it once)."""
        return (self.source, self.where, self.problem)

    def took(self, seconds: float) -> PollProblem:
        """This problem with the seconds its request took (a pure parser cannot know them)."""
        return dataclasses.replace(self, seconds=seconds)

    @property
    def message(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.source} maintenance source {self.where}: {self.problem}{detail} ({self.seconds:.2f}s)"

    def fields(self) -> dict[str, Any]:
        """The problem as audit-record fields."""
        return {**dataclasses.asdict(self), "message": self.message}


@dataclasses.dataclass(frozen=True)
class PollResult:
    """What one poll found: the current notices and the problems met. With problems it is incomplete, so the
    runner withdraws nothing on it."""

    source: str
    notices: tuple[Notice, ...] = ()
    problems: tuple[PollProblem, ...] = ()
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.problems

    def on_node(self, node: str) -> PollResult:
        """This result with every notice's unknown node set to ``node``."""
        return dataclasses.replace(self, notices=tuple(n.on_node(node) for n in self.notices))


class Watcher(Protocol):
    """One maintenance source. ``poll()`` makes at most a few bounded requests and raises
    nothing for a bad server; ``bound_s`` is the longest a poll can take."""

    source: str

    @property
    def bound_s(self) -> float: ...

    def poll(self) -> PollResult: ...


# -- the providers' date formats (pure) ---------------------------------------------------

_FRACTION = re.compile(r"(\.\d{1,6})\d*")


def parse_rfc3339(text: str) -> float:
    """Epoch seconds of an RFC 3339 time (an offset, ``Z``, or none: UTC; up to ns); ValueError otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"not a time: {text!r}")
    value = _FRACTION.sub(r"\1", text.strip(), count=1)
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    when = dt.datetime.fromisoformat(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def parse_http_date(text: str) -> float:
    """Epoch seconds of an RFC 1123 / 2822 date (or AWS's without a weekday); ValueError otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"not a date: {text!r}")
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"not a date: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()
