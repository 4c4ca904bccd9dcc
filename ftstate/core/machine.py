"""State machines built from specs: one model per group or worker, events in, effects out.

:class:`StateMachine` is the only place a group's or worker's state changes. It takes
events (``await machine.fire("member_lost", reason=...)``), checks them against the spec,
sets the model's state through a shared ``transitions`` ``AsyncMachine`` built once per spec
(it has no callbacks: its async ``trigger`` would only spend ~70 µs reaching the same state,
so the model is not even added to it), and then carries out the three effects every
transition has:

1. the deadline of the state left is disarmed and that of the state entered is armed
   (:mod:`ftstate.core.deadline`); on expiry the spec's ``on_expiry`` trigger is fired and a
   typed :class:`~ftstate.core.errors.DeadlineExceeded` recorded, naming what was waited for,
   for how long, at which group version and who was missing;
2. entering a state with a budget spends one unit (:mod:`ftstate.core.budget`); with nothing
   left the ``on_exhausted`` trigger is taken instead and
   :class:`~ftstate.core.errors.FailoverBudgetExhausted` recorded;
3. one audit record is written (:mod:`ftstate.core.audit`).

Events for one machine are serialised by an ``asyncio.Lock`` (FIFO): concurrent events are
queued, never dropped, and never cancel each other (``transitions`` with ``queued=False``
would cancel a model's in-flight callbacks on a new trigger; it never sees two at once here).
A deadline expiry queued behind an event that has already left the state is discarded:
leaving the state disarmed it.

``transitions`` keeps its models in a list and ``add_model`` / ``remove_model`` scan it, so
adding or removing n models costs O(n²); :class:`_SpecMachine` keeps an identity set beside
the list so 10,000 worker machines cost linear time.

This module imports neither Ray nor torch: the runtime drives it, tests drive it with a
:class:`~ftstate.core.deadline.ManualClock` and no sleeps.
"""

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
        # transitions' own removes each model by a scan of the list (O(n) a model: closing a
        # run of 10,000 members was O(n²)); here removed models leave the list in one pass
        # once half of it is gone, so n removals cost O(n).
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
    """What ``make(spec)`` built for ``spec`` (once a spec; keyed by identity, checked against
    the spec itself since an id can be reused once a spec is gone)."""
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
    """A spec's names (its own, its states', its triggers') as a record writes them (:func:`plain`),
    each cleaned once, on first use."""

    def __missing__(self, name: str) -> Any:
        value = self[name] = plain(name)
        return value


_plain_names: dict[int, tuple[MachineSpec, _PlainNames]] = {}


def _names_of(spec: MachineSpec) -> _PlainNames:
    return _per_spec(_plain_names, spec, lambda _spec: _PlainNames())


class _Model:
    """What ``transitions`` decorates with triggers; kept apart so trigger names
    (``stop``, ``fail``…) never shadow :class:`StateMachine`'s own methods."""

    __slots__ = ("__dict__", "state")


