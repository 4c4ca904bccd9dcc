"""Actor calls: the one place every call from the controller to a worker goes through.

The cluster reports a worker's failure as an exception on whatever call was pending when it
happened. Letting each call site catch its own subset would lose some of them, so every
call goes through :meth:`ActorCalls.call`, which asks the cluster's backend
(:mod:`~ftstate.controller.backend`: Ray, or the simulation) and turns what it reports

- :class:`~ftstate.controller.backend.ActorDied` (the process is gone: SIGKILL, OOM, node
  lost) into a ``died`` event on the worker's machine and a
  :class:`~ftstate.core.errors.MemberLost` for the caller;
- :class:`~ftstate.controller.backend.ActorUnreachable` (unreachable for now) and an expired
  ``timeout`` into
  :class:`~ftstate.core.errors.MemberLost` without a state change: the heartbeat watchdog decides
  whether an unreachable worker is suspect or lost, from repeated evidence;
- an ftstate error raised inside the worker (``PeerLost``, ``ChecksumMismatch``…) back into
  that error, so callers catch ftstate's classes, never Ray's wrappers;
- any other exception raised inside the worker (the user's code, a library it needs) back
  into itself: its own class and message, prefixed with the member's name, with a note
  naming the user's method that raised it (``MyRollout.load_weights()``, not ftstate's
  internal call) and the frame in the user's file, and the user's own frames as a second
  note. Ray's coloured remote traceback is not chained (it would print first, ftstate's
  frames and ANSI escapes before the user's line); it is kept, cleaned, as
  ``remote_traceback``. Never a bare ``RayTaskError``.

Every message made here has its terminal escapes removed (:func:`ftstate.core.text.clean`).

Detection latency for a SIGKILLed worker with a call pending is Ray's (~10-20 ms here);
an idle one is found by the next heartbeat poll.
"""

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
    """Whom :meth:`ActorCalls.fan_out` calls: a member's name, its actor handle and its node's
    id (None: not known yet). The membership's :class:`~ftstate.controller.membership.Member`
    is one."""

    @property
    def name(self) -> str: ...
    @property
    def handle(self) -> Any: ...
    @property
    def node_id(self) -> str | None: ...


