"""ActorCalls on a real Ray actor: an ftstate error raised inside a worker reaches the
controller as the same class with its fields (not as Ray's wrapper), named after the worker;
a SIGKILLed worker becomes MemberLost and one `died` report; a node's agent answers the
heartbeats of the workers on its node in one call, each as its own call would have ended."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any, NamedTuple

import pytest

from ftstate.controller.backend import QUIET
from ftstate.controller.calls import ActorCalls
from ftstate.controller.ray.backend import RayBackend
from ftstate.core.errors import (
    CommunicatorAborted,
    EngineProcessDied,
    MemberLost,
    PeerLost,
    StaleGroupVersion,
    SyncTimeout,
)
from ftstate.core.liveness import Heartbeat
from ftstate.core.protocol import Beat, UserCall

pytestmark = pytest.mark.ray


class UserMethods:
    """A stand-in worker that answers user calls (:class:`UserCall`) with its own methods."""

    async def call(self, req: UserCall) -> Any:
        return await _maybe_await(getattr(self, req.name)(*req.args, **req.kwargs))


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


class Raiser(UserMethods):
    def pid(self) -> int:
        return os.getpid()

    def fail(self, kind: str) -> None:
        if kind == "stale":
            raise StaleGroupVersion("weights", got=3, current=4, peer="rank 1")
        if kind == "aborted":
            raise CommunicatorAborted("weights", 4, 1, "peer lost during bucket 2/5")
        if kind == "engine":
            raise EngineProcessDied(process="VLLM::Worker_TP1", pid=4242, how="was killed by SIGKILL")
        if kind == "peer":
            raise PeerLost("rank 1: a peer was lost", group="weights", group_version=4, rank=1, op="seal", peer=0)
        raise SyncTimeout("weight transfer", key="sync_timeout_s", seconds=2.0, member="rank 1", group_version=4)


async def test_worker_errors_come_back_typed_with_their_fields(ray_cluster):
    ray = ray_cluster
    died: list[tuple[str, str]] = []
    calls = ActorCalls(lambda member, reason: died.append((member, reason)), RayBackend())
    handle = ray.remote(Raiser).options(num_cpus=0).remote()
    try:
        with pytest.raises(StaleGroupVersion) as stale:
            await calls.call("rollout-1", handle, UserCall("fail", ("stale",)))
        assert (stale.value.got, stale.value.current) == (3, 4)
        with pytest.raises(CommunicatorAborted) as aborted:
            await calls.call("rollout-1", handle, UserCall("fail", ("aborted",)))
        assert aborted.value.reason == "peer lost during bucket 2/5"
        with pytest.raises(PeerLost) as lost:
            await calls.call("rollout-1", handle, UserCall("fail", ("peer",)))
        assert str(lost.value).startswith("rollout-1: ")  # named after the worker
        assert (lost.value.peer, lost.value.op, lost.value.group_version) == (0, "seal", 4)
        with pytest.raises(SyncTimeout) as timeout:
            await calls.call("rollout-1", handle, UserCall("fail", ("timeout",)))
        assert (timeout.value.key, timeout.value.seconds) == ("sync_timeout_s", 2.0)
        assert died == []

        # a worker whose engine process died says so: the typed error, and its member reported dead
        with pytest.raises(EngineProcessDied) as engine:
            await calls.call("rollout-2", handle, UserCall("fail", ("engine",)))
        assert (engine.value.process, engine.value.pid) == ("VLLM::Worker_TP1", 4242)
        assert [m for m, _ in died] == ["rollout-2"] and "VLLM::Worker_TP1" in died[0][1]
        died.clear()

        pid = await calls.call("rollout-1", handle, UserCall("pid"))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(MemberLost, match="rollout-1"):
            await calls.call("rollout-1", handle, UserCall("pid"))
        assert [m for m, _ in died] == ["rollout-1"]
    finally:
        ray.kill(handle)


class Beater(UserMethods):
    def __init__(self) -> None:
        self.hung = False

    def pid(self) -> int:
        return os.getpid()

    def hang(self) -> None:
        self.hung = True

    async def heartbeat(self, req: Beat) -> Heartbeat:
        if self.hung:
            await asyncio.Event().wait()
        # what it was asked shows in the answer: ``busy`` carries ``prove``, ``forged`` one record
        return Heartbeat(progress=0, busy=req.prove, weights_version=0, checksum=None, pid=os.getpid(),
                         forged=({"asked": True},) if req.forged else ())


async def test_a_nodes_agent_answers_for_each_worker_there_as_its_own_call_would_have_ended(ray_cluster):
    ray = ray_cluster
    died: list[str] = []
    backend = RayBackend()
    calls = ActorCalls(lambda member, reason: died.append(member), backend)
    handles = [ray.remote(Beater).options(num_cpus=0, max_concurrency=4).remote() for _ in range(3)]
    members = [(f"rollout-{i}", h) for i, h in enumerate(handles)]
    names = [n for n, _ in members]
    node = ray.get_runtime_context().get_node_id()
    try:
        pids = [await calls.call(n, h, UserCall("pid")) for n, h in members]
        # while the agent starts, None at once (ask directly): never a wait for its start
        answers = await calls.heartbeats(node, names, handles, [Beat(False, True)] * 3, timeout=5.0)
        assert answers is None
        for _ in range(60):
            await asyncio.sleep(0.5)
            answers = await calls.heartbeats(node, names, handles, [Beat(False, True), Beat(True, True), Beat(False, False)],
                                            timeout=5.0)
            if answers is not None:
                break
        assert answers is not None
        assert [a.pid for a in answers] == pids and [a.busy for a in answers] == [False, True, False]
        assert answers[0].forged and not answers[2].forged
        # The same answers again, naming the reply the agent keeps: QUIET alone; naming one it
        # no longer keeps: the answers.
        ask = [Beat(False, True)] * 3
        assert isinstance(await calls.heartbeats(node, names, handles, ask, timeout=5.0, mark=1), list)
        assert await calls.heartbeats(node, names, handles, ask, timeout=5.0, mark=2, since=1) is QUIET
        assert isinstance(await calls.heartbeats(node, names, handles, ask, timeout=5.0, mark=3, since=1), list)
        assert await calls.heartbeats(node, names, handles, ask, timeout=5.0, mark=4, since=3) is QUIET
        os.kill(pids[0], signal.SIGKILL)
        await calls.call("rollout-1", handles[1], UserCall("hang"))
        # a death and a hang are not the same answers: never quiet
        dead, hung, alive = await calls.heartbeats(node, names, handles, ask, timeout=1.0, mark=5, since=4)
        assert isinstance(dead, MemberLost) and died == ["rollout-0"]
        assert isinstance(hung, MemberLost) and "within 1s" in str(hung)
        assert alive.pid == pids[2]
    finally:
        for h in handles:
            ray.kill(h)
        backend.close()


class Stager(UserMethods):
    """A worker whose calls take as long as they are told, or raise, or wait until released."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    def pid(self) -> int:
        return os.getpid()

    async def stage(self, seconds: float, fail: bool = False) -> dict:
        await asyncio.sleep(seconds)
        if fail:
            raise PeerLost("rank 2: a peer was lost", group="weights", group_version=4, rank=2, op="recv", peer=0)
        return {"pid": os.getpid(), "seconds": seconds}

    async def wait(self) -> dict:
        await self.released.wait()
        return {"pid": os.getpid()}

    def release(self) -> None:
        self.released.set()


