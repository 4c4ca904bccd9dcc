"""A node agent's batch of member calls in the simulation: the stream the controller reads.

:meth:`~ftstate.simulation.cluster.SimulatedCluster.calls` hands the controller an
:class:`AgentBatch` (each member's outcome as it ends, in lists) where the Ray backend hands the
real :class:`~ftstate.controller.ray.backend.LivenessAgent`'s stream; each member's call in it
answers into an :class:`AgentReply`, which settles as a future does without being one.

Runs in the simulation's one process, on its virtual clock; the agent and its members are
:class:`~ftstate.simulation.members.SimulatedMember` objects (untyped here: the members import
this module).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from ftstate.core.protocol import Request
from ftstate.simulation.collectives import Outcome, answered


class AgentBatch:
    """The members' calls of one :meth:`~ftstate.simulation.cluster.SimulatedCluster.calls`, and
    its iteration: each member's outcome as it ends, handed over in lists of those that ended
    since the last. The members are called when the iteration starts, unless the agent is dead
    or its node gone: then the first step fails as a call of the agent's would. The agent is
    lost with its node: from then on it hands nothing over (its members' outcomes stay with
    it), and its death, once its node is declared dead, fails the batch with ``ActorDied``, as
    a real agent's reply does."""

    __slots__ = ("agent", "calls", "ended", "left", "loop", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop, agent: Any, handles: Sequence[Any],
                 requests: Sequence[Request]) -> None:
        self.loop = loop
        self.agent = agent
        self.left = len(handles)
        self.ended: list[tuple[int, Any]] = []
        self.wake: asyncio.Future[None] | None = None
        #: The members' calls, made at the first step (None once made).
        self.calls: tuple[Any, ...] | None = (handles, requests)

    def reply(self, j: int) -> AgentReply:
        """Where the ``j``-th member's call answers."""
        return AgentReply(self, j)

    def _call_members(self, handles: Sequence[Any], requests: Sequence[Request]) -> None:
        """The agent calls its members, on its node (the agent's work, as :meth:`_ended`, its
        collecting of their outcomes: the rest of the batch is the stream the controller reads)."""
        for j, (h, req) in enumerate(zip(handles, requests, strict=True)):
            h.answer(req.method, (req,), None, self.reply(j))

    def _ended(self, j: int, outcome: Any) -> None:
        self.ended.append((j, outcome))
        if self.wake is not None and not self.wake.done() and not self.agent.cut_off:
            self.wake.set_result(None)

    def __aiter__(self) -> AgentBatch:
        return self

    async def __anext__(self) -> list[tuple[int, Any]]:
        """The outcomes that ended since the last step, waiting for one if none did."""
        if self.calls is not None:
            calls, self.calls = self.calls, None
            if not self.agent.alive or self.agent.cut_off:
                await self.agent.answer("ready", (), None)  # dead, or its node gone: fails as such a call does
            self._call_members(*calls)
        if not self.left:
            raise StopAsyncIteration
        while not self.ended or self.agent.cut_off:
            self.wake = self.loop.create_future()
            self.agent.pending[self.wake] = None  # failed with ActorDied when the agent dies
            try:
                await self.wake
            finally:
                self.agent.pending.pop(self.wake, None)
                self.wake = None
        ended, self.ended = self.ended, []
        self.left -= len(ended)
        return ended

    async def aclose(self) -> None:
        """The caller stopped iterating: outcomes still to come stay with the agent."""
        self.calls = None


class AgentReply:
    """A member's call made through its node's agent, settled as a future is (by the member's
    answer, its death, a broken collective) and its outcome handed to the batch as it is.
    Not an ``asyncio.Future``: nobody awaits it, and a future each, with the batch's callback
    on it, was three objects for each call in flight (10,000 through a sync) and a loop pass
    for each answer. Done-callbacks (a collective's) still run as a future's do, soon after."""

    __slots__ = ("_callback", "_context", "_done", "_member", "_more", "_outcome", "batch", "j")

    def __init__(self, batch: AgentBatch, j: int) -> None:
        self.batch = batch
        self.j = j
        self._done = False
        self._member: Any = None
        self._outcome: Outcome | None = None
        # the first done-callback in two slots (a collective's: the only one there usually is),
        # any further ones in a list
        self._callback: Callable[[Any], Any] | None = None
        self._context: Any = None
        self._more: list[tuple[Callable[[Any], Any], Any]] | None = None

    def answer_at(self, member: Any, outcome: Outcome) -> bool:
        """``member`` answers with ``outcome`` when this reply is called (its answer's timer);
        False (nothing taken) if an answer is already on its way."""
        if self._member is not None:
            return False
        self._member, self._outcome = member, outcome
        return True

    def __call__(self) -> None:
        member, outcome = self._member, self._outcome
        self._member = self._outcome = None
        if member is not None and outcome is not None:
            answered(member, self, outcome)  # type: ignore[arg-type]

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, value: Any) -> None:
        self._end(value)

    def set_exception(self, exc: BaseException) -> None:
        self._end(exc)

    def _end(self, outcome: Any) -> None:
        if self._done:
            raise asyncio.InvalidStateError(f"the call of member {self.j} of the batch already ended")
        self._done = True
        self.batch._ended(self.j, outcome)
        if self._callback is not None:
            self.batch.loop.call_soon(self._callback, self, context=self._context)
            self._callback = self._context = None
        for callback, context in self._more or ():
            self.batch.loop.call_soon(callback, self, context=context)
        self._more = None

    def add_done_callback(self, callback: Callable[[Any], Any], *, context: Any = None) -> None:
        if self._done:
            self.batch.loop.call_soon(callback, self, context=context)
        elif self._callback is None:
            self._callback, self._context = callback, context
        elif self._more is None:
            self._more = [(callback, context)]
        else:
            self._more.append((callback, context))


__all__ = ["AgentBatch", "AgentReply"]
