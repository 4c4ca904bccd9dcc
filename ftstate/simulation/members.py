"""Simulated worker hosts: the calls the controller makes of a
:class:`~ftstate.worker.host.WorkerHost`, answered after their modelled cost.

A :class:`SimulatedMember` keeps what a real host keeps that the controller can see: the
weights version and checksum it holds committed, a staged version, the group version and rank
it joined, a progress counter that moves while it transfers, whether it is busy. Each call
returns a future that the member settles at a time of the virtual clock (one entry per call on
the cluster's :class:`~ftstate.simulation.clock.TimerQueue`, no task each; a call made through
its node's agent answers into the agent's batch, an :class:`AgentReply`, not a future):

- ``info`` / ``prewarm`` answer once the process is up (``Costs.start_s`` after its start);
- ``join`` waits in the rendezvous store until every rank of the version registered (or the
  version is fenced: ``StaleGroupVersion``, as the real store says), then ``Costs.group_form_s``;
- ``send_weights`` / ``receive_weights`` are one :class:`Collective` of every rank of the group
  version (a rank that never calls, because it hangs, blocks the others, as a real broadcast
  does); ``send_weights_to`` / ``receive_weights_from`` one of two;
- a member that dies fails its pending calls with ``ActorDied`` after ``Costs.death_detect_s``,
  and every collective it was in, or that its group version has waiting for it, with
  ``PeerLost`` for the others; a hung member answers
  nothing (calls with a ``timeout`` end in ``CallTimedOut``), a vigil stays pending until death;
  a member whose node was lost answers nothing either, and new calls to it fail as unreachable,
  until Ray would declare the node dead (then it dies), as measured on a real 3-node cluster
  (docs/benchmarks.md, "Node loss").

Checksums are names of versions (``sim-v7``): what the controller compares is only whether two
members hold the same version, and that is what they say.
"""

from __future__ import annotations

import asyncio
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from ftstate.controller.backend import (
    QUIET,
    QUIET_WIRE,
    ActorDied,
    ActorUnreachable,
    AgentMemory,
    CallTimedOut,
    RemoteError,
)
from ftstate.core.errors import (
    CommunicatorAborted,
    PeerLost,
    ProtocolError,
    RendezvousTimeout,
    StaleGroupVersion,
)
from ftstate.core.liveness import Heartbeat
from ftstate.core.protocol import (
    Abandon,
    Beat,
    CallCounts,
    CallsSinceCommit,
    Checksum,
    Commit,
    Discard,
    DiscardShards,
    Info,
    Join,
    Joined,
    JoinTrainerGroup,
    Loaded,
    Located,
    NoteWeights,
    PartChecksum,
    PartHeld,
    PartLoaded,
    PartSent,
    Prepared,
    PrepareShards,
    Prewarm,
    ReceiveFrom,
    ReceivePart,
    ReceiveShards,
    ReceiveWeights,
    Request,
    ReserveStaging,
    SendPart,
    SendShards,
    SendTo,
    SendWeights,
    Sent,
    SentTo,
    Staged,
    TrainerChecksum,
    UserCall,
    Vigil,
)


def checksum_of(weights_version: int) -> str:
    """The checksum a simulated member reports for ``weights_version``."""
    return f"sim-v{weights_version}"


#: A member's calls kept for its death to fail are pruned of those that ended at this many.
_PRUNE_AT = 16


#: A call's outcome, made when it is answered: a function of no arguments, or ``(function,
#: *arguments)`` (one tuple where a bound method and a partial were two objects for each call
#: in flight: 10,000 of them through a sync, which the collector promotes and walks).
Outcome = Callable[[], Any] | tuple[Any, ...]


def _settle(fut: asyncio.Future[Any], outcome: Outcome) -> None:
    if fut.done():
        return
    try:
        fut.set_result(outcome[0](*outcome[1:]) if type(outcome) is tuple else outcome())  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the outcome is the call's answer: an error is one too
        fut.set_exception(exc)


def _answered(member: SimulatedMember, fut: asyncio.Future[Any], outcome: Outcome) -> None:
    """``fut`` of ``member`` settled with its ``outcome`` (a module function, not a bound method
    made for each call in flight)."""
    member._pending.pop(fut, None)  # answered: no death can fail it any more
    _settle(fut, outcome)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _time_out(fut: asyncio.Future[Any], timeout: float) -> None:
    if not fut.done():
        fut.set_exception(CallTimedOut(f"no answer within {timeout:g}s"))


def _forget(collectives: list[Collective], c: Collective) -> None:
    if c in collectives:
        collectives.remove(c)