class ActorCalls:
    """Routes calls to worker actors and reports deaths.

    backend: the cluster the actors run on (:mod:`~ftstate.controller.backend`); on_died:
    called once per member with (member, reason) when the backend says its process is gone;
    the runtime fires the worker's ``died`` event from it.
    """

    def __init__(self, on_died: Callable[[str, str], Any], backend: ClusterBackend, *,
                 agent_min_members: int = 4) -> None:
        self._on_died = on_died
        self._backend = backend
        self._reported: set[str] = set()
        #: :meth:`fan_out` goes through a node's agent for at least this many members there
        #: (``heartbeat_agent_min_members``; 0: never).
        self.agent_min_members = agent_min_members

    async def call(self, member: str, handle: Any, req: Request, *, timeout: float | None = None) -> Any:
        """Send ``req`` to the member's actor (its :class:`~ftstate.core.protocol.WorkerAPI` method);
        ``timeout`` (seconds) bounds only this call (heartbeat polls use it; everything else is
        bounded by its state's deadline)."""
        try:
            return await self._backend.call(handle, req, timeout)
        except (ActorDied, ActorUnreachable, RemoteError, CallTimedOut) as exc:
            await self._raise_for(member, req.method, _what(req), exc, timeout)

    async def call_helper(self, name: str, handle: Any, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method(*args)`` on one of ftstate's own helper actors (a node's copy agent),
        its outcomes translated as a worker call's are."""
        try:
            return await self._backend.call_helper(handle, method, args, timeout)
        except (ActorDied, ActorUnreachable, RemoteError, CallTimedOut) as exc:
            await self._raise_for(name, method, f"{method}()", exc, timeout)

    def through_agent(self, members: int) -> bool:
        """Whether ``members`` members of one known node are called through its agent: at least
        :attr:`agent_min_members` of them, a lone member never (0: never)."""
        return self.agent_min_members != 0 and members >= max(self.agent_min_members, 2)

    async def heartbeats(self, node_id: str, members: Sequence[str], handles: Sequence[Any],
                         args: Sequence[Beat], timeout: float, *, mark: int | None = None,
                         since: int | None = None) -> Any:
        """One heartbeat of each of ``members`` (names; their ``handles``, all on node ``node_id``)
        through the node's agent (:meth:`~ftstate.controller.backend.ClusterBackend.heartbeats`):
        each member's answer, or the error :meth:`call` would have raised for it (a death
        reported as there). An unreachable agent means its node does not answer: every member
        there is unreachable for now (the watchdog judges from repeated evidence, as for a
        direct call). None when the agent could not answer otherwise (gone, starting, a bug):
        ask each member directly. :data:`~ftstate.controller.backend.QUIET` (only when ``since``
        was given): every answer equal to that of the reply marked ``since``.

        The two halves, for a caller that waits on many nodes without a task each (the
        watchdog's round): :meth:`ask_heartbeats`, then :meth:`heartbeat_answers` of its reply."""
        reply = self.ask_heartbeats(node_id, handles, args, timeout, mark=mark, since=since)
        with contextlib.suppress(Exception):  # the reply's error is read by heartbeat_answers
            await reply
        return await self.heartbeat_answers(members, args, timeout, since, reply)

    def ask_heartbeats(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                       timeout: float, *, mark: int | None = None, since: int | None = None) -> asyncio.Future[Any]:
        """:meth:`heartbeats`' call of the agent, started: the future of the agent's reply
        (:meth:`~ftstate.controller.backend.ClusterBackend.heartbeats_future`), failed with the
        backend's error if it could not even be asked."""
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
        """``requests[i]`` to each member of ``targets`` (:class:`CallTarget`),
        all at once; returns each one's outcome in order: its result, or the error :meth:`call`
        would have raised for it (deaths reported as there). ``on_end(i, outcome)`` is called as
        each ends, in the order they end.

        The members of a node with at least :attr:`agent_min_members` of them (a lone member
        excepted) are called through that node's agent, in one call
        (:meth:`~ftstate.controller.backend.ClusterBackend.calls`), which reports each member's
        outcome as it ends; the others, and those of a node whose agent is not up, directly. At
        thousands of members this is what keeps a sync's calls in flight few (one a node, not
        one a member: each call in flight is a task, coroutines and contexts that the collector
        scans and promotes; docs/benchmarks.md, "Controller at scale"). An agent that fails
        while its members' calls are under way (dead, its node unreachable) leaves those not yet
        reported unreachable (:class:`~ftstate.core.errors.MemberLost`, no state change): a
        death among them is reported by the member's own vigil (:mod:`~ftstate.controller.vigil`)."""
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
        # Its own method, not an inline generator in _through_agent: a generator there makes
        # every variable it reads a cell of every call of _through_agent (six a node, a sync's
        # fan-outs at 1,250 nodes: 30,000 objects for the collector), used or not.
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
        """Raise what the backend's outcome ``exc`` of ``method`` on ``member`` means (the module
        docstring); ``what``: the method the user knows it by, for an error their code raised."""
        if isinstance(exc, ActorDied):
            reason = f"process died during {method}(): {_first_line(exc)}"
            await self._report(member, reason)
            raise MemberLost(member, reason) from exc
        if isinstance(exc, ActorUnreachable):
            raise MemberLost(member, f"unreachable during {method}(): {_first_line(exc)}") from exc
        if isinstance(exc, RemoteError):
            cause = exc.cause
            if isinstance(cause, EngineProcessDied) or (method == "vigil" and isinstance(cause, FTError)):
                # the worker declared itself lost (an engine process of its own died): a death,
                # reported now, not at the heartbeat deadline
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
    """The handles and requests of the members ``idx``. A function of its own: the
    comprehensions in the coroutine that awaits the node's stream would make what they read
    cells of it, alive (and promoted) as long as the node's calls are."""
    return [targets[i].handle for i in idx], [requests[i] for i in idx]


def _naming(member: str, exc: FTError) -> FTError:
    """The worker's error with the member's name in front (transport errors inside a worker
    only know their rank), for the classes whose only argument is the message."""
    if type(exc) in (TransportError, PeerLost, ChecksumMismatch, ManifestError, FTError) and member not in str(exc):
        named = copy.copy(exc)  # keeps the structured fields (PeerLost.peer, ManifestError.field…)
        named.args = (f"{member}: {exc}",)
        return named
    return exc


def _what(req: Request) -> str:
    """The method a request's error is named by: the user's own for a user call."""
    return f"{req.name}()" if isinstance(req, UserCall) else f"{req.method}()"


def _worker_exception(member: str, called: str, exc: Exception) -> Exception:
    """The worker's own exception, named: same class, message prefixed with the member (when
    the class keeps its message as its only argument, as nearly all do) and cleaned of
    terminal escapes, a note naming the user's method that raised it and where, and a note
    with the user's frames (what the host marked, :func:`ftstate.worker.host.mark_user_error`)."""
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
    """One error for several members whose user code raised in the same step (every rollout's
    ``load_weights``): the first, its message naming every member that raised and a note per
    other member with its own exception."""
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
