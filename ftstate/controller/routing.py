"""Routing, in the controller: user calls reach only workers that serve the current weights, and trainer calls
are logged for replay until the next committed sync. With fault tolerance on, a call cut short by a loss is
made again after the failover, at most ``call_retries`` times (a ``rollout_map`` shard once more, since each
retry follows a failover that spends the budget)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from ftstate.controller.calls import name_all
from ftstate.controller.membership import Member, TrainerCall
from ftstate.controller.parts import ControllerParts, Part
from ftstate.core.errors import MemberLost, NoServingWorkers, UserCodeError
from ftstate.core.protocol import UserCall, Versioned


def check_method(method: object) -> str:
    """A user method name as the public API takes it: a non-empty str not starting with ``_``."""
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise TypeError(f"method must be the name of a public method of the worker (a str), got {method!r}")
    return method


class Router(Part):
    """User calls for one runtime; ``recover`` runs pending failovers, ``settle`` waits (bounded) until
    suspects are cleared or declared lost."""

    def __init__(
        self,
        parts: ControllerParts,
        *,
        routing_open: asyncio.Event,
        recover: Callable[[], Awaitable[None]],
        settle: Callable[[], Awaitable[None]],
        failover_pending: Callable[[], bool],
        raise_if_failed: Callable[[], None],
    ) -> None:
        super().__init__(parts)
        self.routing_open = routing_open
        self.recover = recover
        self.settle = settle
        self.failover_pending = failover_pending
        self.raise_if_failed = raise_if_failed
        # Trainer calls are held while a trainer is moved ahead of time (pause_trainer).
        self._trainer_open = asyncio.Event()
        self._trainer_open.set()
        self._trainer_inflight = 0
        self._trainer_idle = asyncio.Event()
        self._trainer_idle.set()
        # User calls running on each member, and a wake-up at each end: what a removal waits on.
        self._busy: dict[str, int] = {}
        self._call_ended = asyncio.Event()

    async def rollout(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        return await self._with_failover(self._rollout_once, check_method(method), args, kwargs)

    async def trainer(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return await self._with_failover(self._trainer_once, check_method(method), args, kwargs)

    @property
    def max_lag(self) -> int:
        """How far behind the current version a rollout may be and still take calls."""
        return self.config.max_staleness if self.config.rollout_updates == "in_flight" else 0

    async def rollout_map(self, method: str, items: Sequence[Any], args: tuple[Any, ...],
                          versions: bool = False) -> list[Any]:
        """See :meth:`ftstate.Runtime.rollout_map`."""
        check_method(method)
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"items must be a sequence (a list or tuple of items to deal out), got {type(items).__name__}")
        results: list[Any] = [None] * len(items)
        todo = list(range(len(items)))
        attempts = 0
        ft = self.config.fault_tolerance
        while todo:
            self.raise_if_failed()
            await self.routing_open.wait()
            targets = self.membership.serving_rollouts(self.max_lag)
            if not targets:
                if ft.enable and self.failover_pending():
                    await self.recover()
                    continue
                raise NoServingWorkers(
                    f"no rollout serves the current weights version {self.membership.weights_version}: "
                    f"{self.membership.states_text()}"
                )
            # Fewer items than rollouts: only those dealt one are called (never with an empty shard).
            shards = {name: todo[i::len(targets)] for i, name in enumerate(targets) if todo[i::len(targets)]}
            outs = await asyncio.gather(*(
                self._user_call(self.membership.get(name), method, (*args, [items[j] for j in idx]), {},
                                versions=versions)
                for name, idx in shards.items()
            ), return_exceptions=True)
            failed: list[int] = []
            raised = {n: o for n, o in zip(shards, outs, strict=True)
                      if isinstance(o, BaseException) and not (isinstance(o, MemberLost) and ft.enable)}
            if raised:  # every rollout whose own code raised is named, not just the first
                raise name_all(list(raised.values()), list(raised))
            for (name, idx), out in zip(shards.items(), outs, strict=True):
                if isinstance(out, MemberLost) and ft.enable:
                    failed += idx
                    continue
                ran_under = None
                if isinstance(out, Versioned):
                    out, ran_under = out.value, out.versions
                if not isinstance(out, (list, tuple)) or len(out) != len(idx):
                    got = f"{len(out)} results" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
                    raise UserCodeError(name, f"{method}()", f"answered {got} for a shard of {len(idx)} items; "
                                        "expected a list with one result per item, in order")
                for j, r in zip(idx, out, strict=True):
                    results[j] = r if ran_under is None else Versioned(r, ran_under)
            if failed:
                attempts += 1
                if attempts > ft.call_retries + 1:
                    raise MemberLost(", ".join(shards), f"{method}() kept losing rollouts ({attempts} tries, "
                                                        f"at most {ft.call_retries + 1})")
                self.audit.record("call_retry", method=method, items=len(failed), attempt=attempts)
                await self.recover()
            todo = sorted(failed)
        return results

    async def _with_failover(self, fn: Any, method: str, args: Any, kwargs: Any) -> Any:
        attempts = 0
        waited_for_verdict = False
        ft = self.config.fault_tolerance
        while True:
            self.raise_if_failed()
            try:
                return await fn(method, args, kwargs)
            except MemberLost:
                attempts += 1
                if not ft.enable and not waited_for_verdict and self._trainer_suspect():
                    # Without failover a suspect trainer is cleared or declared LOST within
                    # heartbeat_timeout_s: the call is made again once, after that verdict.
                    waited_for_verdict = True
                    await self.settle()
                    continue
                if not ft.enable or attempts > ft.call_retries:
                    raise
                # A suspect worker is cleared or declared LOST within heartbeat_timeout_s: wait for that.
                await self.settle()
                await self.recover()
                self.audit.record("call_retry", method=method, attempt=attempts)

    def _trainer_suspect(self) -> bool:
        return any(m.machine.state == "SUSPECT" for m in self.membership.role("trainer"))

    async def _rollout_once(self, method: str, args: Any, kwargs: Any) -> list[Any]:
        self.raise_if_failed()
        await self.routing_open.wait()
        targets = self.membership.serving_rollouts(self.max_lag)
        if not targets:
            raise NoServingWorkers(f"no rollout serves the current weights version "
                                   f"{self.membership.weights_version}: {self.membership.states_text()}")
        outs = await asyncio.gather(*(self._user_call(self.membership.get(m), method, args, kwargs)
                                      for m in targets), return_exceptions=True)
        raised = {n: o for n, o in zip(targets, outs, strict=True) if isinstance(o, BaseException)}
        if raised:
            # A loss first (the caller's failover retry hinges on it), else every rollout that raised.
            lost = next((e for e in raised.values() if isinstance(e, MemberLost)), None)
            raise lost if lost is not None else name_all(list(raised.values()), list(raised))
        return list(outs)

    async def _trainer_once(self, method: str, args: Any, kwargs: Any) -> Any:
        self.raise_if_failed()
        await self._trainer_open.wait()
        m = self.membership.trainer()
        # A call on some ranks alone would hang in its collectives: MemberLost waits for the failover.
        ranks = self.membership.trainer_ranks(self.config.trainer_workers, "a trainer call runs on every rank")
        for r in ranks:
            if not r.machine.serving:
                # A replacement mid-failover has not got the weights yet: wait for the failover.
                raise MemberLost(r.name, f"not serving yet ({r.machine.state})",
                                 group_version=self.membership.group_version)
        self._trainer_inflight += 1
        self._trainer_idle.clear()
        try:
            if len(ranks) > 1:  # several trainer ranks: each is called (collectives), rank 0 answers
                outs = await asyncio.gather(*(self._user_call(r, method, args, kwargs, logged=True) for r in ranks),
                                            return_exceptions=True)
                errors = [o for o in outs if isinstance(o, BaseException)]
                if errors:
                    raise next((e for e in errors if isinstance(e, MemberLost)), errors[0])
                result = outs[0]
            else:
                result = await self._user_call(m, method, args, kwargs, logged=True)
            self.membership.trainer_calls.append(TrainerCall(method, tuple(args), dict(kwargs)))
        finally:
            self._trainer_inflight -= 1
            if self._trainer_inflight == 0:
                self._trainer_idle.set()
        return result

    @contextlib.asynccontextmanager
    async def pause_trainer(self) -> AsyncIterator[None]:
        """Hold new trainer calls and wait for those in flight for the block (a trainer moved ahead of time
        must replay every call); bounded by the caller's deadline."""
        self._trainer_open.clear()
        try:
            await self._trainer_idle.wait()
            yield
        finally:
            self._trainer_open.set()

    async def _user_call(self, m: Member, method: str, args: Any, kwargs: Any, *, logged: bool = False,
                         versions: bool = False) -> Any:
        """One call of the user's code on a worker. A raise changes no state but writes an ``error`` record,
        so the trail alone explains a run that ends on a user error. ``logged``: a replay-log trainer call."""
        self._busy[m.name] = self._busy.get(m.name, 0) + 1
        try:
            return await self.calls.call(m.name, m.handle, UserCall(method, tuple(args), dict(kwargs), logged,
                                                                    versions))
        except MemberLost:
            raise
        except Exception as exc:
            m.machine.record_error(exc, call=method)
            raise
        finally:
            left = self._busy.pop(m.name) - 1
            if left:
                self._busy[m.name] = left
            self._call_ended.set()

    def busy(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` with a user call running now."""
        return [n for n in names if self._busy.get(n)]

    async def calls_ended(self, names: Sequence[str]) -> None:
        """Until no user call runs on any of ``names`` (unbounded: the caller's timeout bounds it)."""
        while self.busy(names):
            self._call_ended.clear()
            await self._call_ended.wait()
