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
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ftstate.controller.backend import ActorDied, ActorUnreachable, CallTimedOut, ClusterBackend, RemoteError
from ftstate.core.errors import ChecksumMismatch, FTError, ManifestError, MemberLost, PeerLost, TransportError
from ftstate.core.text import bounded, clean


class ActorCalls:
    """Routes calls to worker actors and reports deaths.

    backend: the cluster the actors run on (:mod:`~ftstate.controller.backend`); on_died:
    called once per member with (member, reason) when the backend says its process is gone;
    the runtime fires the worker's ``died`` event from it.
    """

    def __init__(self, on_died: Callable[[str, str], Any], backend: ClusterBackend) -> None:
        self._on_died = on_died
        self._backend = backend
        self._reported: set[str] = set()

    async def call(self, member: str, handle: Any, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method`` on the actor; ``timeout`` (seconds) bounds only this call (heartbeat
        polls use it; everything else is bounded by its state's deadline)."""
        try:
            return await self._backend.call(handle, method, args, timeout)
        except (ActorDied, ActorUnreachable, RemoteError, CallTimedOut) as exc:
            await self._raise_for(member, method, args, exc, timeout)

    async def heartbeats(self, node_id: str, members: Sequence[str], handles: Sequence[Any],
                         args: Sequence[tuple[Any, ...]], timeout: float) -> list[Any] | None:
        """One heartbeat of each of ``members`` (names; their ``handles``, all on node ``node_id``)
        through the node's agent (:meth:`~ftstate.controller.backend.ClusterBackend.heartbeats`):
        each member's answer, or the error :meth:`call` would have raised for it (a death
        reported as there). An unreachable agent means its node does not answer: every member
        there is unreachable for now (the watchdog judges from repeated evidence, as for a
        direct call). None when the agent could not answer otherwise (gone, starting, a bug):
        ask each member directly."""
        try:
            outcomes: list[Any] = await self._backend.heartbeats(node_id, handles, args, timeout)
        except ActorUnreachable as exc:
            outcomes = [exc] * len(members)
        except (ActorDied, RemoteError, CallTimedOut):
            return None
        out: list[Any] = []
        for member, a, outcome in zip(members, args, outcomes, strict=True):
            if isinstance(outcome, (ActorDied, ActorUnreachable, RemoteError, CallTimedOut)):
                try:
                    await self._raise_for(member, "heartbeat", a, outcome, timeout)
                except Exception as exc:  # noqa: BLE001 - the member's own outcome, handed back
                    outcome = exc
            out.append(outcome)
        return out

    async def _raise_for(self, member: str, method: str, args: tuple[Any, ...], exc: Exception,
                         timeout: float | None) -> NoReturn:
        """Raise what the backend's outcome ``exc`` of ``method`` on ``member`` means (the module docstring)."""
        if isinstance(exc, ActorDied):
            reason = f"process died during {method}(): {_first_line(exc)}"
            await self._report(member, reason)
            raise MemberLost(member, reason) from exc
        if isinstance(exc, ActorUnreachable):
            raise MemberLost(member, f"unreachable during {method}(): {_first_line(exc)}") from exc
        if isinstance(exc, RemoteError):
            cause = exc.cause
            if isinstance(cause, FTError):
                raise _naming(member, cause) from exc
            named = _worker_exception(member, method, args, cause)  # type: ignore[arg-type]
            with contextlib.suppress(AttributeError, TypeError):
                named.remote_traceback = bounded(clean(exc.text), 20000)  # type: ignore[attr-defined]
            raise named from None
        raise MemberLost(member, f"no answer to {method}() within {timeout:g}s") from exc

    async def _report(self, member: str, reason: str) -> None:
        if member in self._reported:
            return
        self._reported.add(member)
        result = self._on_died(member, reason)
        if asyncio.iscoroutine(result):
            await result


def _naming(member: str, exc: FTError) -> FTError:
    """The worker's error with the member's name in front (transport errors inside a worker
    only know their rank), for the classes whose only argument is the message."""
    if type(exc) in (TransportError, PeerLost, ChecksumMismatch, ManifestError, FTError) and member not in str(exc):
        named = copy.copy(exc)  # keeps the structured fields (PeerLost.peer, ManifestError.field…)
        named.args = (f"{member}: {exc}",)
        return named
    return exc


def _worker_exception(member: str, method: str, args: tuple[Any, ...], exc: Exception) -> Exception:
    """The worker's own exception, named: same class, message prefixed with the member (when
    the class keeps its message as its only argument, as nearly all do) and cleaned of
    terminal escapes, a note naming the user's method that raised it and where, and a note
    with the user's frames (what the host marked, :func:`ftstate.controller.host.mark_user_error`)."""
    what = getattr(exc, "ftstate_method", None) or (
        f"{args[0]}()" if method == "call" and args and isinstance(args[0], str) else f"{method}()")
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
