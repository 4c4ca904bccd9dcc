"""Simulated worker hosts: the calls the controller makes of a
:class:`~ftstate.worker.host.WorkerHost`, answered after their modelled cost.

A :class:`SimulatedMember` keeps what a real host keeps that the controller can see: the
weights version and checksum it holds committed, a staged version, the group version and rank
it joined, a progress counter that moves while it transfers, whether it is busy. Each call
returns a future that the member settles at a time of the virtual clock (one entry per call on
the cluster's :class:`~ftstate.simulation.clock.TimerQueue`, no task each; a call made through
its node's agent answers into the agent's batch, an
:class:`~ftstate.simulation.agentcalls.AgentReply`, not a future):

- ``info`` / ``prewarm`` answer once the process is up (``Costs.start_s`` after its start);
- ``join`` waits in the rendezvous store until every rank of the version registered (or the
  version is fenced: ``StaleGroupVersion``, as the real store says), then ``Costs.group_form_s``;
- ``send_weights`` / ``receive_weights`` are one :class:`~ftstate.simulation.collectives.Collective` of every rank of the group
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

Also here, as the controller sees them: a node's maintenance watcher
(:class:`SimulatedNodeWatcher`) and its liveness agent (:class:`SimulatedLivenessAgent`). What
members wait in together (collectives, the rendezvous store) is
:mod:`ftstate.simulation.collectives`; an agent's batch of member calls,
:mod:`ftstate.simulation.agentcalls`. Everything runs in the simulation's one process, on its
virtual clock.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Callable
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
    ProtocolError,
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
from ftstate.simulation.agentcalls import AgentReply
from ftstate.simulation.collectives import Collective, Outcome, answered, fail, settle, time_out


def checksum_of(weights_version: int) -> str:
    """The checksum a simulated member reports for ``weights_version``."""
    return f"sim-v{weights_version}"


#: A member's calls kept for its death to fail are pruned of those that ended at this many.
_PRUNE_AT = 16



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
    # what each watched attribute keeps (read directly where a round reads thousands)
    _progress: int
    _weights_version: int
    _checksum: str | None
    _alive: bool
    _hung: bool
    _cut_off: bool

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
        self.pending: dict[asyncio.Future[Any], None] = {}
        #: The collectives it takes part in, in the order it joined them (a list, not a dict: a
        #: dict that empties is untracked by the collector and tracked again, a new object to
        #: promote, each time its member joins one: 10,000 a sync at 10,000 members).
        self.collectives: list[Collective] = []
        self.progress = 0
        self.weights_version = 0
        self.checksum = None
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
        #: Its last heartbeat's answer, handed out again while it is what the member would say.
        self._last_beat: Heartbeat | None = None

    # -- calls ---------------------------------------------------------------------------

    def answer(self, method: str, args: tuple[Any, ...], timeout: float | None,
               reply: Any = None) -> asyncio.Future[Any]:
        """The future of ``method(*args)``, settled at its modelled time (see the module docstring);
        ``reply``: settle that instead (an :class:`AgentReply`: the call came through the agent)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future() if reply is None else reply
        now = loop.time()
        if not self._alive:
            self.cluster.timers.call_at(now + self.cluster.costs.death_detect_s, fail, fut,
                                        ActorDied(self.death or "dead"))
            return fut
        # The calls a death fails: one answered leaves when it is (settle); those that ended
        # otherwise (failed, timed out) are dropped in bulk now and then, not each by a callback
        # of its own (two more objects per call in flight, which the collector scans).
        if len(self.pending) >= _PRUNE_AT:  # in place: a new dict each time is one more to promote
            for f in [f for f in self.pending if f.done()]:
                del self.pending[f]
        self.pending[fut] = None
        if self._hung or self._cut_off:
            if timeout is not None:
                self.cluster.timers.call_at(now + timeout, time_out, fut, timeout)
            if self._cut_off:  # its node is gone and Ray does not know it yet: no answer, then unreachable
                self.cluster.timers.call_at(now + self.cluster.costs.unreachable_s, fail, fut, ActorUnreachable(
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
            self.cluster.timers.call_at(now + timeout, time_out, fut, timeout)
        return fut

    def _after(self, fut: asyncio.Future[Any], seconds: float, outcome: Outcome, less: float = 0.0) -> None:
        # Each answer takes its cost stretched by up to Costs.jitter (the cluster's seeded
        # draw): real answers trickle in, and code that is cheap only when they all arrive at
        # once (one wake-up for a whole batch) must not look cheap here. less: the part of it
        # already done (a step under way), taken off after the stretch.
        loop = asyncio.get_running_loop()
        seconds *= 1.0 + self.cluster.costs.jitter * self.cluster.rng.random()
        when = max(loop.time(), self.up_at) + seconds - less
        if fut is self._answering:
            self._answer_at = when
        if type(fut) is AgentReply and fut.answer_at(self, outcome):
            self.cluster.timers.call_at(when, fut)  # its own timer's callback: no arguments tuple
        else:
            self.cluster.timers.call_at(when, answered, self, fut, outcome)

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
        loop = asyncio.get_running_loop()
        when = loop.time() + self.cluster.costs.death_detect_s
        for fut in list(self.pending):
            self.cluster.timers.call_at(when, fail, fut, ActorDied(reason))
        self.pending.clear()
        if self.rank >= 0:
            # Its sockets closed with it: a collective of its group version waiting for it (a
            # broadcast it never entered, because it hung first) breaks for those already in
            # it, as gloo's peers hear a reset; one started later fails at once (gone_ranks).
            for key, c in list(self.cluster.collectives.items()):
                if key[1] == self.group_version and c.started_at is None and self.rank not in c.arrivals:
                    c.leave(self, None)
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
            c.leave(self, None)
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
        now = asyncio.get_running_loop().time()
        busy = bool(self.collectives)
        progress = self._progress
        for c in self.collectives:
            if c.progressing(now):
                progress += int((now - c.started_at) / self.cluster.costs.bucket_s())  # type: ignore[operator]
        # it drops nothing as forged here, so whether the watchdog asked for it changes nothing
        last = self._last_beat
        if (last is not None and last.progress == progress and last.busy is busy
                and last.weights_version == self._weights_version and last.checksum == self._checksum):
            return last  # equal, and frozen: the same answer again, not a new one built each round
        self._last_beat = beat = Heartbeat(progress=progress, busy=busy, weights_version=self._weights_version,
                                           checksum=self._checksum, pid=self.pid)
        return beat

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
            if under_way is not None and under_way[0] == asyncio.get_running_loop().time():
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
        loop = asyncio.get_running_loop()
        answers = (SimulatedLivenessAgent._answers, self, handles, args, timeout, mark, since)
        if not self._unchanged(handles, since) and any(h._alive and (h._hung or h._cut_off) for h in handles):
            self.cluster.timers.call_at(loop.time() + timeout, settle, fut, answers)
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
        now = asyncio.get_running_loop().time()
        answers = [h.local_heartbeat(a, now, timeout) for h, a in zip(handles, args, strict=True)]
        reply = memory.reply(handles, answers, mark, since)
        if mark is not None:
            steady = all(type(a) is Heartbeat and a.busy is False for a in answers)
            self._steady_at = self.changes.count if steady else None
        return QUIET if reply is QUIET_WIRE else reply  # what the Ray backend hands on for the wire's word



def _raiser(exc: BaseException) -> Callable[[], Any]:
    def outcome() -> Any:
        raise exc

    return outcome


__all__ = ["NodeChanges", "SimulatedLivenessAgent", "SimulatedMember", "SimulatedNodeWatcher", "checksum_of"]
