"""The watchdog, run in the controller: heartbeats into liveness events on the worker machines
(docs/concepts.md, "Heartbeats"). Deaths come from the failing calls; heartbeats are for the hung."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from ftstate.controller.backend import QUIET
from ftstate.controller.calls import ActorCalls
from ftstate.controller.collector import CollectorPause
from ftstate.controller.membership import GONE, Member, Membership, walk_proven
from ftstate.controller.vigil import Vigils
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import MemberLost
from ftstate.core.liveness import Heartbeat, Vouch
from ftstate.core.protocol import Beat

#: A heartbeat through a node's agent: a suspect proves its weights; every member hands over
#: what it dropped as forged.
_PROVE = Beat(prove=True, forged=True)
#: The watchdog's own event for an answer showing a swap at a safe point (not a machine trigger).
SWAPPED = "swapped"
_ASK = Beat(prove=False, forged=True)


def _asks(members: Sequence[Member]) -> list[Beat]:
    """Each member's heartbeat arguments: a suspect proves its weights."""
    return [_PROVE if m.machine.state == "SUSPECT" else _ASK for m in members]


class Watchdog:
    """Polls members' heartbeats for one runtime."""

    def __init__(self, *, config: RuntimeConfig, membership: Membership, calls: ActorCalls) -> None:
        self.config = config
        self.membership = membership
        self.calls = calls
        self.vigils = Vigils(calls)
        self._rounds = NodeRounds(self._replied)
        #: The number of the round under way: its calls' ``mark`` (:meth:`ActorCalls.heartbeats`).
        self._mark = 0
        # The round under way (:meth:`_round`): its time, pending replies, the all-came future, the judging
        # tasks.
        self._now = 0.0
        self._unanswered = 0
        self._all_replied: asyncio.Future[None] | None = None
        self._judging: list[asyncio.Future[Any]] = []

    async def run(self) -> None:
        """Poll forever (the runtime cancels it at close)."""
        interval = self.config.heartbeat_interval_s
        loop = asyncio.get_running_loop()
        rounds = self._rounds
        try:
            # One walk of the membership a round (NodeRounds.of) decides whom to poll, where, and which node
            # has a suspect; the vigils follow the same list.
            rounds.of(self.membership)
            self.vigils.keep(rounds.polled, rounds.generation)
            while True:
                await asyncio.sleep(interval)
                self._mark += 1
                nodes = rounds.of(self.membership)
                self.vigils.keep(rounds.polled, rounds.generation)
                async with CollectorPause(self.config.gc_pause_s):
                    await self._round(nodes, loop.time(), self._mark)
                record_controller_forged(self.membership)
                await self._overdue_swaps(loop.time())
        finally:
            await self.vigils.close()

    async def _round(self, nodes: Sequence[NodeRound], now: float, mark: int) -> None:
        """One heartbeat round of ``nodes`` (``mark``: its number): each node's members asked through its
        agent, or directly on small or unknown nodes, and the events their answers imply. Replies are awaited
        as futures with callbacks; only a node with news gets a task (:meth:`_judge_reply`). Ends when every
        reply came (each bounded by the backend: two intervals) and its work ended."""
        self._now = now
        direct: list[asyncio.Future[Any]] = []
        asked: list[asyncio.Future[Any]] = []
        for node in nodes:
            if node.node_id is None or not self.calls.through_agent(len(node.members)):
                direct.append(asyncio.ensure_future(self._poll_each(node.members, now)))
                continue
            # The round's lists are the node's, kept from round to round, and the arguments shared tuples:
            # what stays alive while replies are awaited is scanned by every collection meanwhile.
            node.args = _asks(node.members) if node.suspect else node.ask
            node.since = None if node.suspect else node.quiet_since
            node.quiet_since = None  # until this round's reply says otherwise
            node.mark = mark
            reply = self.calls.ask_heartbeats(node.node_id, node.handles, node.args,
                                              timeout=self.config.heartbeat_interval_s, mark=mark, since=node.since)
            reply.add_done_callback(node.replied)
            asked.append(reply)
        self._unanswered = len(asked)
        self._all_replied = asyncio.get_running_loop().create_future()
        if not asked:
            self._all_replied.set_result(None)
        try:
            await self._all_replied
            await asyncio.gather(*direct, *self._judging, return_exceptions=True)
        except asyncio.CancelledError:  # the runtime closes: nothing of this round goes on
            for f in (*asked, *direct, *self._judging):
                f.cancel()
            raise
        finally:
            self._judging = []

    def _replied(self, node: NodeRound, reply: asyncio.Future[Any]) -> None:
        """``node``'s reply came (its future's callback, :meth:`_round`)."""
        self._unanswered -= 1
        if reply.cancelled():
            pass
        elif node.since is not None and reply.exception() is None and reply.result() is QUIET:
            # Every answer is the one of the reply marked ``since``, all vouched for: the vouch answers again.
            node.vouch.at = self._now
            node.quiet_since = node.mark
        else:
            self._judging.append(asyncio.ensure_future(self._judge_reply(node, reply, self._now)))
        if self._unanswered == 0 and not self._all_replied.done():
            self._all_replied.set_result(None)

    async def _judge_reply(self, node: NodeRound, reply: asyncio.Future[Any], now: float) -> None:
        """Fire what a non-quiet reply implies; members the agent could not answer for are asked directly."""
        answers = await self.calls.heartbeat_answers(node.names, node.args, self.config.heartbeat_interval_s,
                                                     node.since, reply)
        if answers is None or answers is QUIET:
            await self._poll_each(node.members, now)
            return
        for m, trigger, beat in self._judge_round(node, node.args, answers, now, node.mark):
            # one member's bad answer is no verdict on the others (as a direct poll's, in its own task)
            try:
                await self._fire(m, trigger, beat)
            except Exception:  # noqa: BLE001 - as above
                continue

    def _judge_round(self, node: NodeRound, args: Sequence[Beat], answers: Sequence[Any],
                     now: float, mark: int) -> list[tuple[Member, str, Heartbeat | None]]:
        """Judge each of ``node``'s answers in one loop step; returns the events to fire. An answer equal to
        the member's last, not busy, in a round without a suspect is vouched for by the node's
        :class:`~ftstate.core.liveness.Vouch` instead of handed over; any other takes the vouch back. When all
        were vouched for, ``mark`` becomes the reply the next round names to the agent."""
        members, prev, vouched, vouch = node.members, node.prev, node.vouched, node.vouch
        same_counts = not node.suspect
        all_vouched = same_counts
        fires: list[tuple[Member, str, Heartbeat | None]] = []
        for j, answer in enumerate(answers):
            if same_counts and type(answer) is Heartbeat and answer == prev[j] and answer.busy is False:
                if not vouched[j]:
                    members[j].liveness.vouch = vouch
                    vouched[j] = True
                continue
            all_vouched = False
            m = members[j]
            prev[j] = None
            try:
                if isinstance(answer, BaseException) and not isinstance(answer, MemberLost):
                    continue  # a bug in the member's heartbeat: as a direct poll, no verdict from it
                _, trigger, beat = self._judge(m, now, None if isinstance(answer, MemberLost) else answer,
                                              proved=args[j] is _PROVE)
                if beat is not None:
                    prev[j] = answer  # judged: the next round compares with it
                if trigger is not None:
                    fires.append((m, trigger, beat))
            except Exception:  # noqa: BLE001 - as above: no verdict from it
                continue
            finally:
                if vouched[j]:
                    m.liveness.unvouch()
                    vouched[j] = False
        vouch.at = now
        node.quiet_since = mark if all_vouched else None
        return fires

    async def _poll_each(self, members: Sequence[Member], now: float) -> None:
        # A method of its own: a comprehension here would keep cells of every node's round alive meanwhile.
        await asyncio.gather(*(self.poll(m, now) for m in members), return_exceptions=True)

    async def poll(self, m: Member, now: float) -> bool:
        """One heartbeat of ``m`` and the event it implies; returns whether it answered."""
        try:
            # A suspect must show its weights to be re-admitted: it hashes them afresh.
            prove = m.machine.state == "SUSPECT"
            raw = await self.calls.call(m.name, m.handle, _PROVE if prove else _ASK,
                                        timeout=self.config.heartbeat_interval_s)
        except MemberLost:
            raw = None
        return await self.observe(m, now, raw, proved=prove)

    async def observe(self, m: Member, now: float, raw: Heartbeat | None, *, proved: bool = True) -> bool:
        """Fire the event ``m``'s heartbeat answer ``raw`` (None: none came) implies; returns whether it
        answered. ``proved``: it was asked to hash its weights afresh."""
        answered, trigger, beat = self._judge(m, now, raw, proved)
        if trigger is not None:
            await self._fire(m, trigger, beat)
        return answered

    def _judge(self, m: Member, now: float, raw: Heartbeat | None,
               proved: bool) -> tuple[bool, str | None, Heartbeat | None]:
        """``m``'s answer handed to its liveness: (answered, the trigger to fire or None, the heartbeat).
        ``proved``: it was asked to hash its weights afresh."""
        beat = raw
        if raw is not None and raw.forged:
            record_forged(m, list(raw.forged))
        state = m.machine.state
        if state in GONE:
            return False, None, beat
        if state == "SUSPECT" and not proved and beat is not None:
            # Suspected while its answer was on the way: its cached checksum proves nothing; the next poll
            # asks.
            return True, None, beat
        trigger = m.liveness.observe(
            now, beat, state=state, current_version=self.membership.weights_version,
            current_checksum=self.membership.checksum, source=m.role == "trainer",
        )
        if trigger is not None and not m.machine.can(trigger):
            trigger = None
        if trigger is None and beat is not None and m.pending_version is not None \
                and beat.weights_version >= m.pending_version:
            trigger = SWAPPED
        return beat is not None, trigger, beat

    async def _fire(self, m: Member, trigger: str, beat: Heartbeat | None) -> None:
        if trigger == SWAPPED and beat is not None:
            await self._swapped(m, beat)
            return
        reason = "no heartbeat within the interval" if beat is None else f"progress {beat.progress}, busy={beat.busy}"
        shown = {"checksum": beat.checksum} if beat is not None and trigger in ("verified", "alive_stale") else {}
        if trigger == "verified" and beat is not None and m.pending_version is not None \
                and beat.weights_version >= m.pending_version:
            m.machine.now_holds(beat.weights_version)  # swapped meanwhile
            m.pending_version = None
        await m.machine.fire(trigger, reason=reason, **shown)
        if trigger == "verified":
            await m.machine.fire("admit")

    async def _swapped(self, m: Member, beat: Heartbeat) -> None:
        """``m`` loaded a held-back version at a safe point: it serves only once its own checksum matches."""
        version, m.pending_version = beat.weights_version, None
        if self.membership.versions_by_checksum.get(beat.checksum or "") != version:
            if m.machine.can("invalidate"):
                await m.machine.fire("invalidate", checksum=beat.checksum, reason=(
                    f"swapped to weights version {version} at a safe point holding checksum {beat.checksum}, "
                    "not that version's"))
            return
        m.machine.now_holds(version)
        if m.machine.serving:
            m.machine.record("swapped", checksum=beat.checksum)
        else:  # suspected or made stale while it held the version back: proven now
            await walk_proven(m.machine, "READY", checksum=beat.checksum)

    async def _overdue_swaps(self, now: float) -> None:
        """Suspect, as a wedged engine, a rollout holding a version back past ``safe_point_timeout_s``."""
        bound = self.config.safe_point_timeout_s
        for m in self.membership.pending_swaps():
            if now - m.pending_since >= bound and m.machine.serving and m.machine.can("heartbeat_missed"):
                await m.machine.fire("heartbeat_missed", reason=(
                    f"held weights version {m.pending_version} back for {now - m.pending_since:.1f}s without "
                    f"reaching a safe point (safe_point_timeout_s={bound:g})"))

    async def verdict(self, members: list[Member]) -> None:
        """Wait for the verdict on ``members``, which a call found lost though nobody declared them LOST: each
        is polled until gone or answering and not suspect. Bounded by ``heartbeat_timeout_s`` plus two
        intervals, when a silent member's SUSPECT deadline has expired."""
        loop = asyncio.get_running_loop()
        interval = self.config.heartbeat_interval_s
        until = loop.time() + self.config.heartbeat_timeout_s + 2 * interval
        waiting = list(members)
        while True:
            answered = await asyncio.gather(*(self.poll(m, loop.time()) for m in waiting), return_exceptions=True)
            waiting = [m for m, a in zip(waiting, answered, strict=True)
                       if not m.gone and not (a is True and m.machine.state != "SUSPECT")]
            if not waiting or loop.time() > until:
                return
            await asyncio.sleep(interval)

    async def settle_suspects(self, done: Callable[[], bool] | None = None) -> None:
        """Resolve suspects now: members only blocked behind a hung peer answer and prove their weights, a
        hung one runs into its SUSPECT deadline. Polls until no member is suspect or ``done()`` holds
        (default: the trainer is not suspect), for at most ``heartbeat_timeout_s`` plus an interval."""
        loop = asyncio.get_running_loop()
        interval = self.config.heartbeat_interval_s
        until = loop.time() + self.config.heartbeat_timeout_s + interval
        if done is None:
            def done() -> bool:
                return all(m.machine.state != "SUSPECT" for m in self.membership.role("trainer"))
        while True:
            if not self.membership.any_in("SUSPECT"):
                return
            suspects = [m for m in self.membership.group_members() if m.machine.state == "SUSPECT"]
            if not suspects:
                return
            await asyncio.gather(*(self.poll(m, loop.time()) for m in suspects), return_exceptions=True)
            if done() or loop.time() > until:
                return
            await asyncio.sleep(interval)


