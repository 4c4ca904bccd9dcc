"""The watchdog's per-node lists (``NodeRounds``): kept from round to round only while the
members to poll are the same, so keeping them never changes who is polled; the vigils that
follow them; and a suspect's answer judged only when it was asked to prove its weights."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ftstate.controller.backend import QUIET, QUIET_WIRE, AgentMemory
from ftstate.controller.vigil import Vigils
from ftstate.controller.watchdog import NodeRounds
from ftstate.core.liveness import Heartbeat
from ftstate.core.protocol import Beat, Located


@dataclass
class _Machine:
    state: str = "READY"


@dataclass(eq=False)
class _Member:
    name: str
    node_id: str | None
    machine: _Machine = field(default_factory=_Machine)
    handle: object = field(default_factory=object)

    @property
    def gone(self) -> bool:
        return self.machine.state in ("LOST", "RETIRED")


def polled(rounds) -> dict[str | None, list[str]]:
    return {r.node_id: r.names for r in rounds}


def everyone(rounds) -> set[str]:
    return {name for r in rounds for name in r.names}


def test_the_same_members_get_the_same_lists_and_any_change_is_in_the_next_round():
    ms = [_Member(f"rollout-{i}", f"n{i % 2}") for i in range(6)]
    rounds = NodeRounds()
    first = rounds.of(ms)
    assert polled(first) == {"n0": ["rollout-0", "rollout-2", "rollout-4"], "n1": ["rollout-1", "rollout-3", "rollout-5"]}
    assert [r.handles for r in first] == [[m.handle for m in ms[0::2]], [m.handle for m in ms[1::2]]]
    again = rounds.of(ms)
    assert again is first and all(a is b for a, b in zip(again, first, strict=True))  # nothing rebuilt

    ms[3].machine.state = "LOST"  # gone: not polled from this round on
    assert polled(rounds.of(ms))["n1"] == ["rollout-1", "rollout-5"]

    newcomer = _Member("rollout-6", None, _Machine("INIT"))
    ms.append(newcomer)
    assert "rollout-6" not in everyone(rounds.of(ms))  # still constructing
    newcomer.machine.state = "STANDBY"
    newcomer.node_id = "n2"  # located when it came up
    assert polled(rounds.of(ms))["n2"] == ["rollout-6"]

    ms[0].node_id = "n2"  # a member reported on another node is polled there
    got = polled(rounds.of(ms))
    assert got["n2"] == ["rollout-0", "rollout-6"] and got["n0"] == ["rollout-2", "rollout-4"]

    ms.pop()  # a member taken out of the membership
    assert "rollout-6" not in everyone(rounds.of(ms))


def test_a_round_hands_out_the_plain_arguments_for_every_member():
    ms = [_Member(f"rollout-{i}", "n0") for i in range(4)]
    [node] = NodeRounds().of(ms)
    assert node.ask == [Beat(False, True)] * 4 and node.members == ms


def test_the_walk_that_checks_the_lists_notes_which_nodes_have_a_suspect_without_rebuilding():
    ms = [_Member(f"rollout-{i}", f"n{i % 2}") for i in range(6)]
    rounds = NodeRounds()
    first = rounds.of(ms)
    generation = rounds.generation
    assert [r.suspect for r in first] == [False, False]
    ms[3].machine.state = "SUSPECT"  # on n1
    assert [r.suspect for r in rounds.of(ms)] == [False, True]
    ms[3].machine.state = "READY"  # verified again
    assert [r.suspect for r in rounds.of(ms)] == [False, False]
    assert rounds.generation == generation and rounds.of(ms) is first  # none of that rebuilt the lists
    ms[2].machine.state = "LOST"
    rounds.of(ms)
    assert rounds.generation == generation + 1 and ms[2] not in rounds.polled


def test_a_rebuild_keeps_the_round_of_a_node_whose_members_are_the_same():
    """A member lost or started on one node rebuilds the lists, but another node's round (its last
    answers, its vouch, the reply the agent may call quiet) goes on; a node whose members moved gets a
    fresh one."""
    ms = [_Member(f"rollout-{i}", f"n{i % 2}") for i in range(6)]
    rounds = NodeRounds()
    n0, n1 = rounds.of(ms)
    n0.quiet_since, n0.prev[0] = 7, "answer"
    ms[3].machine.state = "LOST"  # on n1
    kept, fresh = rounds.of(ms)
    assert kept is n0 and kept.quiet_since == 7 and kept.prev[0] == "answer"
    assert fresh is not n1 and fresh.names == ["rollout-1", "rollout-5"] and fresh.quiet_since is None
    ms[0].machine.state = "SUSPECT"
    ms.append(_Member("rollout-6", "n1"))  # a rebuild: the kept round's suspect is read afresh
    assert [r.suspect for r in rounds.of(ms)] == [True, False] and rounds.of(ms)[0] is n0


def test_the_lists_are_handed_back_without_a_walk_while_the_roster_holds():
    ms = _Roster(_Member(f"rollout-{i}", f"n{i % 2}") for i in range(4))
    rounds = NodeRounds()
    first = rounds.of(ms)
    walks = ms.walks
    ms[1].machine.state = "SUSPECT"  # unseen: the roster says nothing moved (a real one would)
    assert rounds.of(ms) is first and ms.walks == walks and not any(r.suspect for r in first)
    ms.roster += 1
    assert [r.suspect for r in rounds.of(ms)] == [False, True] and ms.walks == walks + 1
    ms.append(_Member("rollout-4", "n0"))
    ms.roster += 1
    assert "rollout-4" in everyone(rounds.of(ms))


def test_the_roster_moves_with_whom_the_watchdog_polls_and_nothing_else():
    """A real membership: a sync (every member through its transfer states) leaves the roster
    alone; a member suspected, verified again, lost, a spare started and located move it."""
    from ftstate.simulation import clock
    from ftstate.simulation.scenario import Shape, simulated_runtime

    async def main():
        rt, cluster = simulated_runtime(Shape(rollouts=3, spares=1))
        await rt.start()
        try:
            ms = rt._membership
            await rt.sync()
            before = ms.roster
            await rt.sync()
            await rt.sync()
            assert ms.roster == before
            m = ms.get("rollout-1")
            await m.machine.fire("heartbeat_missed", reason="staged by the test")
            assert ms.roster == before + 1
            cluster.kill_member("rollout-2")
            await rt.sync()  # the loss, and the spare promoted and another started
            assert ms.roster > before + 1
            located = ms.roster
            ms.located(m, Located(pid=1, node="127.0.0.1", node_id=m.node_id, member=m.name, role=m.role))
            assert ms.roster == located + 1
        finally:
            await rt.close()

    with asyncio.Runner(loop_factory=clock.VirtualTimeLoop) as runner:
        runner.run(main())


def test_an_agent_answers_quiet_only_to_the_reply_it_keeps_for_the_same_members_and_answers():
    memory = AgentMemory()
    a, b = object(), object()
    beats = [{"progress": 3, "busy": False}, {"progress": 5, "busy": False}]
    assert memory.reply([a, b], list(beats), mark=1, since=None) == beats  # nothing named: the answers
    assert memory.reply([a, b], [dict(x) for x in beats], mark=2, since=1) == QUIET_WIRE
    assert memory.reply([a, b], list(beats), mark=3, since=1) == beats  # 2 is kept: 1 is gone
    assert memory.reply([a, b], list(beats), mark=4, since=3) == QUIET_WIRE
    moved = [beats[0], {"progress": 6, "busy": False}]
    assert memory.reply([a, b], moved, mark=5, since=4) == moved  # one answer changed
    assert memory.reply([b, a], moved, mark=6, since=5) == moved  # other members (same answers)
    assert memory.reply([b, a], moved, mark=None, since=6) == QUIET_WIRE  # unmarked: kept as it was
    assert memory.reply([b, a], moved, mark=7, since=6) == QUIET_WIRE
    assert memory.reply([b, a], moved, mark=8, since=None) == moved  # not asked: never quiet


class _PendingCalls:
    """What the vigils call: a call that stays pending until the test ends it."""

    def __init__(self) -> None:
        self.pending: dict[str, asyncio.Future] = {}

    async def call(self, member, handle, method, *args, timeout=None):
        self.pending[member] = asyncio.get_running_loop().create_future()
        return await self.pending[member]


class _Walked(list):
    """A member list that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


