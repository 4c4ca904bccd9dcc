"""The Ray side of the controller's cluster seam, the runtime's default: worker hosts as Ray actors in
placement groups, Ray's failures translated into the seam's classes, heartbeats through one
:class:`LivenessAgent` per node. Kills on the controller's node are SIGKILLs: a stopped process never exits
gracefully for ``ray.kill``, and a hung one must not keep its group sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ftstate.controller.backend import (
    QUIET,
    QUIET_WIRE,
    ActorDied,
    ActorUnreachable,
    AgentMemory,
    CallTimedOut,
    ClusterBackend,
    Pool,
    RemoteError,
)
from ftstate.controller.ray import cluster
from ftstate.core.config import RolePlacement
from ftstate.core.errors import NoFreeSlot
from ftstate.core.protocol import Beat, Request


class RayBackend(ClusterBackend):
    """Ray actors for one runtime (see the module docstring)."""

    def __init__(self) -> None:
        self._node: str | None = None
        # node id -> its LivenessAgent (heartbeats) and the call that says it is up
        self._agents: dict[str, tuple[Any, asyncio.Future[Any]]] = {}

    def connect(self, address: str | None) -> bool:
        started = cluster.connect(address)
        self._node = cluster.node_address()
        return started

    def shutdown(self) -> None:
        cluster.shutdown()

    def node_address(self) -> str:
        return cluster.node_address()

    def node_id(self) -> str | None:
        return cluster.node_id()

    def nodes(self) -> list[dict[str, Any]]:
        from ftstate.controller.ray.placement import cluster_nodes

        return cluster_nodes()

    def versions(self) -> dict[str, str]:
        import ray
        import torch

        return {"ray": ray.__version__, "torch": torch.__version__}

    def resource_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                      placement: RolePlacement) -> Pool:
        from ftstate.controller.ray.placement import ResourcePool

        return ResourcePool(run_id, name, slots, cpus=cpus, gpus=gpus, placement=placement)

    def spare_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                   placement: RolePlacement) -> Pool:
        from ftstate.controller.ray.placement import SparePool

        return SparePool(run_id, name, slots, cpus=cpus, gpus=gpus, placement=placement)

    def start_actor(self, *, name: str, run_id: str, pool: Pool, slot: int, role: str, user_class: type,
                    args: Sequence[Any], kwargs: Mapping[str, Any], host: Mapping[str, Any]) -> Any:
        import ray

        from ftstate.worker.host import WorkerHost

        actor_cls = ray.remote(WorkerHost)
        return actor_cls.options(
            name=f"ftstate-{run_id}-{name}",
            namespace="ftstate",
            max_restarts=0,
            max_concurrency=64,
            **pool.options(slot),  # type: ignore[attr-defined]
        ).remote(name, role, user_class, tuple(args), dict(kwargs), host["backend"], host["bucket_bytes"],
                 run=run_id, secret=host["secret"], integrity=host["integrity"], held_proof=host["held_proof"],
                 staging_spare=host["staging_spare"], in_flight=host.get("in_flight", False))

    async def call(self, handle: Any, req: Request, timeout: float | None) -> Any:
        return await ray_call(handle, req.method, (req,), timeout)

    async def call_helper(self, handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
        return await ray_call(handle, method, args, timeout)

    def _agent(self, node_id: str) -> Any:
        """The node's agent, started on first use; raises :class:`CallTimedOut` while it starts (never waited
        on) and :class:`ActorDied` when it did not start."""
        known = self._agents.get(node_id)
        if known is None:
            agent = _start_liveness_agent(node_id)
            known = self._agents[node_id] = (agent, asyncio.ensure_future(ray_call(agent, "ready", (), None)))
        agent, up = known
        if not up.done():
            # Never waited on: waiting for an agent would sample its members late; they are asked directly.
            raise CallTimedOut(f"the liveness agent of node {node_id[:8]} is still starting")
        if up.exception() is not None:
            self._agents.pop(node_id, None)
            raise ActorDied(f"the liveness agent of node {node_id[:8]} did not start: {up.exception()}")
        return agent

    async def heartbeats(self, node_id: str, handles: Sequence[Any], args: Sequence[Beat],
                         timeout: float, *, mark: int | None = None, since: int | None = None) -> Any:
        agent = self._agent(node_id)
        try:
            answers = await ray_call(agent, "heartbeats",
                                     (list(handles), list(args), timeout, mark, since), 2 * timeout)
        except ActorDied:
            self._agents.pop(node_id, None)  # started afresh at the next interval
            raise
        if answers == QUIET_WIRE:
            return QUIET
        if not isinstance(answers, list):
            return answers  # not a reply: the caller has its members asked directly
        return [_decoded(a) for a in answers]

    async def calls(self, node_id: str, handles: Sequence[Any],
                    requests: Sequence[Request]) -> AsyncIterator[list[tuple[int, Any]]]:
        import ray.exceptions as rex

        agent = self._agent(node_id)
        # A streaming call: the agent yields its members' outcomes as they end.
        stream = agent.calls.options(num_returns="streaming").remote(
            list(handles), list(requests))
        finished = False
        try:
            async for ref in stream:
                yield [(j, _decoded_call(o)) for j, o in await ref]
            finished = True
        except rex.ActorDiedError as exc:
            self._agents.pop(node_id, None)  # started afresh at the next use
            raise ActorDied(str(exc)) from exc
        except rex.ActorUnavailableError as exc:
            raise ActorUnreachable(str(exc)) from exc
        except rex.RayTaskError as exc:  # the agent's own failure (its members' are outcomes)
            raise RemoteError(exc.cause if isinstance(getattr(exc, "cause", None), Exception) else exc,
                              str(exc)) from exc
        finally:
            if not finished:  # cancelled (the state's deadline) or failed: the agent's call goes
                ray_cancel(stream)

    def close(self) -> None:
        agents, self._agents = self._agents, {}
        if not agents:
            return
        import ray

        for agent, up in agents.values():
            up.cancel()
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(agent, no_restart=True)

    def kill(self, handle: Any, *, pid: int | None, node: str | None) -> None:
        import ray

        if pid and node is not None and node == self._node and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(handle, no_restart=True)

    def start_node_agent(self, name: str, node_id: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ftstate.controller.nodecopies import NodeAgent

        address = next((n["address"] for n in self.nodes() if n["node_id"] == node_id), None)
        if address is None:
            raise NoFreeSlot(f"node agent {name}", f"no alive node {node_id[:8]} to start it on")
        return ray.remote(NodeAgent).options(
            name=name, namespace="ftstate", num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, address)

    def start_node_watcher(self, node_id: str, options: Mapping[str, Any]) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ftstate.controller.maintenance.node_actor import NODE_SOURCES, NodeWatcherActor

        return (
            ray.remote(NodeWatcherActor)
            .options(num_cpus=0, max_concurrency=len(NODE_SOURCES) + 2,
                     scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            .remote(node_id=node_id, **options)
        )

    async def draining_nodes(self, timeout: float) -> Mapping[str, int]:
        # The GCS's view (see maintenance/ray_drain.py); a blocking RPC bounded by timeout, so off the loop.
        import ray

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised in this process")
        gcs = ray._private.worker.global_worker.gcs_client
        return await asyncio.to_thread(gcs.get_draining_nodes, timeout=timeout)

    def rendezvous_store(self, host: str) -> Any:
        from ftstate.transport import StoreServer

        return StoreServer(host=host)


async def ray_call(handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
    """``method(*args)`` on the Ray actor ``handle``, Ray's outcomes turned into the seam's (the
    module docstring); in the controller, and in a node's :class:`LivenessAgent`."""
    import ray.exceptions as rex

    ref = getattr(handle, method).remote(*args)
    try:
        if timeout is None:
            return await ref
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
    except rex.ActorDiedError as exc:
        raise ActorDied(str(exc)) from exc
    except rex.ActorUnavailableError as exc:
        raise ActorUnreachable(str(exc)) from exc
    except rex.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise RemoteError(cause, str(exc)) from exc
        raise
    except TimeoutError as exc:
        ray_cancel(ref)
        raise CallTimedOut(f"no answer within {timeout:g}s") from exc