class NodeRound:
    """What one round asks of one node: its polled members, their arguments (read-only), whether one was
    SUSPECT, and what the rounds remember of their answers (``prev``, ``vouched``, ``vouch``; ``quiet_since``:
    the mark of the agent's last fully vouched reply, or None)."""

    __slots__ = ("args", "ask", "handles", "mark", "members", "names", "node_id", "prev", "quiet_since", "replied",
                 "since", "suspect", "vouch", "vouched")

    def __init__(self, node_id: str | None, members: list[Member],
                 on_reply: Callable[[NodeRound, asyncio.Future[Any]], None] | None = None) -> None:
        self.node_id = node_id
        self.members = members
        self.names = [m.name for m in members]
        self.handles = [m.handle for m in members]
        self.ask = [_ASK] * len(members)
        self.suspect = any(m.machine.state == "SUSPECT" for m in members)
        #: Each member's last answer judged in these rounds (None: none, or not a plain answer).
        self.prev: list[Any] = [None] * len(members)
        #: Whether the member's liveness holds this round's ``vouch``.
        self.vouched = [False] * len(members)
        self.vouch = Vouch()
        self.quiet_since: int | None = None
        #: This round's call: its arguments, the reply it named (``since``) and its ``mark``.
        self.args: Sequence[Beat] = self.ask
        self.since: int | None = None
        self.mark = 0
        #: The callback of this node's replies, ``on_reply(self, reply)`` (made once, not a partial each
        #: round).
        self.replied = functools.partial(on_reply, self) if on_reply is not None else None