class _Roster(_Walked):
    """A counted member list with a membership's ``roster``."""

    roster = 0


def test_vigils_walk_nobody_while_the_generation_holds_and_none_ended_and_renew_one_that_ended():
    async def main():
        calls = _PendingCalls()
        vigils = Vigils(calls)
        ms = _Walked(_Member(f"rollout-{i}", "n0") for i in range(3))
        vigils.keep(ms, 1)
        await asyncio.sleep(0)
        assert sorted(calls.pending) == ["rollout-0", "rollout-1", "rollout-2"] and ms.walks == 1
        vigils.keep(ms, 1)
        assert ms.walks == 1  # same generation, no vigil ended: nothing looked at
        calls.pending.pop("rollout-1").set_exception(RuntimeError("the call broke"))
        for _ in range(3):  # the vigil's task ends, then its done callback runs
            await asyncio.sleep(0)
        vigils.keep(ms, 1)  # a vigil ended: looked again, and renewed
        await asyncio.sleep(0)
        assert ms.walks == 2 and "rollout-1" in calls.pending
        ms.append(_Member("rollout-3", "n0"))
        vigils.keep(ms, 2)  # a new generation: the newcomer gets its vigil
        await asyncio.sleep(0)
        assert "rollout-3" in calls.pending
        vigils.keep(ms, None)  # no generation: always looked at
        assert ms.walks == 4
        await vigils.close()

    asyncio.run(main())


