"""The Ray side of the seam (:class:`~ftstate.controller.backend.ClusterBackend`): worker
hosts as Ray actors in placement groups, on the cluster :mod:`~ftstate.controller.cluster`
joins or starts. The runtime's default.

Ray reports a worker's failure as an exception on whatever call was pending when it
happened; :meth:`RayBackend.call` translates Ray's classes into the seam's: ``ActorDiedError``
into :class:`~ftstate.controller.backend.ActorDied`, ``ActorUnavailableError`` into
:class:`~ftstate.controller.backend.ActorUnreachable`, a ``RayTaskError`` into
:class:`~ftstate.controller.backend.RemoteError` carrying the worker's own exception (Ray's
wrapper also derives from the cause's class, so it is caught before ``TimeoutError``: a
worker's ``SyncTimeout`` is not this call's own timeout).

Killing is immediate on the controller's node: a hung process must not linger holding its
group sockets (its peers would block on it), and ``ray.kill`` of a stopped process waits for
a graceful exit that never comes, so it gets SIGKILL; elsewhere ``ray.kill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from ftstate.controller import cluster
from ftstate.controller.backend import (
    ActorDied,
    ActorUnreachable,
    CallTimedOut,
    ClusterBackend,
    Pool,
    RemoteError,
)
from ftstate.core.config import RolePlacement


class RayBackend(ClusterBackend):
    """Ray actors for one runtime (see the module docstring)."""

    def __init__(self) -> None:
        self._node: str | None = None

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
        from ftstate.controller.placement import cluster_nodes

        return cluster_nodes()

    def versions(self) -> dict[str, str]:
        import ray
        import torch

        return {"ray": ray.__version__, "torch": torch.__version__}

    def resource_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                      placement: RolePlacement) -> Pool:
        from ftstate.controller.placement import ResourcePool

        return ResourcePool(run_id, name, slots, cpus=cpus, gpus=gpus, placement=placement)

    def spare_pool(self, run_id: str, name: str, slots: int, *, cpus: float, gpus: float,
                   placement: RolePlacement) -> Pool:
        from ftstate.controller.placement import SparePool

        return SparePool(run_id, name, slots, cpus=cpus, gpus=gpus, placement=placement)

    def start_actor(self, *, name: str, run_id: str, pool: Pool, slot: int, role: str, user_class: type,
                    args: Sequence[Any], kwargs: Mapping[str, Any], host: Mapping[str, Any]) -> Any:
        import ray

        from ftstate.controller.host import WorkerHost

        actor_cls = ray.remote(WorkerHost)
        return actor_cls.options(
            name=f"ftstate-{run_id}-{name}",
            namespace="ftstate",
            max_restarts=0,
            max_concurrency=64,
            **pool.options(slot),  # type: ignore[attr-defined]
        ).remote(name, role, user_class, tuple(args), dict(kwargs), host["backend"], host["bucket_bytes"],
                 run=run_id, secret=host["secret"], integrity=host["integrity"], held_proof=host["held_proof"],
                 staging_spare=host.get("staging_spare", False))

    async def call(self, handle: Any, method: str, args: Sequence[Any], timeout: float | None) -> Any:
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

    def kill(self, handle: Any, *, pid: int | None, node: str | None) -> None:
        import ray

        if pid and node is not None and node == self._node and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(handle, no_restart=True)

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
        # The GCS's view (ftstate/controller/maintenance/ray_drain.py says what Ray exposes); a
        # blocking RPC bounded by timeout, so off the loop.
        import ray

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised in this process")
        gcs = ray._private.worker.global_worker.gcs_client
        return await asyncio.to_thread(gcs.get_draining_nodes, timeout=timeout)

    def rendezvous_store(self, host: str) -> Any:
        from ftstate.transport import StoreServer

        return StoreServer(host=host)


def ray_cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # best effort: the actor may already be gone
        ray.cancel(ref)


__all__ = ["RayBackend", "ray_cancel"]
