"""State machines built from specs: one per group or worker, events in, effects out; driven by the
controller's runtime, or by tests with a :class:`~ftstate.core.deadline.ManualClock`.
:meth:`StateMachine.fire` is the only place a state changes, and there each transition disarms and arms
deadlines, spends budgets and writes its audit record (docs/concepts.md, "Machines"). Imports neither Ray nor
torch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from transitions.extensions.asyncio import AsyncMachine

from ftstate.core import errors
from ftstate.core.audit import (
    BUDGET_EXHAUSTED,
    BUDGET_SPENT,
    DEADLINE_EXPIRED,
    ERROR,
    TRANSITION,
    AuditTrail,
    plain,
)
from ftstate.core.budget import Budget, Charge, Refusal, budget_for
from ftstate.core.config import RuntimeConfig
from ftstate.core.deadline import Clock, Deadline, LoopClock
from ftstate.core.errors import FTError, InternalError, InvalidTransition
from ftstate.core.spec import MachineSpec


class _SpecMachine(AsyncMachine):
    """An ``AsyncMachine`` whose ``add_model`` checks membership in O(1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._model_ids: set[int] = set()
        super().__init__(*args, **kwargs)

    def add_model(self, model: Any, initial: Any = None) -> None:
        models = model if isinstance(model, list) else [model]
        for mod in models:
            mod = self if mod is self.self_literal else mod
            if id(mod) in self._model_ids:
                continue
            # transitions' own add_model, minus its O(n) `mod not in self.models` scan.
            self._checked_assignment(mod, "trigger", _bound(self._get_trigger, mod))
            self._checked_assignment(mod, "may_trigger", _bound(self._can_trigger, mod))
            for trigger in self.events:
                self._add_trigger_to_model(trigger, mod)
            for state in self.states.values():
                self._add_model_to_state(state, mod)
            self.set_state(initial if initial is not None else self.initial, model=mod)
            self.models.append(mod)
            self._model_ids.add(id(mod))

    def remove_model(self, model: Any) -> None:
        # Removed models leave the list in one pass once half of it is gone, so n removals cost O(n), not
        # O(n²).
        gone = {id(mod) for mod in (model if isinstance(model, list) else [model])} & self._model_ids
        if not gone:
            return
        self._model_ids -= gone
        self._removed = getattr(self, "_removed", 0) + len(gone)  # set on the first removal (the base __init__ runs first)
        if 2 * self._removed >= len(self.models):
            self.models[:] = [m for m in self.models if id(m) in self._model_ids]
            self._removed = 0


def _bound(fn: Any, model: Any) -> Any:
    from functools import partial

    return partial(fn, model)


def _per_spec(cache: dict[int, tuple[MachineSpec, Any]], spec: MachineSpec, make: Callable[[MachineSpec], Any]) -> Any:
    """What ``make(spec)`` built for ``spec``, once a spec (keyed by identity, checked against the spec)."""
    hit = cache.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = cache[id(spec)] = (spec, make(spec))
    return hit[1]


_compiled: dict[int, tuple[MachineSpec, _SpecMachine]] = {}


def compile_spec(spec: MachineSpec) -> _SpecMachine:
    """The shared ``transitions`` machine of a spec (built once; models are added to it)."""
    return _per_spec(_compiled, spec, _compiled_machine)


def _compiled_machine(spec: MachineSpec) -> _SpecMachine:
    return _SpecMachine(
        model=None,
        states=list(spec.states),
        transitions=[{"trigger": t.trigger, "source": t.source, "dest": t.dest} for t in spec.transitions],
        initial=spec.initial,
        auto_transitions=False,
        queued=False,
        send_event=False,
    )


class _PlainNames(dict[str, Any]):
    """A spec's names as a record writes them (:func:`plain`), each cleaned once, on first use."""

    def __missing__(self, name: str) -> Any:
        value = self[name] = plain(name)
        return value


_plain_names: dict[int, tuple[MachineSpec, _PlainNames]] = {}


def _names_of(spec: MachineSpec) -> _PlainNames:
    return _per_spec(_plain_names, spec, lambda _spec: _PlainNames())


class _Model:
    """What ``transitions`` decorates with triggers, apart so triggers never shadow the machine's methods."""

    __slots__ = ("__dict__", "state")


class StateMachine:
    """One group or worker, driven by events, with deadlines, budgets and an audit trail. ``config`` gives
    each deadline's seconds and budget's limit; ``budgets`` are shared by config key, so several machines
    spend one run-wide budget; ``clock`` defaults to the running loop's."""

    # Slots, not a __dict__: a heartbeat round reads every machine's state.
    __slots__ = (
        "__weakref__",
        "_entered_at",
        "_entry",
        "_expired",
        "_expiries",
        "_identity_rest",
        "_listeners",
        "_member_plain",
        "_model",
        "_names",
        "_recorded",
        "_scopes",
        "_wait",
        "_waiters",
        "_weights_version",
        "audit",
        "budgets",
        "clock",
        "config",
        "deadline",
        "error",
        "group_version",
        "identity",
        "spec",
    )

    def __init__(
        self,
        spec: MachineSpec,
        *,
        member: str,
        config: RuntimeConfig,
        audit: AuditTrail | None = None,
        clock: Clock | None = None,
        role: str | None = None,
        rank: int | None = None,
        budgets: dict[str, Budget] | None = None,
        **identity: Any,
    ) -> None:
        self.spec = spec
        self.config = config
        self.audit = audit if audit is not None else AuditTrail()
        self.clock = clock if clock is not None else LoopClock()
        self.identity: dict[str, Any] = {"member": member, "role": role, "rank": rank, **identity}
        self._names = _names_of(spec)
        self._bound_identity()
        self.budgets = budgets if budgets is not None else {}
        #: The membership version the machine's records are stamped with (set by the runtime).
        self.group_version = 0
        self._weights_version = 0
        #: The last error recorded (deadline expiry, exhausted budget, or one passed to fire()).
        self.error: FTError | None = None
        self.deadline: Deadline | None = None
        self._wait: tuple[str, Any, Any] | None = None
        self._entry = 0
        self._entered_at = self.clock.now()
        self._scopes: dict[asyncio.Task[Any], int] = {}
        self._waiters: list[tuple[frozenset[str], asyncio.Future[str]]] = []
        self._expiries: set[asyncio.Task[Any]] = set()
        self._expired: dict[int, errors.DeadlineExceeded] = {}
        self._listeners: list[Callable[[StateMachine, str, str, str], None]] = []
        self._model = _Model()
        # Not added to the shared machine (add_model): that hangs a bound trigger per event on every
        # model for the collector to walk, and the state is set through the shared machine (_fire).
        compile_spec(spec).set_state(spec.initial, model=self._model)
        self._arm(spec.initial)

    # -- reading -----------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        """The weights version this member holds (group: the current committed version)."""
        return self._weights_version

    def now_holds(self, weights_version: int) -> None:
        """This member holds ``weights_version`` from now on (the group: it is the current version); the only
        place a machine's version is written."""
        self._weights_version = weights_version

    @property
    def member(self) -> str:
        return self.identity["member"]

    @property
    def state(self) -> str:
        return self._model.state

    @property
    def serving(self) -> bool:
        return self.state in self.spec.serving_states

    @property
    def terminal(self) -> bool:
        return self.state in self.spec.terminal_states

    def can(self, trigger: str) -> bool:
        return self.spec.next_state(self.state, trigger) is not None

    def seconds_in_state(self) -> float:
        return self.clock.now() - self._entered_at

    def bind(self, **identity: Any) -> None:
        """Add identity fields to every later record (``pid``, ``node`` once known)."""
        self.identity.update(identity)
        self._bound_identity()

    def _bound_identity(self) -> None:
        # What every record carries, cleaned once here, so a transition's record writes it as it is.
        recorded = {k: plain(v) for k, v in self.identity.items() if v is not None}
        self._recorded = recorded
        self._identity_rest = {k: v for k, v in recorded.items() if k != "member"}
        self._member_plain = recorded.get("member")

    def listen(self, callback: Callable[[StateMachine, str, str, str], None]) -> None:
        """Call ``callback(machine, src, dest, trigger)`` after every transition; it must not block."""
        self._listeners.append(callback)

    def describe_wait(
        self,
        what: str,
        *,
        missing: Iterable[str] | Callable[[], Iterable[str]] = (),
        arrived: Iterable[str] | Callable[[], Iterable[str]] = (),
    ) -> None:
        """Say what the current state waits for, so an expiry can name it; ``missing``/``arrived`` may be
        callables asked at expiry. Reset on every transition."""
        self._wait = (what, missing, arrived)

    # -- events ------------------------------------------------------------------------

    async def fire(
        self,
        trigger: str,
        *,
        reason: str = "",
        error: FTError | None = None,
        spend_on: Sequence[str | Charge] = (),
        for_version: int | None = None,
        **fields: Any,
    ) -> str:
        """Apply one event; returns the state entered. Raises :class:`~ftstate.core.errors.InvalidTransition`
        when the state does not accept ``trigger``. ``error`` is recorded as the machine's error; ``fields``
        go on the record; ``spend_on`` says what each budget unit is spent on (default one unit, on
        ``reason``), and entering is refused for ``on_exhausted`` when a limit would break. ``for_version``:
        the weights version the record names when the event concerns one the machine does not hold yet
        (``sync_start``: the version being pushed; it becomes the machine's only through :meth:`now_holds`).
        Applied in one step of the event loop, so events never interleave and no lock is needed."""
        if for_version is not None:
            fields = {**fields, "weights_version": for_version}
        return self._fire(trigger, reason, error, fields, tuple(spend_on))

    def _fire(
        self, trigger: str, reason: str, error: FTError | None, fields: Mapping[str, Any],
        spend_on: tuple[str | Charge, ...] = (),
    ) -> str:
        src = self.state
        dest = self.spec.next_state(src, trigger)
        if dest is None:
            raise InvalidTransition(self.spec.name, self.member, src, trigger, self.spec.triggers_from(src))
        budget_spec = self.spec.states[dest].budget
        units = spend_on or (reason or trigger,)
        if budget_spec is not None and dest != src:
            refused = self.budget(budget_spec.key).refusal(units, self.clock.now())
            if refused is not None:
                return self._exhausted(dest, trigger, refused)
        # The edge was checked above and the compiled machine has no callbacks: setting the state is all its
        # trigger would do.
        self._model.state = dest
        self._transition(src, dest, trigger, reason, error, fields)
        if budget_spec is not None and dest != src:
            self._spend(dest, units)
        return dest

    async def spend(self, units: Sequence[str | Charge]) -> bool:
        """Spend ``units`` more of the current state's budget (a loss taken in mid-round pays as on entry);
        with too few left, ``on_exhausted`` fires and False is returned."""
        budget_spec = self.spec.states[self.state].budget
        if budget_spec is None:
            raise InternalError(f"{self.spec.name} {self.member}: state {self.state} has no budget to spend")
        refused = self.budget(budget_spec.key).refusal(tuple(units), self.clock.now())
        if refused is not None:
            self._exhausted(self.state, "spend", refused)
            return False
        self._spend(self.state, units)
        return True

    def _exhausted(self, dest: str, trigger: str, refused: Refusal) -> str:
        """Entering ``dest`` would overspend (``refused``: which limit): take its ``on_exhausted``, with the
        error."""
        budget_spec = self.spec.states[dest].budget
        assert budget_spec is not None
        budget = self.budget(budget_spec.key)
        if refused.kind == "slot":
            exc: FTError = errors.CrashLoop(slot=refused.subject or "?", cls=refused.cls, limit=refused.limit,
                                            spent_on=refused.spent_on, window_s=refused.window_s, member=self.member)
        else:
            exc = getattr(errors, budget_spec.error)(limit=refused.limit, spent_on=refused.spent_on,
                                                     member=self.member, key=refused.key, window_s=refused.window_s)
        self.error = exc
        self._record(
            BUDGET_EXHAUSTED,
            state=self.state,
            trigger=trigger,
            budget=budget.key,
            limit=refused.limit,
            limit_key=refused.key,
            spent_on=list(refused.spent_on),
            error=type(exc).__name__,
            message=str(exc),
            **({"slot": refused.subject} if refused.subject else {}),
        )
        return self._fire(budget_spec.on_exhausted, str(exc), exc, {})

    def _spend(self, state: str, units: Sequence[str | Charge]) -> None:
        budget_spec = self.spec.states[state].budget
        assert budget_spec is not None
        budget = self.budget(budget_spec.key)
        now = self.clock.now()
        for unit in units:
            remaining = budget.spend(unit, now)
            where = {"slot": unit.slot} if isinstance(unit, Charge) and unit.slot else {}
            if isinstance(unit, Charge) and unit.node:
                where["node_lost"] = unit.node
            self._record(
                BUDGET_SPENT, state=state, budget=budget.key, limit=budget.limit, spent=budget.spent,
                remaining=remaining, in_window=len(budget.recent) if budget.window_s is not None else None,
                reason=unit.reason if isinstance(unit, Charge) else unit, **where,
            )

    def _transition(
        self, src: str, dest: str, trigger: str, reason: str, error: FTError | None, fields: Mapping[str, Any]
    ) -> None:
        """The effects of one state change; the only place they happen."""
        now = self.clock.now()
        seconds = now - self._entered_at
        if self.deadline is not None:
            self.deadline.disarm()
            self.deadline = None
        self._entry += 1
        self._entered_at = now
        self._wait = None
        if error is not None:
            self.error = error
        if not self.audit.silent:  # a record nobody keeps is not built (10,000 a sync at 10,000 members)
            self._record_transition(src, dest, trigger, reason, error, fields, seconds)
        self._arm(dest)
        self._wake(dest)
        for listener in self._listeners:
            listener(self, src, dest, trigger)

    def _record_transition(self, src: str, dest: str, trigger: str, reason: str, error: FTError | None,
                           fields: Mapping[str, Any], seconds: float) -> None:
        known = {"machine": self._names[self.spec.name], "member": self._member_plain,
                 "from": self._names[src], "to": self._names[dest], "trigger": self._names[trigger]}
        known.update(self._identity_rest)
        known["group_version"] = self.group_version
        known["weights_version"] = self.weights_version
        known["seconds_in_state"] = round(seconds, 6)
        if error is not None:
            self.audit.record_plain(TRANSITION, known, fields, **({"reason": reason} if reason else {}),
                                    error=type(error).__name__, message=str(error))
        elif reason:
            self.audit.record_plain(TRANSITION, known, fields, reason=reason)
        else:
            self.audit.record_plain(TRANSITION, known, fields)

    def _arm(self, state: str) -> None:
        d = self.spec.states[state].deadline
        if d is None:
            return
        seconds = float(self.config.get(d.key))
        self.deadline = Deadline.arm(
            self.clock, state=state, key=d.key, seconds=seconds, entry=self._entry, owner=self
        )

    def _on_expiry(self, entry: int) -> None:
        if entry != self._entry:
            return
        task = asyncio.get_running_loop().create_task(self._expire(entry))
        self._expiries.add(task)
        task.add_done_callback(self._expiries.discard)

    async def _expire(self, entry: int) -> None:
        if entry != self._entry or self.deadline is None:
            return  # the state was left while this expiry waited: it was disarmed
        d = self.spec.states[self.state].deadline
        assert d is not None
        what, missing, arrived = self._wait or (f"{self.member} in {self.state}", (), ())
        missing = missing() if callable(missing) else missing
        arrived = arrived() if callable(arrived) else arrived
        exc = getattr(errors, d.error)(
            what,
            key=d.key,
            seconds=self.deadline.seconds,
            member=self.member,
            group_version=self.group_version,
            missing=missing,
            arrived=arrived,
        )
        self.error = exc
        self._expired[entry] = exc
        self._record(
            DEADLINE_EXPIRED, state=self.state, key=d.key, seconds=self.deadline.seconds,
            missing=list(exc.missing), arrived=list(exc.arrived), error=type(exc).__name__, message=str(exc),
        )
        for task, scope_entry in list(self._scopes.items()):
            if scope_entry == entry:
                task.cancel(msg=f"deadline: {exc}")
        self._fire(d.on_expiry, str(exc), exc, {})

    def record(self, event: str, **fields: Any) -> None:
        """Write a record of this machine that changes no state, with its identity and versions."""
        self._record(event, state=self.state, **fields)

    def record_error(self, exc: BaseException, **fields: Any) -> None:
        """Write an error that did not (yet) change the state, e.g. a failed actor call."""
        self._record(ERROR, state=self.state, error=type(exc).__name__, message=str(exc), **fields)

    def _record(self, event: str, **fields: Any) -> None:
        self.audit.record(
            event,
            machine=self.spec.name,
            **self._recorded,
            group_version=self.group_version,
            weights_version=self.weights_version,
            **fields,
        )

    def budget(self, key: str) -> Budget:
        """The budget of config key ``key`` this machine spends (created from the config)."""
        if key not in self.budgets:
            self.budgets[key] = budget_for(key, self.config)
        return self.budgets[key]

    # -- waiting -----------------------------------------------------------------------

    async def wait_for(self, *states: str) -> str:
        """Wait until the machine is in one of ``states``; returns it. Raises the recorded error (or
        :class:`~ftstate.core.errors.FTError`) on a terminal state not among them."""
        unknown = [s for s in states if s not in self.spec.states]
        if unknown:
            raise ValueError(f"{self.spec.name} machine has no state {unknown[0]!r}")
        wanted = frozenset(states)
        if self.state in wanted:
            return self.state
        self._raise_if_terminal()
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.append((wanted, fut))
        try:
            return await fut
        finally:
            self._waiters = [(w, f) for (w, f) in self._waiters if f is not fut]

    def _wake(self, state: str) -> None:
        for wanted, fut in self._waiters:
            if fut.done():
                continue
            if state in wanted:
                fut.set_result(state)
            elif state in self.spec.terminal_states:
                fut.set_exception(self._terminal_error())

    def _raise_if_terminal(self) -> None:
        if self.terminal:
            raise self._terminal_error()

    def _terminal_error(self) -> FTError:
        if self.error is not None:
            return self.error
        return FTError(f"{self.spec.name} machine of {self.member} is {self.state}")

    @contextlib.asynccontextmanager
    async def deadline_scope(self) -> AsyncIterator[Deadline | None]:
        """Bound the enclosed work by the current state's deadline: on expiry the machine takes its expiry
        transition, cancels the work, and this raises the recorded ``DeadlineExceeded``."""
        task = asyncio.current_task()
        assert task is not None
        entry = self._entry
        self._scopes[task] = entry
        try:
            yield self.deadline
        except asyncio.CancelledError:
            if entry in self._expired and task.uncancel() == 0:
                raise self._expired[entry] from None
            raise
        finally:
            self._scopes.pop(task, None)
        if entry in self._expired:
            # The deadline expired as the work finished; its cancellation may still be pending.
            while task.cancelling():
                task.uncancel()
            raise self._expired[entry]

    async def settle(self) -> None:
        """Wait for expiry handling already under way (tests call it after advancing a clock)."""
        while self._expiries:
            await asyncio.gather(*list(self._expiries), return_exceptions=True)

    def close(self) -> None:
        """Disarm the deadline and cancel expiries under way."""
        if self.deadline is not None:
            self.deadline.disarm()
            self.deadline = None
        for task in list(self._expiries):
            task.cancel()

    def __repr__(self) -> str:
        return f"<StateMachine {self.spec.name} {self.member} {self.state}>"