class NodeRounds:
    """The rounds' per-node lists, rebuilt only when the members to poll (their objects, order or nodes)
    changed, so a quiet round makes no new list its calls keep alive; an unmoved ``Membership.roster`` skips
    the walk. ``generation`` is bumped at each rebuild."""

    def __init__(self, on_reply: Callable[[NodeRound, asyncio.Future[Any]], None] | None = None) -> None:
        #: What each round's :attr:`NodeRound.replied` calls (the watchdog's).
        self.on_reply = on_reply
        self.polled: list[Member] = []
        self.generation = 0
        self._nodes: list[str | None] = []
        self._rounds: list[NodeRound] = []
        self._round_of: list[NodeRound] = []  # each polled member's round
        self._roster: int | None = None  # the membership's roster at the last walk

    def of(self, members: Any) -> list[NodeRound]:
        """The rounds for ``members`` by node (a :class:`Membership`'s roster spares the walk)."""
        roster = getattr(members, "roster", None)
        if roster is not None and roster == self._roster:
            return self._rounds
        self._roster = roster
        polled, nodes, round_of, i, n = self.polled, self._nodes, self._round_of, 0, len(self.polled)
        for r in self._rounds:
            r.suspect = False
        for m in members:
            state = m.machine.state  # read once: each read is the member's machine in the cache
            if state in GONE or state == "INIT":
                continue
            if i >= n or polled[i] is not m or nodes[i] != m.node_id:
                return self._build(members)
            if state == "SUSPECT":
                round_of[i].suspect = True
            i += 1
        return self._rounds if i == n else self._build(members)

    def _build(self, members: Any) -> list[NodeRound]:
        by_node: dict[str | None, list[Member]] = {}
        polled: list[Member] = []
        for m in members:
            state = m.machine.state
            if state not in GONE and state != "INIT":
                by_node.setdefault(m.node_id, []).append(m)
                polled.append(m)
        self.polled, self._nodes = polled, [m.node_id for m in polled]
        # A node whose polled members are the same keeps its round, and with it what the rounds remember
        # (its last answers, its vouch, the reply the agent may call quiet): a member starting or lost
        # elsewhere no longer makes every node's next two rounds read and judge all its members.
        kept = {r.node_id: r for r in self._rounds}
        self._rounds = [self._kept(kept.get(node), node, ms) for node, ms in by_node.items()]
        where = {node: r for node, r in zip(by_node, self._rounds, strict=True)}
        self._round_of = [where[m.node_id] for m in polled]
        self.generation += 1
        return self._rounds


    def _kept(self, r: NodeRound | None, node_id: str | None, members: list[Member]) -> NodeRound:
        """``node_id``'s round of the last build if it polled the same ``members`` (its suspect flag
        read afresh), else a new one."""
        if r is None or len(r.members) != len(members) or any(a is not b for a, b in zip(r.members, members, strict=True)):
            return NodeRound(node_id, members, self.on_reply)
        r.suspect = any(m.machine.state == "SUSPECT" for m in members)
        return r


def record_forged(m: Member, forged: Any) -> None:
    """Audit what ``m`` dropped as forged since its last heartbeat (``forged_message`` records)."""
    for entry in forged if isinstance(forged, list) else []:
        if isinstance(entry, dict):
            m.machine.record("forged_message", **{k: v for k, v in entry.items() if k != "t"})


def record_controller_forged(membership: Membership) -> None:
    """Audit what this controller dropped as forged since the last round, once a round."""
    from ftstate.transport import auth

    for entry in auth.drain_forged():
        membership.group.record("forged_message", reported_by="controller", **{k: v for k, v in entry.items() if k != "t"})