class LivenessAgent:
    """Ray actor pinned to one node (no CPU, no torch) that asks the worker hosts there for their heartbeats
    and answers for all in one reply."""

    def __init__(self) -> None:
        self._memory = AgentMemory()

    async def ready(self) -> bool:
        """Answers once the agent is up (the backend asks its members directly until then)."""
        return True

    async def heartbeats(self, handles: list[Any], args: list[Beat], timeout: float,
                         mark: int | None = None, since: int | None = None) -> Any:
        """Each member's answer, or its outcome encoded as a tuple (the seam's exceptions do not all pickle);
        or :data:`~ftstate.controller.backend.QUIET_WIRE` when nothing changed since ``since``."""
        answers = await self._answers(handles, args, timeout)
        return self._memory.reply(handles, answers, mark, since)

    async def _answers(self, handles: list[Any], args: list[Beat], timeout: float) -> list[Any]:
        async def one(handle: Any, a: Beat) -> Any:
            try:
                return await ray_call(handle, a.method, (a,), timeout)
            except ActorDied as exc:
                return ("died", str(exc))
            except ActorUnreachable as exc:
                return ("unreachable", str(exc))
            except CallTimedOut as exc:
                return ("timeout", str(exc))
            except RemoteError as exc:
                return ("remote", exc.cause, exc.text)

        return list(await asyncio.gather(*(one(h, a) for h, a in zip(handles, args, strict=True))))


    async def calls(self, handles: list[Any], requests: list[Request]) -> AsyncIterator[list[Any]]:
        """``requests[i]`` to each of ``handles`` at once; yields ``(i, outcome)`` as they end, encoded as
        :meth:`heartbeats` does. Cancelled, it cancels the calls under way."""
        async def one(i: int, handle: Any, req: Request) -> tuple[int, Any]:
            try:
                return i, ("ok", await ray_call(handle, req.method, (req,), None))
            except ActorDied as exc:
                return i, ("died", str(exc))
            except ActorUnreachable as exc:
                return i, ("unreachable", str(exc))
            except RemoteError as exc:
                return i, ("remote", exc.cause, exc.text)

        pending = {asyncio.ensure_future(one(i, h, r)) for i, (h, r) in enumerate(zip(handles, requests, strict=True))}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                yield [t.result() for t in done]
        finally:
            for t in pending:
                t.cancel()


#: A member's outcome as a node's agent reports it (not a heartbeat's dict), by kind.
_OUTCOMES = {"died": ActorDied, "unreachable": ActorUnreachable, "timeout": CallTimedOut}


def _decoded(answer: Any) -> Any:
    if isinstance(answer, tuple) and answer and answer[0] == "remote":
        return RemoteError(answer[1], answer[2])
    if isinstance(answer, tuple) and len(answer) == 2 and answer[0] in _OUTCOMES:
        return _OUTCOMES[answer[0]](answer[1])
    return answer


def _decoded_call(outcome: Any) -> Any:
    """A member's outcome of :meth:`LivenessAgent.calls`: its result, or the seam's exception."""
    return outcome[1] if outcome[0] == "ok" else _decoded(outcome)


def _start_liveness_agent(node_id: str) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(LivenessAgent).options(
        num_cpus=0, max_restarts=0, namespace="ftstate",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()


def ray_cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # best effort: the actor may already be gone
        ray.cancel(ref)


__all__ = ["LivenessAgent", "RayBackend", "ray_call", "ray_cancel"]