class Target(NamedTuple):
    """Whom fan_out calls (a CallTarget), without a membership."""

    name: str
    handle: Any
    node_id: str | None


async def test_a_nodes_agent_streams_each_workers_outcome_as_it_ends(ray_cluster):
    """ActorCalls.fan_out through a node's agent: results in order, each outcome reported as it
    ends (a death and a worker's own error at once, long before the slow worker ends), a death
    reported once, as a direct call's would be."""
    ray = ray_cluster
    died: list[str] = []
    backend = RayBackend()
    calls = ActorCalls(lambda member, reason: died.append(member), backend, agent_min_members=2)
    handles = [ray.remote(Stager).options(num_cpus=0, max_concurrency=4).remote() for _ in range(4)]
    node = ray.get_runtime_context().get_node_id()
    targets = [Target(f"rollout-{i}", h, node) for i, h in enumerate(handles)]
    try:
        pids = [await calls.call(n, h, UserCall("pid")) for n, h, _ in targets]
        # the agent starts on first use: meanwhile the members are called directly
        first = await calls.fan_out(targets, [UserCall("stage", (0.0,))] * 4)
        assert [r["pid"] for r in first] == pids
        for _ in range(60):
            if node in backend._agents and backend._agents[node][1].done():
                break
            await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        ended: list[tuple[int, float]] = []
        t0 = loop.time()
        fanned = asyncio.ensure_future(calls.fan_out(
            targets, [UserCall("stage", (0.0,)), UserCall("wait"), UserCall("stage", (0.2, True)),
                      UserCall("stage", (0.0,))],
            lambda i, outcome: ended.append((i, loop.time() - t0))))
        # Each outcome is reported as it ends: the other three come while rollout-1 still
        # waits (the batch cannot end before it), however slow this machine is.
        for _ in range(400):
            if len(ended) == 3:
                break
            await asyncio.sleep(0.05)
        assert sorted(i for i, _ in ended) == [0, 2, 3] and not fanned.done()
        os.kill(pids[1], signal.SIGKILL)  # the one that waits
        outcomes = await asyncio.wait_for(fanned, 30)
        assert outcomes[0]["pid"] == pids[0] and outcomes[3]["pid"] == pids[3]
        assert isinstance(outcomes[1], MemberLost) and died == ["rollout-1"]
        assert isinstance(outcomes[2], PeerLost) and str(outcomes[2]).startswith("rollout-2: ")
        assert [i for i, _ in ended][-1] == 1
    finally:
        for h in handles:
            ray.kill(h)
        backend.close()
