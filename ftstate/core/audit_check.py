"""Check an audit trail against the machines: did every member only ever do what its spec allows? Replays each
run record by record and reports every broken invariant with its line, never raising on hostile input
(docs/concepts.md, "Checking a trail"). Imports neither Ray nor torch."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ftstate.core.audit import RUN_START, TRANSITION, AuditTrail, parse_lines, record_problem
from ftstate.core.errors import AuditViolation
from ftstate.core.events import KINDS
from ftstate.core.spec import RESYNCED, MachineSpec, load_machines

#: The machine whose records carry the run's current weights version.
GROUP_MACHINE = "group"
#: The role whose serving states must hold the current weights version.
ROLLOUT_ROLE = "rollout"
#: The group's states and trigger the stale-serving rule follows (see machines/group.yaml).
GROUP_SYNCING = "SYNCING"
GROUP_READY = "READY"
GROUP_COMMIT = "sync_done"

Trail = (
    str
    | os.PathLike[str]
    | AuditTrail
    | Iterable[Mapping[str, Any]]
    | Iterable[tuple[int, Mapping[str, Any]]]
)


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken invariant: the trail's line number (1-based), the member, what is wrong."""

    line: int
    member: str
    problem: str

    def __str__(self) -> str:
        return (
            f"line {self.line}: {self.member}: {self.problem}"
            if self.member
            else f"line {self.line}: {self.problem}"
        )


@dataclasses.dataclass
class _Member:
    machine: str
    name: str
    state: str | None = None
    state_line: int = 0
    terminal_line: int | None = None
    role: str | None = None
    weights_version: Any = None
    checksum: Any = None
    pending: Any = None  # a version held back for a safe point (swap_pending)


@dataclasses.dataclass
class _Run:
    """The replay state of one run."""

    members: dict[tuple[str, str], _Member] = dataclasses.field(default_factory=dict)
    group_state: str | None = None
    #: The group's current weights version (None until a group record carries one).
    current: Any = None
    #: The version committed before the sync in flight (None when the group is not syncing).
    before_sync: Any = None
    #: The sender's checksum of every committed version (from the group's ``sync_done``).
    sent: dict[Any, Any] = dataclasses.field(default_factory=dict)


