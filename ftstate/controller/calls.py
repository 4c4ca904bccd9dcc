"""Actor calls, in the controller: the one place every call to a worker goes through, so no failure is lost to
a call site that catches only part of them. A dead actor becomes a ``died`` event and
:class:`~ftstate.core.errors.MemberLost`; an unreachable one or a timeout becomes ``MemberLost`` with no state
change (the watchdog judges); an ftstate error raised in the worker is re-raised as itself; any other (user)
exception keeps its class, gains the member's name and notes naming the user's method and frames, and never
surfaces as Ray's ``RayTaskError``."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, Protocol

from ftstate.controller.backend import (
    QUIET,
    ActorDied,
    ActorUnreachable,
    CallTimedOut,
    ClusterBackend,
    RemoteError,
)
from ftstate.core.errors import (
    ChecksumMismatch,
    EngineProcessDied,
    FTError,
    ManifestError,
    MemberLost,
    PeerLost,
    TransportError,
)
from ftstate.core.liveness import Heartbeat
from ftstate.core.protocol import Beat, Request, UserCall
from ftstate.core.text import bounded, clean

#: What a backend reports a member's call ended in, other than its result.
_SEAM_ERRORS = (ActorDied, ActorUnreachable, RemoteError, CallTimedOut)


class CallTarget(Protocol):
    """Whom :meth:`ActorCalls.fan_out` calls: name, actor handle and node id (None: not known yet)."""

    @property
    def name(self) -> str: ...
    @property
    def handle(self) -> Any: ...
    @property
    def node_id(self) -> str | None: ...


class ActorCalls:
    """Routes calls to worker actors and reports deaths; ``on_died(member, reason)`` is called once per member
    whose process the backend says is gone."""

    def __init__(self, on_died: Callable[[str, str], Any], backend: ClusterBackend, *,
                 agent_min_members: int = 4) -> None:
        self._on_died = on_died
        self._backend = backend
        self._reported: set[str] = set()
        #: :meth:`fan_out` goes through a node's agent for at least this many members there (0: never).
        self.agent_min_members = agent_min_members

    async def call(self, member: str, handle: Any, req: Request, *, timeout: float | None = None) -> Any:
        """Send ``req`` to the member's actor; ``timeout`` (seconds) bounds only this call (heartbeats use it;
        everything else is bounded by its state's deadline)."""
        try:
            return await self._backend.call(handle, req, timeout)
        except (ActorDied, ActorUnreachable, RemoteError, CallTimedOut) as exc:
            await self._raise_for(member, req.method, _what(req), exc, timeout)

    async def call_helper(self, name: str, handle: Any, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method(*args)`` on a helper actor, its outcomes translated as a worker call's."""
        try:
            return await self._backend.call_helper(handle, method, args, timeout)
        except (ActorDied, ActorUnreachable, RemoteError, CallTimedOut) as exc:
            await self._raise_for(name, method, f"{method}()", exc, timeout)

    def through_agent(self, members: int) -> bool:
        """Whether ``members`` members of one known node go through its agent (never a lone member)."""
        return self.agent_min_members != 0 and members >= max(self.agent_min_members, 2)

    async def heartbeats(self, node_id: str, members: Sequence[str], handles: Sequence[Any],
                         args: Sequence[Beat], timeout: float, *, mark: int | None = None,
                         since: int | None = None) -> Any:
        """One heartbeat of each of ``members`` on ``node_id`` through its agent: each answer, or the error
        :meth:`call` would raise. An unreachable agent makes every member there unreachable for now; None
        means ask each member directly; :data:`~ftstate.controller.backend.QUIET` when nothing changed since
        ``since``. Split in :meth:`ask_heartbeats` and :meth:`heartbeat_answers`."""
        reply = self.ask_heartbeats(node_id, handles, args, timeout, mark=mark, since=since)
        with contextlib.suppress(Exception):  # the reply's error is read by heartbeat_answers
            await reply
        return await self.heartbeat_answers(members, args, timeout, since, reply)

    def ask_heartbeats(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                       timeout: float, *, mark: int | None = None, since: int | None = None) -> asyncio.Future[Any]:
        """Start :meth:`heartbeats`' agent call: the future of its reply (failed if it could not be asked)."""
        try:
            return self._backend.heartbeats_future(node_id, handles, args, timeout, mark=mark, since=since)
        except Exception as exc:  # noqa: BLE001 - the call's outcome: heartbeat_answers reads it
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def heartbeat_answers(self, members: Sequence[str], args: Sequence[Beat], timeout: float,
                                since: int | None, reply: asyncio.Future[Any]) -> Any:
        """What :meth:`heartbeats` returns for ``reply``, the done future of :meth:`ask_heartbeats`."""
        try:
            outcomes: Any = reply.result()
        except ActorUnreachable as exc:
            outcomes = [exc] * len(members)
        except (ActorDied, RemoteError, CallTimedOut):
            return None
        if outcomes is QUIET:
            return QUIET if since is not None else None  # quiet, unasked: a bug; ask directly
        if not isinstance(outcomes, list) or len(outcomes) != len(members):
            return None  # not an answer for each member (a bug): ask each directly
        out = list(outcomes)
        for j, outcome in enumerate(out):
            # an answer is a Heartbeat: one type check for each (10,000 a round), the four only for the rest
            if type(outcome) is not Heartbeat and isinstance(outcome, _SEAM_ERRORS):
                try:
                    await self._raise_for(members[j], "heartbeat", "heartbeat()", outcome, timeout)
                except Exception as exc:  # noqa: BLE001 - the member's own outcome, handed back
                    out[j] = exc
        return out

    async def fan_out(self, targets: Sequence[CallTarget], requests: Sequence[Request],
                      on_end: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``requests[i]`` to each of ``targets`` at once; returns each outcome (result or the error
        :meth:`call` would raise) in order, calling ``on_end(i, outcome)`` as each ends. Members of a node
        with at least :attr:`agent_min_members` go through its agent in one call, which keeps a large sync's
        calls in flight few; a failed agent leaves its unreported members unreachable (their vigils report
        deaths)."""
        out: list[Any] = [None] * len(targets)
        by_node: dict[str | None, list[int]] = {}
        for i, t in enumerate(targets):
            by_node.setdefault(t.node_id, []).append(i)
        jobs: list[Awaitable[None]] = []
        for node, idx in by_node.items():
            if node is None or not self.through_agent(len(idx)):
                jobs.extend(self._direct(i, targets, requests, out, on_end) for i in idx)
            else:
                jobs.append(self._through_agent(node, idx, targets, requests, out, on_end))
        await asyncio.gather(*jobs)
        return out

    async def _direct(self, i: int, targets: Sequence[CallTarget], requests: Sequence[Request], out: list[Any],
                      on_end: Callable[[int, Any], None] | None) -> None:
        target = targets[i]
        try:
            outcome = await self.call(target.name, target.handle, requests[i])
        except Exception as exc:  # noqa: BLE001 - the member's own outcome, handed back
            outcome = exc
        out[i] = outcome
        if on_end is not None:
            on_end(i, outcome)

    async def _through_agent(self, node: str, idx: list[int], targets: Sequence[CallTarget],
                             requests: Sequence[Request], out: list[Any],
                             on_end: Callable[[int, Any], None] | None) -> None:
        left = [True] * len(idx)  # not reported yet, by position in the node's batch
        stream = self._backend.calls(node, *_picked(idx, targets, requests))
        try:
            try:
                async for ended in stream:
                    for j, outcome in ended:
                        left[j] = False
                        i = idx[j]
                        if isinstance(outcome, _SEAM_ERRORS):
                            outcome = await self._translated(i, outcome, targets, requests)
                        out[i] = outcome
                        if on_end is not None:
                            on_end(i, outcome)
            finally:  # as contextlib.aclosing, without its two objects a node's call keeps alive
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        except (ActorDied, ActorUnreachable, RemoteError, CallTimedOut) as exc:
            if isinstance(exc, CallTimedOut) and all(left):  # the agent is not up: nobody was called
                await self._each_direct(idx, targets, requests, out, on_end)
                return
            lost = ActorUnreachable(f"the agent of node {node[:8]} failed: {_first_line(exc)}")
            for j, i in enumerate(idx):
                if left[j]:
                    out[i] = await self._translated(i, lost, targets, requests)
                    if on_end is not None:
                        on_end(i, out[i])

    async def _each_direct(self, idx: list[int], targets: Sequence[CallTarget], requests: Sequence[Request],
                           out: list[Any], on_end: Callable[[int, Any], None] | None) -> None:
        # A method of its own: an inline generator would make its variables cells of every node's call.
        await asyncio.gather(*(self._direct(i, targets, requests, out, on_end) for i in idx))

    async def _translated(self, i: int, exc: Exception, targets: Sequence[CallTarget],
                          requests: Sequence[Request]) -> Exception:
        """What :meth:`call` would have raised for member ``i`` whose call ended in ``exc``."""
        try:
            await self._raise_for(targets[i].name, requests[i].method, _what(requests[i]), exc, None)
        except Exception as raised:  # noqa: BLE001 - the member's own outcome, handed back
            return raised
        raise AssertionError("unreachable")  # pragma: no cover - _raise_for always raises

    async def _raise_for(self, member: str, method: str, what: str, exc: Exception,
                         timeout: float | None) -> NoReturn:
        """Raise what the backend's outcome ``exc`` of ``method`` on ``member`` means; ``what``: the method
        the user knows it by."""
        if isinstance(exc, ActorDied):
            reason = f"process died during {method}(): {_first_line(exc)}"
            await self._report(member, reason)
            raise MemberLost(member, reason) from exc
        if isinstance(exc, ActorUnreachable):
            raise MemberLost(member, f"unreachable during {method}(): {_first_line(exc)}") from exc
        if isinstance(exc, RemoteError):
            cause = exc.cause
            if isinstance(cause, EngineProcessDied) or (method == "vigil" and isinstance(cause, FTError)):
                # The worker declared itself lost (an engine process died): a death, reported now.
                await self._report(member, f"{method}(): {_first_line(cause)}")
            if isinstance(cause, FTError):
                raise _naming(member, cause) from exc
            named = _worker_exception(member, what, cause)  # type: ignore[arg-type]
            with contextlib.suppress(AttributeError, TypeError):
                named.remote_traceback = bounded(clean(exc.text), 20000)  # type: ignore[attr-defined]
            raise named from None
        within = f" within {timeout:g}s" if timeout is not None else ""
        raise MemberLost(member, f"no answer to {method}(){within}") from exc

    async def _report(self, member: str, reason: str) -> None:
        if member in self._reported:
            return
        self._reported.add(member)
        result = self._on_died(member, reason)
        if asyncio.iscoroutine(result):
            await result


def _picked(idx: list[int], targets: Sequence[CallTarget],
            requests: Sequence[Request]) -> tuple[list[Any], list[Request]]:
    """The handles and requests of members ``idx`` (a function, so the awaiting coroutine keeps no cells)."""
    return [targets[i].handle for i in idx], [requests[i] for i in idx]


def _naming(member: str, exc: FTError) -> FTError:
    """The worker's error with the member's name in front, for classes whose only argument is the message."""
    if type(exc) in (TransportError, PeerLost, ChecksumMismatch, ManifestError, FTError) and member not in str(exc):
        named = copy.copy(exc)  # keeps the structured fields (PeerLost.peer, ManifestError.field…)
        named.args = (f"{member}: {exc}",)
        return named
    return exc


def _what(req: Request) -> str:
    """The method a request's error is named by: the user's own for a user call."""
    return f"{req.name}()" if isinstance(req, UserCall) else f"{req.method}()"


def _worker_exception(member: str, called: str, exc: Exception) -> Exception:
    """The worker's own exception, named and cleaned, with notes naming the user's method, where it raised,
    and the user's frames (:func:`ftstate.worker.host.mark_user_error`)."""
    what = getattr(exc, "ftstate_method", None) or called
    where = getattr(exc, "ftstate_where", "")
    frames = getattr(exc, "ftstate_frames", "")
    named: Exception = exc
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0] if member in exc.args[0] else f"{member}: {exc.args[0]}"
        with contextlib.suppress(Exception):  # an exotic class that cannot be copied keeps its text
            copied = copy.copy(exc)
            copied.args = (bounded(clean(text), 4000),)
            named = copied
    at = f", at {where}" if where else ""
    named.add_note(f"raised by {what} in ftstate worker {member}{at}")
    if frames:
        named.add_note(f"the user's frames (innermost last):\n{frames.rstrip()}")
    return named


def name_all(errors: Sequence[BaseException], members: Sequence[str]) -> BaseException:
    """One error for several members whose user code raised in the same step: the first, naming every member,
    with a note per other member's exception."""
    first = errors[0]
    if len(errors) == 1:
        return first
    others = [f"{m}: {type(e).__name__}: {_first_line(e)}" for m, e in zip(members[1:], errors[1:], strict=True)]
    if len(first.args) == 1 and isinstance(first.args[0], str):
        with contextlib.suppress(Exception):
            first.args = (f"{first.args[0]} (also raised by {', '.join(members[1:])})",)
    first.add_note("the others that raised: " + "; ".join(others))
    return first


def _first_line(exc: BaseException) -> str:
    text = clean(str(exc)).strip().splitlines()
    return bounded(text[0], 1000) if text else type(exc).__name__