def test_a_suspect_whose_answer_was_not_asked_to_prove_its_weights_is_not_verified_by_it():
    """A member suspected while a round's answer was on its way answered with the checksum it
    cached at its last commit: that answer must not re-admit it; an answer hashed afresh does."""
    from ftstate.simulation import clock
    from ftstate.simulation.scenario import Shape, simulated_runtime

    async def main():
        rt, _ = simulated_runtime(Shape(rollouts=2, spares=0), overrides={
            "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "fault_tolerance": {"enable": False}})
        await rt.start()
        try:
            await rt.sync()
            ms = rt._membership
            m = ms.get("rollout-0")
            await m.machine.fire("heartbeat_missed", reason="staged by the test")
            answer = Heartbeat(progress=1, busy=False, weights_version=ms.weights_version, checksum=ms.checksum)
            now = asyncio.get_running_loop().time()
            assert await rt._watchdog.observe(m, now, answer, proved=False)
            assert m.machine.state == "SUSPECT"
            await rt._watchdog.observe(m, now, answer, proved=True)
            assert m.machine.state == "READY"
        finally:
            await rt.close()

    with asyncio.Runner(loop_factory=clock.VirtualTimeLoop) as runner:
        runner.run(main())


def _entered(rt, name, state, after):
    return next(r["t"] for r in rt.audit.records if r["event"] == "transition" and r.get("member") == name
                and r["to"] == state and r["t"] >= after)


def test_after_a_long_quiet_stretch_a_hung_spare_is_lost_after_the_timeout_and_a_hung_rollout_at_once():
    """Quiet rounds hand nobody's answer over one by one (the node's vouch stands for them): a
    spare that then hangs is still silent only since its last answer, so it is declared
    unresponsive a heartbeat_timeout_s later, not at its first miss; a serving rollout that hangs
    is suspect at its first miss, as ever."""
    from ftstate.simulation import clock
    from ftstate.simulation.scenario import Shape, simulated_runtime

    interval, timeout = 0.2, 2.0

    async def main():
        # 1 trainer, 6 rollouts, a spare per role: 9 members on one node, asked through its agent
        rt, cluster = simulated_runtime(Shape(rollouts=6, spares=1), overrides={
            "heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout})
        replies: list[object] = []
        real = cluster.heartbeats_future

        def recorded(*args, **kw):  # each node's reply, as the watchdog's round gets it
            reply = real(*args, **kw)
            reply.add_done_callback(lambda f: replies.append(f.exception() or f.result()))
            return reply

        cluster.heartbeats_future = recorded
        await rt.start()
        try:
            await rt.sync()
            ms = rt._membership
            replies.clear()
            await asyncio.sleep(40 * interval)  # quiet: same answers, round after round
            # after the sync's answers, two full replies (judged, then all vouched for), then the
            # agent answers QUIET alone
            assert replies.count(QUIET) >= 36 and all(r is QUIET for r in replies[-30:]), replies[:4]
            [spare] = [m for m in ms.spares("rollout", "STANDBY")]
            assert spare.liveness.vouch is not None  # vouched for, not handed every answer
            loop = asyncio.get_running_loop()
            t_hang = loop.time() - rt.audit._t0
            replies.clear()
            cluster.hang_member(spare.name)
            cluster.hang_member("rollout-2")
            await asyncio.sleep(timeout + 4 * interval)
            assert replies and QUIET not in replies[:3]  # a silent member is not the same answer
            assert _entered(rt, "rollout-2", "SUSPECT", t_hang) - t_hang <= 2 * interval
            silent = _entered(rt, spare.name, "LOST", t_hang) - t_hang
            assert timeout - interval <= silent <= timeout + 2 * interval, silent
        finally:
            await rt.close()

    with asyncio.Runner(loop_factory=clock.VirtualTimeLoop) as runner:
        runner.run(main())


class _Backend:
    """A node agent that answers a heartbeat round with ``answer``."""

    def __init__(self, answer) -> None:
        self.answer = answer

    async def heartbeats(self, node_id, handles, args, timeout, *, mark=None, since=None):
        return self.answer

    # the default of every backend: heartbeats() in a task
    from ftstate.controller.backend import ClusterBackend

    heartbeats_future = ClusterBackend.heartbeats_future


def test_an_agent_that_does_not_answer_for_each_member_has_them_asked_directly():
    from ftstate.controller.backend import QUIET, ActorDied
    from ftstate.controller.calls import ActorCalls
    from ftstate.core.errors import MemberLost

    async def main():
        names, handles, args = ["a", "b"], [object(), object()], [Beat(False, True)] * 2
        died = []
        beat = Heartbeat(progress=0, busy=False, weights_version=1, checksum="x", pid=1)

        async def ask(answer, since=None):
            return await ActorCalls(lambda m, why: died.append(m), _Backend(answer)).heartbeats(
                "n0", names, handles, args, 1.0, mark=2, since=since)

        assert await ask([beat]) is None  # one answer for two members: a bug, no verdict from it
        assert await ask("not a list") is None
        assert await ask(QUIET) is None  # "the same as the reply you named", when none was named
        assert await ask(QUIET, since=1) is QUIET
        out = await ask([beat, ActorDied("SIGKILL")])
        assert out[0] is beat and isinstance(out[1], MemberLost) and died == ["b"]

    asyncio.run(main())