class TrailChecker:
    """Replays records one at a time (:meth:`feed`) and collects :attr:`violations` (``specs``: the machines).
    """

    def __init__(self, specs: Mapping[str, MachineSpec] | None = None) -> None:
        self.specs: Mapping[str, MachineSpec] = specs if specs is not None else load_machines()
        self.violations: list[Violation] = []
        #: Records fed (well-formed ones).
        self.records = 0
        self._unknown_machines: set[str] = set()
        #: Each run's replay (see the module docstring), by run id; "" for records without one.
        self.runs: dict[str, _Run] = {}
        self._run = self.runs.setdefault("", _Run())
        self._anonymous = 0

    @property
    def members(self) -> dict[tuple[str, str, str], _Member]:
        """Every member of every run, by ``(run, machine, member)``."""
        return {(run, *key): m for run, r in self.runs.items() for key, m in r.members.items()}

    # -- input ---------------------------------------------------------------------------

    def feed(self, line: int, record: Any) -> list[Violation]:
        """Check one record; returns the violations it caused (also kept in :attr:`violations`)."""
        start = len(self.violations)
        problem = record_problem(dict(record) if isinstance(record, Mapping) else record)
        if problem is not None:
            self._report(line, "", problem)
            return self.violations[start:]
        self.records += 1
        self._enter_run(record)
        self._check(line, record)
        return self.violations[start:]

    def _enter_run(self, rec: Mapping[str, Any]) -> None:
        run = rec.get("run")
        if run is None:
            if rec["event"] == RUN_START:  # a run_start without an id: a new anonymous run
                self._anonymous += 1
                self._run = self.runs.setdefault(f"#{self._anonymous}", _Run())
            return  # else: the run the last record without an id was in
        if rec["event"] == RUN_START and run in self.runs and self.runs[run].members:
            self._run = self.runs[run] = _Run()  # the same id started again: replayed afresh
            return
        self._run = self.runs.setdefault(run, _Run())

    def malformed(self, line: int, problem: str) -> None:
        """Report a line that could not be parsed at all."""
        self._report(line, "", problem)

    def _report(self, line: int, member: str, problem: str) -> None:
        self.violations.append(Violation(line, member, problem))

    # -- the invariants ------------------------------------------------------------------

    def _check(self, line: int, rec: Mapping[str, Any]) -> None:
        event = rec["event"]
        machine = rec.get("machine")
        name = str(rec.get("member") or "")
        if event not in KINDS:
            self._report(line, name, f"unknown record kind {event!r} (not declared in ftstate.core.events)")
            return
        if machine is None:
            if event == TRANSITION:
                self._report(line, name, "transition record without a 'machine' field")
            return  # a runtime event that belongs to no machine
        spec = self.specs.get(machine)
        if spec is None:
            if machine not in self._unknown_machines:
                self._unknown_machines.add(machine)
                known = ", ".join(sorted(self.specs)) or "none"
                self._report(line, name, f"unknown machine {machine!r} (known machines: {known})")
            return
        if not name:
            self._report(line, "", f"{event} record of machine {machine!r} without a 'member' field")
            return
        m = self._run.members.get((machine, name))
        if m is None:
            m = self._run.members[(machine, name)] = _Member(machine, name)
        if m.terminal_line is not None:
            self._report(
                line,
                name,
                f"{event} record after {name} entered terminal state {m.state} (line {m.terminal_line})",
            )
            return
        if rec.get("role"):
            m.role = rec["role"]
        if rec.get("swap_pending") is not None:
            m.pending = rec["swap_pending"]
        wv = rec.get("weights_version")
        if rec.get("checksum") is not None and machine != GROUP_MACHINE:
            m.checksum = rec["checksum"]
        if event == TRANSITION:
            self._transition(line, rec, spec, m, wv, rec.get("checksum"))
        elif machine == GROUP_MACHINE and wv is not None:
            self._run.current = wv
        if wv is not None:
            m.weights_version = wv

    def _transition(
        self, line: int, rec: Mapping[str, Any], spec: MachineSpec, m: _Member, wv: Any, checksum: Any
    ) -> None:
        missing = [k for k in ("from", "to", "trigger") if not rec.get(k)]
        if missing:
            self._report(line, m.name, f"transition record without {', '.join(repr(k) for k in missing)}")
            return
        src, dst, trigger = str(rec["from"]), str(rec["to"]), str(rec["trigger"])
        prev = m.state if m.state is not None else spec.initial

        # Continuity: a transition leaves the state the previous one entered.
        if src != prev:
            if m.state is None:
                self._report(
                    line,
                    m.name,
                    f"first transition leaves {src}, but a {spec.name} machine starts in {spec.initial}",
                )
            else:
                self._report(
                    line,
                    m.name,
                    f"continuity broken: leaves {src}, but its last transition (line {m.state_line}) entered {prev}",
                )

        # The serving rule, checked on both what the record claims and where the member really was.
        offender = (
            next((s for s in (src, prev) if s not in spec.serving_states and s != RESYNCED), None)
            if dst in spec.serving_states
            else None
        )
        if offender is not None:
            self._report(
                line, m.name, f"entered serving state {dst} from {offender} without passing {RESYNCED}"
            )
        else:
            expected = spec.next_state(src, trigger)
            if expected != dst:
                self._report(line, m.name, _illegal(spec, src, trigger, dst, expected))

        m.state, m.state_line = dst, line
        if dst in spec.terminal_states:
            m.terminal_line = line

        if m.machine == GROUP_MACHINE:
            self._group_transition(line, src, dst, trigger, wv, checksum)
        elif m.role == ROLLOUT_ROLE and dst in spec.serving_states:
            self._rollout_serving(line, m, dst, trigger, wv)

    def _group_transition(self, line: int, src: str, dst: str, trigger: str, wv: Any, checksum: Any) -> None:
        self._run.group_state = dst
        if dst == GROUP_SYNCING and src != GROUP_SYNCING:
            self._run.before_sync = self._run.current
        if (
            src == GROUP_SYNCING
            and dst != GROUP_SYNCING
            and trigger != GROUP_COMMIT
            and self._run.before_sync is not None
        ):
            # The sync was abandoned: nothing was committed, so the version before it is still current.
            self._run.current = self._run.before_sync
        elif wv is not None:
            self._run.current = wv
        if dst != GROUP_SYNCING:
            self._run.before_sync = None
        if trigger == GROUP_COMMIT and dst == GROUP_READY and self._run.current is not None:
            if checksum is not None:
                self._run.sent[self._run.current] = checksum
            for other in self._run.members.values():
                if not (
                    other.role == ROLLOUT_ROLE
                    and other.machine != GROUP_MACHINE
                    and other.state in self.specs[other.machine].serving_states
                ):
                    continue
                if other.weights_version != self._run.current and other.pending != self._run.current:
                    self._report(
                        line,
                        other.name,
                        f"{other.name} serving weights version {other.weights_version} while current is "
                        f"{self._run.current} (the group committed it by {GROUP_COMMIT})",
                    )
                elif other.weights_version == self._run.current and checksum is not None \
                        and other.checksum != checksum:
                    self._report(line, other.name, _held_not_sent(other, self._run.current, checksum))

    def _rollout_serving(self, line: int, m: _Member, dst: str, trigger: str, wv: Any) -> None:
        if self._run.current is None:
            return
        allowed = {self._run.current}
        if self._run.group_state == GROUP_SYNCING and self._run.before_sync is not None:
            allowed.add(self._run.before_sync)
        if wv is None:
            self._report(
                line,
                m.name,
                f"{m.name} entered serving state {dst} by {trigger} without a weights_version "
                f"while current is {self._run.current}",
            )
        elif wv not in allowed and m.pending not in allowed:  # (in_flight: it holds the newer back)
            self._report(
                line,
                m.name,
                f"{m.name} serving weights version {wv} while current is {self._run.current} "
                f"(entered {dst} by {trigger})",
            )
        elif wv in self._run.sent and m.checksum != self._run.sent[wv]:
            self._report(line, m.name, _held_not_sent(m, wv, self._run.sent[wv]) + f" (entered {dst} by {trigger})")