class StateMachine:
    """One group or worker, driven by events, with deadlines, budgets and an audit trail.

    spec: the machine's spec. member: who this is (``group``, ``rollout-1``); role, rank:
    for workers. config: gives each deadline's seconds and each budget's limit (the keys the
    spec names). audit: where records go (an in-memory trail if omitted). clock: deadlines'
    clock (the running loop's by default). budgets: shared budgets by config key, so several
    machines can spend one run-wide budget; missing ones are created from the config.
    """

    # Slots, not a __dict__: a heartbeat round reads 10,000 machines' states, and each
    # machine's attributes held in the object itself are one cache miss fewer a read.
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
        "audit",
        "budgets",
        "clock",
        "config",
        "deadline",
        "error",
        "group_version",
        "identity",
        "spec",
        "weights_version",
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
        #: The weights version this member holds (group: the current committed version).
        self.weights_version = 0
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
        # Not added to the shared machine (add_model): that hangs a bound trigger per event on
        # every model (~40 objects a machine, 400,000 for 10,000 members, which the garbage
        # collector then walks on every full collection), and the triggers are never called:
        # the state is set through the shared machine (_fire).
        compile_spec(spec).set_state(spec.initial, model=self._model)
        self._arm(spec.initial)

    # -- reading -----------------------------------------------------------------------

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
        # What every record carries, cleaned once here (a worker's node address comes from its
        # own answer): a transition's record then writes these and the spec's names as they are.
        recorded = {k: plain(v) for k, v in self.identity.items() if v is not None}
        self._recorded = recorded
        self._identity_rest = {k: v for k, v in recorded.items() if k != "member"}
        self._member_plain = recorded.get("member")

    def listen(self, callback: Callable[[StateMachine, str, str, str], None]) -> None:
        """Call ``callback(machine, src, dest, trigger)`` after every transition (the runtime
        reacts to LOST or FAILED this way, whoever caused them). It must not block."""
        self._listeners.append(callback)

    def describe_wait(
        self,
        what: str,
        *,
        missing: Iterable[str] | Callable[[], Iterable[str]] = (),
        arrived: Iterable[str] | Callable[[], Iterable[str]] = (),
    ) -> None:
        """Say what the current state is waiting for, so an expiry can name it and who is missing.

        ``missing``/``arrived`` may be callables, asked at expiry (e.g. who registered in the
        rendezvous store by then). Reset on every transition.
        """
        self._wait = (what, missing, arrived)

    # -- events ------------------------------------------------------------------------

    async def fire(
        self,
        trigger: str,
        *,
        reason: str = "",
        error: FTError | None = None,
        spend_on: Sequence[str | Charge] = (),
        **fields: Any,
    ) -> str:
        """Apply one event; returns the state entered.

        Raises :class:`~ftstate.core.errors.InvalidTransition` when the current state does not accept
        ``trigger``. ``error`` is recorded as the machine's error (a fault that caused it);
        ``fields`` are added to the audit record. ``spend_on``: when the state entered has a
        budget, what each unit it costs is spent on (a reason, or a :class:`~ftstate.core.budget.Charge`
        naming the slot replaced or the node lost whole); default one unit, spent on ``reason``.
        Entering is refused (the budget's ``on_exhausted`` trigger instead) when a unit would
        break one of the budget's limits.

        A transition is applied in one step of the event loop, without waiting on anything, so
        two events (or an event and a deadline's expiry) never interleave: no lock is needed,
        and none is taken (an ``asyncio.Lock`` was three coroutines a transition, 20,000
        transitions a sync at 10,000 members).
        """
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
        # The edge was checked against the spec above, and the compiled machine has no callbacks
        # or conditions: its async ``trigger`` would do what this assignment does after ~70 µs
        # of event plumbing (a third of a transition's cost), its ``set_state`` after a lookup.
        self._model.state = dest
        self._transition(src, dest, trigger, reason, error, fields)
        if budget_spec is not None and dest != src:
            self._spend(dest, units)
        return dest

    async def spend(self, units: Sequence[str | Charge]) -> bool:
        """Spend ``units`` more of the budget of the state the machine is in, one per entry
        (a failover round that takes in a loss that came while it ran pays for it as if it
        had been there on entry). With fewer left, the budget's ``on_exhausted`` trigger fires
        as it would have on entry, and False is returned."""
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
        """Entering (or staying in) ``dest`` would overspend its budget (``refused`` says which
        limit): its ``on_exhausted``, with the spec's error (or CrashLoop for a slot's limit)."""
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
        self._arm(dest)
        self._wake(dest)
        for listener in self._listeners:
            listener(self, src, dest, trigger)

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
        """Write a record of this machine that changes no state (e.g. a serving member that
        now holds a newer weights version), with the machine's identity and versions."""
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
        """Wait until the machine is in one of ``states``; returns it.

        Raises the machine's recorded error (or :class:`~ftstate.core.errors.FTError`) if it lands
        in a terminal state that is not among ``states``.
        """
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
        """Bound the enclosed work by the current state's deadline.

        If the deadline expires while the work runs, the machine takes its expiry transition,
        the work is cancelled (explicitly, by the machine) and this raises the recorded
        :class:`~ftstate.core.errors.DeadlineExceeded`. Leaving the state ends the bound.
        """
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

