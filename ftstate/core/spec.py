"""Machine specs: the state machines as data, loaded from ``machines/*.yaml`` and validated once at load (a
:class:`~ftstate.core.errors.SpecError` names the file, place and problem); the checks, the serving rule above
all, are listed in docs/concepts.md ("Machines"). Imports neither Ray nor torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from ftstate.core import errors
from ftstate.core.config import leaf_paths
from ftstate.core.errors import SpecError

#: The one state through which every way into serving must pass.
RESYNCED = "RESYNCED"
#: ``source: "*"`` means every non-terminal state.
WILDCARD = "*"

_TOP_KEYS = {"name", "description", "initial", "serving", "states", "transitions"}
_STATE_KEYS = {"doc", "deadline", "budget", "terminal"}
_DEADLINE_KEYS = {"key", "on_expiry", "error"}
_BUDGET_KEYS = {"key", "on_exhausted", "error"}
_TRANSITION_KEYS = {"trigger", "source", "dest"}


@dataclasses.dataclass(frozen=True)
class DeadlineSpec:
    """A state's deadline, armed on entry and disarmed on exit: ``key`` gives the seconds, ``on_expiry`` fires
    when it expires, ``error`` is the recorded DeadlineExceeded subclass."""

    key: str
    on_expiry: str
    error: str


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
    """A budget spent on every entry into its state: ``key`` gives the limit, ``on_exhausted`` is taken
    instead once it is spent, ``error`` is recorded then."""

    key: str
    on_exhausted: str
    error: str


@dataclasses.dataclass(frozen=True)
class StateSpec:
    name: str
    doc: str = ""
    terminal: bool = False
    serving: bool = False
    deadline: DeadlineSpec | None = None
    budget: BudgetSpec | None = None


@dataclasses.dataclass(frozen=True)
class TransitionSpec:
    trigger: str
    source: str
    dest: str
    #: True when it came from a ``"*"`` source (fail/stop from anywhere).
    wildcard: bool = False


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    """A validated machine. Build with :func:`load_spec` or :meth:`from_dict`."""

    name: str
    description: str
    initial: str
    states: Mapping[str, StateSpec]
    transitions: tuple[TransitionSpec, ...]
    source: str = "<dict>"

    # -- queries ---------------------------------------------------------------------

    @cached_property
    def _index(self) -> dict[tuple[str, str], str]:
        return {(t.source, t.trigger): t.dest for t in self.transitions}

    def next_state(self, state: str, trigger: str) -> str | None:
        """The state ``trigger`` leads to from ``state``, or None if it is not accepted there."""
        return self._index.get((state, trigger))

    def triggers_from(self, state: str) -> list[str]:
        return sorted(trigger for (src, trigger) in self._index if src == state)

    @cached_property
    def triggers(self) -> tuple[str, ...]:
        return tuple(sorted({t.trigger for t in self.transitions}))

    @cached_property
    def serving_states(self) -> frozenset[str]:
        return frozenset(s.name for s in self.states.values() if s.serving)

    @cached_property
    def terminal_states(self) -> frozenset[str]:
        return frozenset(s.name for s in self.states.values() if s.terminal)

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> MachineSpec:
        """Parse and validate one spec; every error names ``source``."""
        return _Parser(source).parse(data)


def machines_dir() -> Path:
    """Where the specs live: ``ftstate/machines`` in an installed wheel, else the repo's ``machines/``."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "machines", package.parent / "machines"):
        if candidate.is_dir():
            return candidate
    raise SpecError(str(package.parent / "machines"), "", "machines directory not found")


def load_spec(path: str | Path) -> MachineSpec:
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError as exc:
        raise SpecError(str(p), "", "no such spec file") from exc
    except yaml.YAMLError as exc:
        raise SpecError(str(p), "", f"not valid YAML: {exc}") from exc
    spec = MachineSpec.from_dict(data, source=str(p))
    if spec.name != p.stem:
        raise SpecError(str(p), "name", f"must match the file name {p.stem!r}, got {spec.name!r}")
    return spec


_cache: dict[Path, dict[str, MachineSpec]] = {}


def load_machines(directory: str | Path | None = None) -> dict[str, MachineSpec]:
    """Every ``*.yaml`` spec in ``directory`` (default :func:`machines_dir`), by name; cached."""
    d = Path(directory) if directory is not None else machines_dir()
    if d not in _cache:
        specs = {p.stem: load_spec(p) for p in sorted(d.glob("*.yaml"))}
        if not specs:
            raise SpecError(str(d), "", "no machine specs (*.yaml) found")
        _cache[d] = specs
    return _cache[d]