class Collective:
    """One collective of ``expected`` participants (a broadcast, a point-to-point transfer, a
    rendezvous): it starts when all arrived and ends ``cost_s`` later; one that leaves first
    (died, abandoned, cancelled) breaks it and the others fail with ``PeerLost``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, what: str, expected: int, cost_s: float,
                 detect_s: float, on_finish: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self.on_finish = on_finish
        self.what = what
        self.expected = expected
        self.cost_s = cost_s
        self.detect_s = detect_s
        self.arrivals: dict[int, tuple[SimulatedMember, asyncio.Future[Any], Outcome]] = {}
        self.started_at: float | None = None
        self.broken: str | None = None
        self._by_future: dict[asyncio.Future[Any], SimulatedMember] = {}
        self._on_done: Callable[[asyncio.Future[Any]], None] | None = None

    def arrive(self, rank: int, member: SimulatedMember, fut: asyncio.Future[Any], outcome: Outcome) -> None:
        if self.broken is not None:
            member.cluster.timers.call_at(self.loop.time() + self.detect_s, _fail, fut, self._peer_lost(member, self.broken))
            return
        self.arrivals[rank] = (member, fut, outcome)
        self._by_future[fut] = member
        member.collectives.append(self)
        member.changes.count += 1  # busy now (and an answer that was busy is not kept as steady)
        # one bound method for every arrival, in the shared context, not a closure each in a
        # copied one: thousands of arrivals live as long as the transfer, promoted and walked by
        # the collector
        if self._on_done is None:
            self._on_done = self._ended
        fut.add_done_callback(self._on_done, context=member.cluster.context)
        if len(self.arrivals) == self.expected:
            self.started_at = self.loop.time()
            member.cluster.timers.call_at(self.started_at + self.cost_s, self._finish)

    def _finish(self) -> None:
        if self.broken is not None:
            return
        if self.on_finish is not None:
            self.on_finish()
        for member, fut, outcome in list(self.arrivals.values()):
            _forget(member.collectives, self)
            member.answer_later(fut, outcome)
        # Answered: what the arrivals held is the answers' now (a finished rendezvous stays in
        # its store until the next version fences it; 10,000 arrivals kept alive that long were
        # walked by every collection of the collector meanwhile). Their ranks stay.
        self.arrivals = dict.fromkeys(self.arrivals)  # type: ignore[arg-type]
        self._by_future.clear()

    def _ended(self, fut: asyncio.Future[Any]) -> None:
        member = self._by_future.get(fut)
        if member is not None:  # None: finished, each member's part done by _finish
            self._left(member, fut)

    def _left(self, member: SimulatedMember, fut: asyncio.Future[Any] | None) -> None:
        # A participant's call ended: normal at the finish; before it, the collective breaks.
        _forget(member.collectives, self)
        if self.broken is not None or (self.started_at is not None and self.loop.time() >= self.started_at + self.cost_s):
            return
        self.broken = f"{member.name} left {self.what}"
        when = self.loop.time() + self.detect_s
        for other, other_fut, _ in self.arrivals.values():
            if other is not member and not other_fut.done():
                other.cluster.timers.call_at(when, _fail, other_fut, self._peer_lost(other, self.broken))

    def _peer_lost(self, member: SimulatedMember, why: str) -> RemoteError:
        exc = PeerLost(f"rank {member.rank}: a peer was lost during {self.what} ({why})", group="weights",
                       group_version=member.group_version, rank=member.rank, op=self.what)
        return RemoteError(exc, str(exc))

    def progressing(self, now: float) -> bool:
        return self.started_at is not None and now >= self.started_at


class NodeChanges:
    """How often anything a heartbeat answer shows changed, for any member on one node: its
    progress, weights, checksum, whether it is alive, hung, cut off, or joined a collective. The
    node's agent compares it with its count at its last reply (:meth:`SimulatedLivenessAgent._answers`),
    so that a quiet round of a node where nothing changed does not read its members (at 10,000
    members the simulation's reading of each, every round, was most of a quiet round's CPU and
    pushed the controller's objects out of the cache). Every change goes through the members'
    properties below and :class:`Collective`, never around them."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


def _watched(name: str) -> property:
    """A member's attribute whose every assignment counts as a change on its node (NodeChanges)."""
    slot = "_" + name

    def set_(self: SimulatedMember, value: Any) -> None:
        setattr(self, slot, value)
        self.changes.count += 1

    # read through a C getter: a heartbeat round reads each member's several times
    return property(operator.attrgetter(slot), set_, doc=f"the member's {name} (a change is counted on its node: NodeChanges)")


class SimulatedMember:
    """One simulated worker process (the handle the controller calls). cluster: the
    :class:`~ftstate.simulation.cluster.SimulatedCluster` it runs in (untyped here: the cluster
    imports this module); node: the node's id and address; pid: a number unique in the
    cluster; up_at: when its process is up."""

    progress = _watched("progress")
    weights_version = _watched("weights_version")
    checksum = _watched("checksum")
    alive = _watched("alive")
    hung = _watched("hung")
    cut_off = _watched("cut_off")

    def __init__(self, cluster: Any, name: str, role: str, node_id: str, address: str, pid: int,
                 up_at: float) -> None:
        self.cluster = cluster
        self.name = name
        self.role = role
        self.node_id = node_id
        #: Changes on its node (shared by every member there): before any watched attribute is set.
        self.changes: NodeChanges = cluster.changes_on(node_id)
        self.address = address
        self.pid = pid
        self.up_at = up_at
        self.alive = True
        self.hung = False
        self.cut_off = False
        self.death: str | None = None
        # Dicts, not sets: a set of futures iterates in the order of their addresses, and the
        # order deaths are reported in must be the same in every run of a seed.
        self._pending: dict[asyncio.Future[Any], None] = {}
        #: The collectives it takes part in, in the order it joined them (a list, not a dict: a
        #: dict that empties is untracked by the collector and tracked again, a new object to
        #: promote, each time its member joins one: 10,000 a sync at 10,000 members).
        self.collectives: list[Collective] = []
        self.progress = 0
        self.weights_version = 0
        self.checksum: str | None = None
        self.staged: int | None = None
        self.group_version = 0
        self.rank = -1
        self.world = 0
        # Several trainer ranks: the trainer group's size, the logged calls since this rank's
        # part was committed (started, done) and whether it prepared its part of a sync.
        self.trainer_world = 1
        self.calls_started = self.calls_done = 0
        self.prepared = False
        #: While :meth:`answer` runs its handler: the call being answered, and when its answer is
        #: due (set by _after for that call only; two slots, not a tuple each call, and nothing
        #: kept once the call is made).
        self._answering: Any = None
        self._answer_at = 0.0

    # -- calls ---------------------------------------------------------------------------

    def answer(self, method: str, args: tuple[Any, ...], timeout: float | None,
               reply: Any = None) -> asyncio.Future[Any]:
        """The future of ``method(*args)``, settled at its modelled time (see the module docstring);
        ``reply``: settle that instead (an :class:`AgentReply`: the call came through the agent)."""
        loop = self.cluster.loop
        fut: asyncio.Future[Any] = loop.create_future() if reply is None else reply
        now = loop.time()
        if not self._alive:
            self.cluster.timers.call_at(now + self.cluster.costs.death_detect_s, _fail, fut,
                                        ActorDied(self.death or "dead"))
            return fut
        # The calls a death fails: one answered leaves when it is (_settle); those that ended
        # otherwise (failed, timed out) are dropped in bulk now and then, not each by a callback
        # of its own (two more objects per call in flight, which the collector scans).
        if len(self._pending) >= _PRUNE_AT:  # in place: a new dict each time is one more to promote
            for f in [f for f in self._pending if f.done()]:
                del self._pending[f]
        self._pending[fut] = None
        if self._hung or self._cut_off:
            if timeout is not None:
                self.cluster.timers.call_at(now + timeout, _time_out, fut, timeout)
            if self._cut_off:  # its node is gone and Ray does not know it yet: no answer, then unreachable
                self.cluster.timers.call_at(now + self.cluster.costs.unreachable_s, _fail, fut, ActorUnreachable(
                    "the actor is temporarily unavailable (its node does not answer)"))
            return fut
        self._answering, self._answer_at = fut, float("inf")
        handler = getattr(self, f"_on_{method}", None)
        if handler is None:
            exc = ProtocolError(self.name, f"{method}()", "the simulated member has no such method")
            self._after(fut, self.cluster.costs.call_s, _raiser(RemoteError(exc, str(exc))))
        else:
            handler(fut, *args)
        # (a nested call of this member's would have cleared it: then the timer, as for any doubt)
        due_in_time = self._answering is fut and timeout is not None and self._answer_at < now + timeout
        self._answering = None
        if timeout is not None and not due_in_time:
            # No timer when the answer is already due before it (the timer would find the call
            # settled: a heartbeat's answer, 1,250 an interval at 10,000 members). Otherwise it is
            # left to fire on a call answered meanwhile (cancelling it on the answer would keep a
            # callback per call besides), and its error is made only when it fires.
            self.cluster.timers.call_at(now + timeout, _time_out, fut, timeout)
        return fut

    def _after(self, fut: asyncio.Future[Any], seconds: float, outcome: Outcome, less: float = 0.0) -> None:
        # Each answer takes its cost stretched by up to Costs.jitter (the cluster's seeded
        # draw): real answers trickle in, and code that is cheap only when they all arrive at
        # once (one wake-up for a whole batch) must not look cheap here. less: the part of it
        # already done (a step under way), taken off after the stretch.
        loop = self.cluster.loop
        seconds *= 1.0 + self.cluster.costs.jitter * self.cluster.rng.random()
        when = max(loop.time(), self.up_at) + seconds - less
        if fut is self._answering:
            self._answer_at = when
        if type(fut) is AgentReply and fut.answer_at(self, outcome):
            self.cluster.timers.call_at(when, fut)  # its own timer's callback: no arguments tuple
        else:
            self.cluster.timers.call_at(when, _answered, self, fut, outcome)

    def answer_later(self, fut: asyncio.Future[Any], outcome: Outcome) -> None:
        """Settle ``fut`` one call's time from now (a collective finished: its answer travels back)."""
        self._after(fut, self.cluster.costs.call_s, outcome)

    def _reply(self, fut: asyncio.Future[Any], value: Any = None, seconds: float | None = None) -> None:
        self._after(fut, self.cluster.costs.call_s if seconds is None else seconds, lambda: value)

    # -- faults ----------------------------------------------------------------------------

    def die(self, reason: str) -> None:
        """The process is gone: pending calls fail with ActorDied once the death is detected."""
        if not self.alive:
            return
        self.alive = False
        self.death = reason
        loop = self.cluster.loop
        when = loop.time() + self.cluster.costs.death_detect_s
        for fut in list(self._pending):
            self.cluster.timers.call_at(when, _fail, fut, ActorDied(reason))
        self._pending.clear()
        if self.rank >= 0:
            # Its sockets closed with it: a collective of its group version waiting for it (a
            # broadcast it never entered, because it hung first) breaks for those already in
            # it, as gloo's peers hear a reset; one started later fails at once (gone_ranks).
            for key, c in list(self.cluster._collectives.items()):
                if key[1] == self.group_version and c.started_at is None and self.rank not in c.arrivals:
                    c._left(self, None)
            self.cluster.gone_ranks.setdefault(self.group_version, set()).add(self.rank)

    def hang(self) -> None:
        """The process stays up and answers nothing from now on."""
        self.hung = True

    def lose_node(self) -> None:
        """Its node is gone: the process is, but until Ray declares the node dead
        (``Costs.node_dead_s``, the cluster's to say) its calls get no answer: those pending
        stay pending, new ones fail as unreachable after ``Costs.unreachable_s``."""
        self.cut_off = True
        # Its process died with the node: its sockets closed, so its peers in a collective hear
        # it at once (a real gloo peer raises as soon as the connection resets), while the
        # controller's own calls to it go unanswered.
        for c in list(self.collectives):
            c._left(self, None)
        if self.rank >= 0:  # and a collective of its group version started later fails at once too
            self.cluster.gone_ranks.setdefault(self.group_version, set()).add(self.rank)

    # -- what the controller calls (WorkerHost's methods) -----------------------------------

    def _where(self) -> Located:
        return Located(pid=self.pid, node=self.address, node_id=self.node_id, member=self.name, role=self.role)

    def _on_info(self, fut: asyncio.Future[Any], req: Info) -> None:
        self._after(fut, self.cluster.costs.call_s, self._where)

    def _on_prewarm(self, fut: asyncio.Future[Any], req: Prewarm) -> None:
        self._after(fut, self.cluster.costs.call_s, self._where)

    def _on_heartbeat(self, fut: asyncio.Future[Any], req: Beat) -> None:
        self._after(fut, self.cluster.costs.call_s, self._beat)

    def local_heartbeat(self, req: Beat, now: float, timeout: float) -> Any:
        """What this member's heartbeat, asked by its node's agent, ended in by ``now``: its
        answer, or the exception its call had (dead; no answer within ``timeout``)."""
        if not self._alive:
            return ActorDied(self.death or "dead")
        if self._hung or self._cut_off or self.up_at > now:
            return CallTimedOut(f"no answer within {timeout:g}s")
        return self._beat()

    def _beat(self) -> Heartbeat:
        now = self.cluster.loop.time()
        busy = bool(self.collectives)
        progress = self._progress
        for c in self.collectives:
            if c.progressing(now):
                progress += int((now - c.started_at) / self.cluster.costs.bucket_s())  # type: ignore[operator]
        # it drops nothing as forged here, so whether the watchdog asked for it changes nothing
        return Heartbeat(progress=progress, busy=busy, weights_version=self._weights_version,
                         checksum=self._checksum, pid=self.pid)

    def _on_vigil(self, fut: asyncio.Future[Any], req: Vigil) -> None:
        return None  # pending until the process dies

    def _on_join(self, fut: asyncio.Future[Any], req: Join) -> None:
        self._leave("left the group version")
        store = self.cluster.store_at(req.store_port)
        store.register(req.group, req.version, req.rank, req.world_size, self, fut, req.timeout_s)

    def joined(self, version: int, rank: int, world_size: int) -> Joined:
        """The rendezvous of ``version`` completed (the store calls it)."""
        self.group_version, self.rank, self.world = version, rank, world_size
        self.progress += 1
        return Joined(group_version=version, rank=rank)

    def _leave(self, reason: str) -> None:
        for c in list(self.collectives):
            for rank, (member, fut, _) in c.arrivals.items():
                if member is self and not fut.done():
                    exc = CommunicatorAborted("weights", self.group_version, rank, reason)
                    fut.set_exception(RemoteError(exc, str(exc)))

    def _on_abandon_transfer(self, fut: asyncio.Future[Any], req: Abandon) -> None:
        self._leave(req.reason)
        self._reply(fut)

    def _broadcast(self, weights_version: int) -> Collective:
        c = self.cluster.collective(("broadcast", self.group_version, weights_version),
                                    f"the broadcast of weights version {weights_version}", self.world,
                                    self.cluster.costs.transfer_s(self.world))
        return self._unless_a_rank_is_gone(c, self.cluster.gone_ranks.get(self.group_version))

    def _unless_a_rank_is_gone(self, c: Collective, gone: Any) -> Collective:
        # A rank of this group version died with its node: its sockets are closed, so a
        # collective with it fails at once for the others (as gloo's does on a reset).
        if gone and c.broken is None:
            c.broken = f"rank {min(gone)} of group version {self.group_version} is gone"
        return c

    def _on_send_weights(self, fut: asyncio.Future[Any], req: SendWeights) -> None:
        nbytes = self.cluster.costs.weights_bytes
        weights_version = req.weights_version

        def sent() -> Sent:
            self.weights_version, self.checksum = weights_version, checksum_of(weights_version)
            self.progress += 1
            return Sent(checksum=self.checksum, nbytes=nbytes)

        self._broadcast(weights_version).arrive(self.rank, self, fut, sent)

    def _on_receive_weights(self, fut: asyncio.Future[Any], req: ReceiveWeights) -> None:
        v = req.weights_version
        self._broadcast(v).arrive(self.rank, self, fut, (SimulatedMember._staged_weights, self, v,
                                                         self.cluster.costs.weights_bytes))

    def _staged_weights(self, weights_version: int, nbytes: int) -> Staged:
        self.staged = weights_version
        self.progress += 1
        return Staged(checksum=checksum_of(weights_version), nbytes=nbytes, weights_version=weights_version,
                      staging_bytes=nbytes)

    def _on_commit_weights(self, fut: asyncio.Future[Any], req: Commit) -> None:
        self._after(fut, self.cluster.costs.call_s + self.cluster.costs.load_s(),
                    (SimulatedMember._committed, self, req.weights_version))

    def _committed(self, weights_version: int) -> Loaded:
        if self.staged != weights_version:
            have = "nothing" if self.staged is None else f"version {self.staged}"
            exc = ProtocolError(self.name, f"commit of weights version {weights_version}", f"it staged {have}")
            raise RemoteError(exc, str(exc))
        self.weights_version, self.checksum, self.staged = weights_version, checksum_of(weights_version), None
        self.progress += 1
        return Loaded(checksum=self.checksum, received=self.checksum, weights_version=weights_version)

    def _on_discard_weights(self, fut: asyncio.Future[Any], req: Discard) -> None:
        self.staged = None
        self._reply(fut)

    def _on_reserve_staging(self, fut: asyncio.Future[Any], req: ReserveStaging) -> None:
        self._reply(fut)

    def _point_to_point(self, src: int, dst: int) -> Collective:
        c = self.cluster.collective(("p2p", self.group_version, src, dst), "a point-to-point transfer", 2,
                                    self.cluster.costs.transfer_s(2))
        gone = self.cluster.gone_ranks.get(self.group_version, set()) & {src, dst}
        return self._unless_a_rank_is_gone(c, gone)

    def _on_send_weights_to(self, fut: asyncio.Future[Any], req: SendTo) -> None:
        version, checksum, nbytes = self.weights_version, self.checksum, self.cluster.costs.weights_bytes

        def sent() -> SentTo:
            self.progress += 1
            return SentTo(checksum=checksum or "", nbytes=nbytes, weights_version=version)

        self._point_to_point(self.rank, req.peer).arrive(self.rank, self, fut, sent)

    def _on_receive_weights_from(self, fut: asyncio.Future[Any], req: ReceiveFrom) -> None:
        nbytes = self.cluster.costs.weights_bytes
        weights_version, checksum = req.weights_version, req.checksum

        def received() -> Loaded:
            self.weights_version, self.checksum = weights_version, checksum
            self.progress += 1
            return Loaded(checksum=checksum, received=checksum, nbytes=nbytes, weights_version=weights_version)

        self._point_to_point(req.src, self.rank).arrive(self.rank, self, fut, received)

    def _on_trainer_checksum(self, fut: asyncio.Future[Any], req: TrainerChecksum) -> None:
        self._reply(fut, Checksum(self.checksum or ""))

    def _on_call(self, fut: asyncio.Future[Any], req: UserCall) -> None:
        costs = self.cluster.costs
        logged = req.logged
        seconds, less = costs.call_s, 0.0
        if self.role == "trainer" and req.name == "train_step":
            seconds += costs.train_step_s
            under_way = self.cluster.step_under_way
            if under_way is not None and under_way[0] == self.cluster.loop.time():
                less = under_way[1]
        self.calls_started += logged

        def done() -> None:
            self.progress += 1
            self.calls_done += logged

        self._after(fut, seconds, done, less)

    # -- several trainer ranks (WorkerHost's sharded methods; ftstate.controller.ranks) ----
    # The weights are one tensor ``w`` of weights_bytes / 4 float32 elements, split along its
    # first dim over the trainer ranks (rank i owns slice i of trainer_world, torch's chunk
    # rule), so the controller's ownership check runs on real pieces. A part's checksum names
    # the version, the rank and the logged calls made on it since (``sim-v7-r3+2``).

    def _elements(self) -> int:
        return max(1, self.cluster.costs.weights_bytes // 4)

    def part_checksum_of(self, weights_version: int, trainer_rank: int, calls: int = 0) -> str:
        return f"{checksum_of(weights_version)}-r{trainer_rank}" + (f"+{calls}" if calls else "")

    def _part_bytes(self) -> int:
        return max(1, self.cluster.costs.weights_bytes // max(1, self.trainer_world))

    def _on_setup_trainer_group(self, fut: asyncio.Future[Any], req: JoinTrainerGroup) -> None:
        # Not a rendezvous of its own: the ranks were just formed together in the weights group.
        self.trainer_world = req.world_size
        self._reply(fut, Joined(group_version=req.version, rank=req.rank), self.cluster.costs.group_form_s)

    def _on_prepare_shards(self, fut: asyncio.Future[Any], req: PrepareShards) -> None:
        self.prepared = True
        trainer_rank = req.trainer_rank
        piece = ["w", trainer_rank, "float32", [self._elements()], 0, trainer_rank, self.trainer_world]
        self._reply(fut, Prepared(pieces=(piece,), nbytes=self._part_bytes()))  # type: ignore[arg-type]

    def _on_discard_shards(self, fut: asyncio.Future[Any], req: DiscardShards) -> None:
        self.prepared = False
        self._reply(fut)

    def _shards(self, weights_version: int) -> Collective:
        # Every owner sends its part to every rollout at once: a sender's link carries its part
        # once per rollout, a rollout's the whole weights once.
        rollouts = max(1, self.world - self.trainer_world)
        cost = self._part_bytes() * rollouts / self.cluster.costs.bandwidth_Bps + self.cluster.costs.transfer_s(2)
        c = self.cluster.collective(("shards", self.group_version, weights_version),
                                    f"the sharded send of weights version {weights_version}", self.world, cost)
        return self._unless_a_rank_is_gone(c, self.cluster.gone_ranks.get(self.group_version))

    def _on_send_shards(self, fut: asyncio.Future[Any], req: SendShards) -> None:
        weights_version = req.weights_version
        if not self.prepared:
            exc = ProtocolError(self.name, f"a send of its part of weights version {weights_version}",
                                "it prepared none")
            self._after(fut, self.cluster.costs.call_s, _raiser(RemoteError(exc, str(exc))))
            return
        self.prepared = False
        self._shards(weights_version).arrive(self.rank, self, fut,
                                             (SimulatedMember._sent_shards, self, weights_version, self.rank))

    def _sent_shards(self, weights_version: int, rank: int) -> PartSent:
        self.progress += 1
        return PartSent(checksum=self.part_checksum_of(weights_version, rank), nbytes=self._part_bytes())

    def _on_receive_shards(self, fut: asyncio.Future[Any], req: ReceiveShards) -> None:
        v = req.weights_version
        self._shards(v).arrive(self.rank, self, fut, (SimulatedMember._staged_shards, self, v,
                                                      self.cluster.costs.weights_bytes))

    def _staged_shards(self, weights_version: int, nbytes: int) -> Staged:
        self.staged = weights_version
        self.progress += 1
        return Staged(checksum=checksum_of(weights_version), nbytes=nbytes, weights_version=weights_version)

    def _on_note_weights(self, fut: asyncio.Future[Any], req: NoteWeights) -> None:
        self.weights_version, self.checksum = req.weights_version, req.checksum
        self.calls_started = self.calls_done = 0
        self._reply(fut)

    def _on_calls_since_commit(self, fut: asyncio.Future[Any], req: CallsSinceCommit) -> None:
        self._reply(fut, CallCounts(started=self.calls_started, done=self.calls_done))

    def _on_part_checksum(self, fut: asyncio.Future[Any], req: PartChecksum) -> None:
        self._reply(fut, PartHeld(checksum=self.part_checksum_of(self.weights_version, req.trainer_rank,
                                                                 self.calls_done), pieces=1))

    def _on_send_part_to(self, fut: asyncio.Future[Any], req: SendPart) -> None:
        version, ownership, trainer_rank = self.weights_version, req.ownership, req.trainer_rank
        owners = len(ownership["w"][3]) if "w" in ownership else 1  # name -> [dtype, shape, dim, parts]
        nbytes = max(1, self.cluster.costs.weights_bytes // max(1, owners))

        def sent() -> PartSent:
            self.progress += 1
            return PartSent(checksum=self.part_checksum_of(version, trainer_rank), nbytes=nbytes)

        self._point_to_point(self.rank, req.peer).arrive(self.rank, self, fut, sent)

    def _on_receive_part_from(self, fut: asyncio.Future[Any], req: ReceivePart) -> None:
        weights_version, checksum = req.weights_version, req.checksum

        def restored() -> PartLoaded:
            self.weights_version = weights_version
            self.calls_started = self.calls_done = 0
            self.progress += 1
            return PartLoaded(received=checksum, tensors=0 if checksum is None else 1)

        if checksum is None:
            self._after(fut, self.cluster.costs.call_s, restored)
        else:
            self._point_to_point(req.src, self.rank).arrive(self.rank, self, fut, restored)


class SimulatedNodeWatcher(SimulatedMember):
    """A node's maintenance watcher (:class:`~ftstate.controller.maintenance.node_actor.NodeWatcherActor`
    as the controller sees it): it finds no metadata server on its node, so it runs no source."""

    def _on_describe(self, fut: asyncio.Future[Any]) -> None:
        from ftstate.controller.maintenance.detect import Detection

        detection = Detection((), None, False, "a simulated node has no metadata server")
        self._reply(fut, {"node_id": self.node_id, "detection": detection, "bounds": {}})


class SimulatedLivenessAgent(SimulatedMember):
    """A node's agent as the controller sees it (:class:`~ftstate.controller.ray.backend.LivenessAgent`):
    a light process on the node (up at once, lost with it) that asks the members there for their
    heartbeats and answers for all of them in one reply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._memory = AgentMemory()
        #: The node's NodeChanges count when the kept reply was made, if every answer in it was
        #: a plain one, not busy (then nothing in them depends on the time): while the count
        #: holds, every answer now is the kept one. None: the members must be read.
        self._steady_at: int | None = None

    def _unchanged(self, handles: list[SimulatedMember], since: int | None) -> bool:
        """Whether the answers of ``handles`` now are those of the kept reply, which ``since``
        names, known without reading them: nothing changed on the node since."""
        memory = self._memory
        return (since is not None and since == memory.mark and self._steady_at == self.changes.count
                and handles == memory.handles)

    def _on_heartbeats(self, fut: asyncio.Future[Any], handles: list[SimulatedMember], args: list[Beat],
                       timeout: float, mark: int | None = None, since: int | None = None) -> None:
        # One round trip of the controller's, the members' local calls inside it; a member
        # that does not answer (hung) holds the reply until its own call's timeout, as the
        # real agent's gather does. Each answer is what the member is at the reply's time.
        loop = self.cluster.loop
        answers = (SimulatedLivenessAgent._answers, self, handles, args, timeout, mark, since)
        if not self._unchanged(handles, since) and any(h._alive and (h._hung or h._cut_off) for h in handles):
            self.cluster.timers.call_at(loop.time() + timeout, _settle, fut, answers)
        else:
            self._after(fut, self.cluster.costs.call_s, answers)

    def _on_ready(self, fut: asyncio.Future[Any]) -> None:
        self._reply(fut, True)

    def _answers(self, handles: list[SimulatedMember], args: list[Beat], timeout: float,
                 mark: int | None, since: int | None) -> Any:
        memory = self._memory
        if self._unchanged(handles, since):
            # what AgentMemory.reply would answer, the members' answers being the kept ones
            if mark is not None:
                memory.mark = mark
            return QUIET
        now = self.cluster.loop.time()
        answers = [h.local_heartbeat(a, now, timeout) for h, a in zip(handles, args, strict=True)]
        reply = memory.reply(handles, answers, mark, since)
        if mark is not None:
            steady = all(type(a) is Heartbeat and a.busy is False for a in answers)
            self._steady_at = self.changes.count if steady else None
        return QUIET if reply is QUIET_WIRE else reply  # what the Ray backend hands on for the wire's word


class AgentBatch:
    """The members' calls of one :meth:`~ftstate.simulation.cluster.SimulatedCluster.calls`, and
    its iteration: each member's outcome as it ends, handed over in lists of those that ended
    since the last. The members are called when the iteration starts, unless the agent is dead
    or its node gone: then the first step fails as a call of the agent's would. The agent is
    lost with its node: from then on it hands nothing over (its members' outcomes stay with
    it), and its death, once its node is declared dead, fails the batch with ``ActorDied``, as
    a real agent's reply does."""

    __slots__ = ("agent", "calls", "ended", "left", "loop", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop, agent: SimulatedMember, handles: Sequence[SimulatedMember],
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

    def _call_members(self, handles: Sequence[SimulatedMember], requests: Sequence[Request]) -> None:
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
            self.agent._pending[self.wake] = None  # failed with ActorDied when the agent dies
            try:
                await self.wake
            finally:
                self.agent._pending.pop(self.wake, None)
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
        self._member: SimulatedMember | None = None
        self._outcome: Outcome | None = None
        # the first done-callback in two slots (a collective's: the only one there usually is),
        # any further ones in a list
        self._callback: Callable[[Any], Any] | None = None
        self._context: Any = None
        self._more: list[tuple[Callable[[Any], Any], Any]] | None = None

    def answer_at(self, member: SimulatedMember, outcome: Outcome) -> bool:
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
            _answered(member, self, outcome)  # type: ignore[arg-type]

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


def _raiser(exc: BaseException) -> Callable[[], Any]:
    def outcome() -> Any:
        raise exc

    return outcome


class SimulatedStore:
    """The rendezvous store of a simulated cluster: who registered for which group version,
    and which versions are fenced (superseded: their waiters get ``StaleGroupVersion``)."""

    def __init__(self, cluster: Any, host: str, port: int) -> None:
        from ftstate.transport.store import StoreAddress

        self.cluster = cluster
        self.address = StoreAddress(host, port)
        self._current: dict[str, int] = {}
        self._versions: dict[tuple[str, int], Collective] = {}
        #: The members waiting in each rendezvous, each with its own bound (its arrival plus its
        #: ``timeout_s``): (when, timeout_s, name, future).
        self._waiting: dict[tuple[str, int], list[tuple[float, float, str, asyncio.Future[Any]]]] = {}

    def register(self, group: str, version: int, rank: int, world_size: int, member: SimulatedMember,
                 fut: asyncio.Future[Any], timeout_s: float) -> None:
        loop = self.cluster.loop
        current = self._current.get(group, 0)
        if current > version:
            exc = StaleGroupVersion(group, got=version, current=current, peer=member.name)
            loop.call_at(loop.time() + self.cluster.costs.call_s, _fail, fut, RemoteError(exc, str(exc)))
            return
        key = (group, version)
        rendezvous = self._versions.get(key)
        if rendezvous is None:
            rendezvous = self._versions[key] = Collective(
                loop, f"the rendezvous of {group} v{version}", world_size, self.cluster.costs.group_form_s, 0.0,
                on_finish=functools.partial(self._waiting.pop, key, None))
        rendezvous.arrive(rank, member, fut, (SimulatedMember.joined, member, version, rank, world_size))
        _forget(member.collectives, rendezvous)  # waiting in a rendezvous is not being busy in a transfer
        # Each member's bound, kept with the rendezvous until it forms (then dropped whole) and
        # watched by one timer at the earliest: every member of a reform joins (10,000 at once),
        # and a timer each held its call for the whole bound, formed or not.
        when = loop.time() + timeout_s
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = []
            self.cluster.timers.call_at(when, self._expire, key)
        waiting.append((when, timeout_s, member.name, fut))

    def _expire(self, key: tuple[str, int]) -> None:
        """The earliest bound of ``key``'s waiting members came: those whose bound passed fail
        with :class:`RendezvousTimeout`; the timer is set again for the next."""
        waiting = self._waiting.get(key)
        if not waiting:
            return
        now, group, version = self.cluster.loop.time(), key[0], key[1]
        left = []
        for entry in waiting:
            when, timeout_s, name, fut = entry
            if fut.done():
                continue
            if when > now:
                left.append(entry)
                continue
            exc = RendezvousTimeout(f"rendezvous of group {group!r} version {version}", key="init_timeout_s",
                                    seconds=timeout_s, member=name, group_version=version)
            fut.set_exception(RemoteError(exc, str(exc)))
        if left:
            self._waiting[key] = left
            self.cluster.timers.call_at(min(entry[0] for entry in left), self._expire, key)
        else:
            self._waiting.pop(key, None)

    def arrived(self, group: str, version: int) -> list[int]:
        rendezvous = self._versions.get((group, version))
        return sorted(rendezvous.arrivals) if rendezvous is not None else []

    def fence(self, group: str, version: int) -> int:
        current = max(self._current.get(group, 0), version)
        self._current[group] = current
        loop = self.cluster.loop
        for (g, v), rendezvous in list(self._versions.items()):
            if g != group or v >= current:
                continue
            del self._versions[(g, v)]
            self._waiting.pop((g, v), None)  # their calls fail now, or were answered
            if rendezvous.started_at is not None:
                continue
            rendezvous.broken = f"version {v} fenced"
            for member, fut, _ in rendezvous.arrivals.values():
                exc = StaleGroupVersion(group, got=v, current=current, peer=member.name)
                loop.call_at(loop.time(), _fail, fut, RemoteError(exc, str(exc)))
        return current

    def close(self) -> None:
        self._versions.clear()
        self._waiting.clear()


__all__ = ["AgentBatch", "Collective", "NodeChanges", "SimulatedMember", "SimulatedNodeWatcher", "SimulatedStore", "checksum_of"]