def _held_not_sent(m: _Member, version: Any, sent: Any) -> str:
    held = "no checksum of its own" if m.checksum is None else f"checksum {m.checksum}"
    return f"{m.name} serving weights version {version} with {held}, the sender's is {sent}"


def _illegal(spec: MachineSpec, src: str, trigger: str, dst: str, expected: str | None) -> str:
    head = f"illegal transition {src} --{trigger}--> {dst}"
    if src not in spec.states:
        return f"{head}: the {spec.name} machine has no state {src}"
    if dst not in spec.states:
        return f"{head}: the {spec.name} machine has no state {dst}"
    if expected is None:
        allowed = ", ".join(spec.triggers_from(src)) or "none"
        return f"{head}: {trigger!r} is not accepted in {src} (accepted there: {allowed})"
    return f"{head}: {trigger!r} leads from {src} to {expected}, not {dst}"


# -- reading and the entry points ------------------------------------------------------


def load_records(path: str | os.PathLike[str]) -> tuple[list[tuple[int, dict[str, Any]]], list[Violation]]:
    """Read a trail leniently: ``(line, record)`` per good line, a violation per bad one (unlike
    ``read_trail``, which stops at the first). An unopenable file raises :class:`OSError`."""
    records: list[tuple[int, dict[str, Any]]] = []
    bad: list[Violation] = []
    with Path(path).open("rb") as f:
        for lineno, rec, problem in parse_lines(f):
            if problem is not None:
                bad.append(Violation(lineno, "", problem))
            else:
                records.append((lineno, rec))  # type: ignore[arg-type]
    return records, bad


def numbered(trail: Trail) -> tuple[list[tuple[int, Any]], list[Violation]]:
    """Any accepted form of a trail as ``(line, record)`` pairs plus unreadable lines: a path is read, a trail
    or list numbered from 1, pairs kept."""
    if isinstance(trail, (str, os.PathLike)):
        return load_records(trail)  # type: ignore[return-value]
    items = trail.records if isinstance(trail, AuditTrail) else trail
    out: list[tuple[int, Any]] = []
    for i, item in enumerate(items, 1):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int):
            out.append(item)
        else:
            out.append((i, item))
    return out, []


def check_trail(trail: Trail, specs: Mapping[str, MachineSpec] | None = None) -> list[Violation]:
    """Every violation in ``trail`` (a path, an ``AuditTrail``, records or ``(line, record)``
    pairs), ordered by line; empty when the trail keeps every invariant."""
    return check(trail, specs).violations


def check(trail: Trail, specs: Mapping[str, MachineSpec] | None = None) -> TrailChecker:
    """Replay ``trail`` and return the checker: its ``violations``, ``records`` and ``members``."""
    checker = TrailChecker(specs)
    items, bad = numbered(trail)
    for v in bad:
        checker.malformed(v.line, v.problem)
    for line, rec in items:
        checker.feed(line, rec)
    checker.violations.sort(key=lambda v: v.line)
    return checker


def assert_trail_valid(trail: Trail, specs: Mapping[str, MachineSpec] | None = None) -> None:
    """Raise :class:`~ftstate.core.errors.AuditViolation` for the first violation in ``trail``, if any."""
    violations = check_trail(trail, specs)
    if violations:
        first = violations[0]
        source = os.fspath(trail) if isinstance(trail, (str, os.PathLike)) else "<records>"
        problem = f"{first.member}: {first.problem}" if first.member else first.problem
        raise AuditViolation(source, first.line, problem)


__all__ = [
    "TrailChecker",
    "Violation",
    "assert_trail_valid",
    "check",
    "check_trail",
    "load_records",
    "numbered",
]