def get_spec(name: str) -> MachineSpec:
    specs = load_machines()
    if name not in specs:
        raise SpecError(str(machines_dir()), "", f"no machine named {name!r}; have: {', '.join(sorted(specs))}")
    return specs[name]


# -- parsing and validation ----------------------------------------------------------


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> SpecError:
        return SpecError(self.source, where, problem)

    def _mapping(self, value: Any, where: str, allowed: set[str], required: Iterable[str] = ()) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise self.fail(where, f"unknown key {unknown[0]!r}; expected one of: {', '.join(sorted(allowed))}")
        for key in required:
            if key not in value:
                raise self.fail(where, f"missing required key {key!r}")
        return value

    def _name(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"expected a non-empty string, got {value!r}")
        return value

    def parse(self, data: Any) -> MachineSpec:
        top = self._mapping(data, "", _TOP_KEYS, ("name", "initial", "states", "transitions"))
        name = self._name(top["name"], "name")
        raw_states = top["states"]
        if not isinstance(raw_states, Mapping) or not raw_states:
            raise self.fail("states", "expected a non-empty mapping of state name to its description")
        serving_list = top.get("serving") or []
        if not isinstance(serving_list, list):
            raise self.fail("serving", f"expected a list of state names, got {type(serving_list).__name__}")
        for s in serving_list:
            if s not in raw_states:
                raise self.fail(f"serving: {s}", f"unknown state; states are: {', '.join(raw_states)}")
        states = {sname: self._state(sname, body, sname in serving_list) for sname, body in raw_states.items()}
        initial = self._name(top["initial"], "initial")
        if initial not in states:
            raise self.fail("initial", f"unknown state {initial!r}; states are: {', '.join(states)}")
        transitions = self._transitions(top["transitions"], states)
        spec = MachineSpec(
            name=name,
            description=str(top.get("description") or "").strip(),
            initial=initial,
            states=states,
            transitions=transitions,
            source=self.source,
        )
        self._validate(spec)
        return spec

    def _state(self, name: str, body: Any, serving: bool) -> StateSpec:
        where = f"state {name}"
        self._name(name, where)
        body = {} if body is None else self._mapping(body, where, _STATE_KEYS)
        deadline = budget = None
        if "deadline" in body:
            d = self._mapping(body["deadline"], f"{where}: deadline", _DEADLINE_KEYS, _DEADLINE_KEYS)
            deadline = DeadlineSpec(**{k: self._name(d[k], f"{where}: deadline.{k}") for k in _DEADLINE_KEYS})
        if "budget" in body:
            b = self._mapping(body["budget"], f"{where}: budget", _BUDGET_KEYS, _BUDGET_KEYS)
            budget = BudgetSpec(**{k: self._name(b[k], f"{where}: budget.{k}") for k in _BUDGET_KEYS})
        terminal = body.get("terminal", False)
        if not isinstance(terminal, bool):
            raise self.fail(f"{where}: terminal", f"expected true or false, got {terminal!r}")
        return StateSpec(
            name=name,
            doc=str(body.get("doc") or "").strip(),
            terminal=terminal,
            serving=serving,
            deadline=deadline,
            budget=budget,
        )

    def _transitions(self, raw: Any, states: Mapping[str, StateSpec]) -> tuple[TransitionSpec, ...]:
        if not isinstance(raw, list) or not raw:
            raise self.fail("transitions", "expected a non-empty list of {trigger, source, dest}")
        out: list[TransitionSpec] = []
        seen: dict[tuple[str, str], tuple[str, int]] = {}
        non_terminal = [s for s in states.values() if not s.terminal]
        for i, item in enumerate(raw):
            where = f"transition #{i + 1}"
            t = self._mapping(item, where, _TRANSITION_KEYS, _TRANSITION_KEYS)
            trigger = self._name(t["trigger"], f"{where}: trigger")
            where = f"transition #{i + 1} ({trigger})"
            dest = self._name(t["dest"], f"{where}: dest")
            if dest not in states:
                raise self.fail(where, f"unknown dest state {dest!r}; states are: {', '.join(states)}")
            sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
            wildcard = sources == [WILDCARD]
            if wildcard:
                sources = [s.name for s in non_terminal if s.name != dest]
            for src in sources:
                self._name(src, f"{where}: source")
                if src not in states:
                    raise self.fail(where, f"unknown source state {src!r}; states are: {', '.join(states)}")
                key = (src, trigger)
                if key in seen and seen[key][0] != dest:
                    raise self.fail(
                        where,
                        f"trigger {trigger!r} from {src} is ambiguous: it already leads to "
                        f"{seen[key][0]} (transition #{seen[key][1]})",
                    )
                seen[key] = (dest, i + 1)
                out.append(TransitionSpec(trigger=trigger, source=src, dest=dest, wildcard=wildcard))
        return tuple(out)

    def _validate(self, spec: MachineSpec) -> None:
        config_keys = leaf_paths()
        explicit_out: dict[str, set[str]] = {s: set() for s in spec.states}
        for t in spec.transitions:
            if not t.wildcard and t.dest != t.source:
                explicit_out[t.source].add(t.dest)

        # Reachability from the initial state (wildcards count: FAILED is reached by `fail`).
        reached, frontier = {spec.initial}, [spec.initial]
        while frontier:
            state = frontier.pop()
            for t in spec.transitions:
                if t.source == state and t.dest not in reached:
                    reached.add(t.dest)
                    frontier.append(t.dest)
        for sname in spec.states:
            if sname not in reached:
                raise self.fail(f"state {sname}", f"unreachable from the initial state {spec.initial}")

        for st in spec.states.values():
            where = f"state {st.name}"
            if st.terminal:
                if explicit_out[st.name]:
                    raise self.fail(where, f"terminal but has transitions out to {', '.join(sorted(explicit_out[st.name]))}")
                if st.serving:
                    raise self.fail(where, "terminal states cannot serve")
                if st.deadline or st.budget:
                    raise self.fail(where, "terminal states carry no deadline or budget")
            elif not explicit_out[st.name]:
                raise self.fail(where, "non-terminal state with no way out (only the '*' fail/stop wildcards lead out)")
            if st.deadline:
                self._check_deadline(spec, st, st.deadline, config_keys)
            if st.budget:
                self._check_budget(spec, st, st.budget, config_keys)

        if spec.serving_states:
            if RESYNCED not in spec.states:
                raise self.fail("serving", f"a machine with serving states needs a {RESYNCED} state to admit workers")
            if RESYNCED in spec.serving_states:
                raise self.fail("serving", f"{RESYNCED} is the gate into serving and must not itself serve")
            for t in spec.transitions:
                if t.dest in spec.serving_states and t.source not in spec.serving_states and t.source != RESYNCED:
                    raise self.fail(
                        f"transition {t.trigger} ({t.source} -> {t.dest})",
                        f"enters serving state {t.dest} from non-serving state {t.source} without passing "
                        f"{RESYNCED}: a worker would serve without a verified load of the current weights",
                    )

    def _check_deadline(self, spec: MachineSpec, st: StateSpec, d: DeadlineSpec, config_keys: set[str]) -> None:
        where = f"state {st.name}: deadline"
        if d.key not in config_keys or not d.key.endswith("_s"):
            timeouts = sorted(k for k in config_keys if k.endswith("_s"))
            raise self.fail(where, f"key {d.key!r} is not a timeout in the config; expected one of: {', '.join(timeouts)}")
        if spec.next_state(st.name, d.on_expiry) is None:
            raise self.fail(where, f"on_expiry trigger {d.on_expiry!r} has no transition from {st.name}")
        cls = getattr(errors, d.error, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.DeadlineExceeded)):
            raise self.fail(where, f"error {d.error!r} is not a DeadlineExceeded class in ftstate.core.errors")

    def _check_budget(self, spec: MachineSpec, st: StateSpec, b: BudgetSpec, config_keys: set[str]) -> None:
        where = f"state {st.name}: budget"
        if b.key not in config_keys:
            raise self.fail(where, f"key {b.key!r} is not a field of the config")
        cls = getattr(errors, b.error, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.FailoverBudgetExhausted)):
            raise self.fail(where, f"error {b.error!r} is not a FailoverBudgetExhausted class in ftstate.core.errors")
        for t in spec.transitions:
            if t.dest == st.name and spec.next_state(t.source, b.on_exhausted) is None:
                raise self.fail(
                    where,
                    f"on_exhausted trigger {b.on_exhausted!r} has no transition from {t.source}, "
                    f"which enters {st.name} by {t.trigger!r}",
                )
