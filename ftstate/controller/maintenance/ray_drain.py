"""Ray: the nodes the cluster is draining.

What Ray 2.60 exposes (read in its source and measured on a ``ray.cluster_utils.Cluster``):

- The GCS keeps, per node, whether it is draining and the drain's deadline. The ``DrainNode``
  RPC sets it, with a reason (``DRAIN_NODE_REASON_PREEMPTION`` or ``..._IDLE_TERMINATION``),
  a message and a deadline in epoch milliseconds (0: none). Callers: ``ray drain-node``
  (hidden CLI: ``--reason``, ``--reason-message``, ``--deadline-remaining-seconds``), the v2
  autoscaler, and a raylet receiving SIGTERM (KubeRay deleting a pod: it drains itself for
  ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``).
- ``GcsClient.get_draining_nodes(timeout=...)`` answers ``{node_id_hex: deadline_ms}``: the
  call Ray Serve makes (``serve/_private/cluster_node_info_cache.py``); Ray Train v2's
  ``PreemptionWatcher`` reads the same through ``ray._private.state.state.get_draining_nodes()``
  (no timeout). A driver has the client as ``ray._private.worker.global_worker.gcs_client``.
  Measured: ~1 ms a call; a drain shows at the next call, and a drained node that goes idle
  exits and leaves the list ~0.1 s later (tests/multinode/test_maintenance_drain.py).
- ``GcsNodeInfo.state_snapshot.state`` (``gcs_client.get_all_node_info()``) reads DRAINING
  for such a node; ``ray.nodes()`` and the state API's ``list_nodes()`` only say ALIVE/DEAD,
  and neither carries the reason. An idle node drained for preemption exits at once (its
  ``DeathReasonMessage`` is the drain's message); a busy one keeps running its actors until
  the deadline, when whoever asked for the drain (autoscaler, KubeRay) kills it.

So this watcher runs on the driver (the controller), asks the GCS for its draining nodes
with a bounded RPC (through the controller's
:meth:`~ftstate.controller.backend.ClusterBackend.draining_nodes`: a simulated cluster answers
it too), and reports each as a ``drain`` notice on that node id with the drain's
deadline. The reason is not exposed by that call and is not reported. A node that died
leaves the list: its notice is withdrawn, and its loss is the failover's business.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from ftstate.controller.maintenance.base import Notice, PollProblem, PollResult

DrainingNodes = Callable[[float], Mapping[str, int]]


def parse_draining(draining: object, *, where: str = "gcs.get_draining_nodes") -> list[Notice] | PollProblem:
    """``{node_id_hex: deadline_ms}`` (0 = no deadline) as ``drain`` notices, one per node."""
    if not isinstance(draining, Mapping):
        return PollProblem("ray", where, "malformed", f"expected a mapping of node ids to deadlines, got {draining!r}")
    notices = []
    for node, deadline_ms in sorted(draining.items()):
        if not isinstance(node, str) or not node or isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int):
            return PollProblem("ray", where, "malformed", f"bad entry {node!r}: {deadline_ms!r}")
        deadline = deadline_ms / 1000.0 if deadline_ms > 0 else None
        notices.append(Notice("ray", "drain", deadline=deadline, node=node, raw=f"ray drain deadline_ms={deadline_ms}"))
    return notices


def _no_cluster(timeout: float) -> Mapping[str, int]:
    raise RuntimeError("no cluster to ask for its draining nodes (RayDrainWatcher built without draining=)")


class RayDrainWatcher:
    """Polls the GCS for draining nodes, one RPC bounded by ``timeout``.

    draining: how to ask (the runtime's ``backend.draining_nodes``; None: no cluster to ask,
    every poll a problem that says so)."""

    source = "ray"

    def __init__(self, *, timeout: float, draining: DrainingNodes | None = None) -> None:
        self.timeout = timeout
        self.draining = draining if draining is not None else _no_cluster

    @property
    def bound_s(self) -> float:
        return self.timeout

    def poll(self) -> PollResult:
        t0 = time.monotonic()
        try:
            answer = self.draining(self.timeout)
        except Exception as exc:  # noqa: BLE001 - an RPC error, a lost GCS: a warning, never a crash
            return self._result(None, exc, round(time.monotonic() - t0, 3))
        return self._result(answer, None, round(time.monotonic() - t0, 3))

    @staticmethod
    def _result(answer: object, exc: BaseException | None, took: float) -> PollResult:
        where = "gcs.get_draining_nodes"
        if exc is not None:
            kind = "timeout" if "timeout" in type(exc).__name__.lower() or "timed out" in str(exc).lower() else "error"
            return PollResult("ray", (), (PollProblem("ray", where, kind, f"{type(exc).__name__}: {exc}", took),), took)
        parsed = parse_draining(answer, where=where)
        if isinstance(parsed, PollProblem):
            return PollResult("ray", (), (parsed.took(took),), took)
        return PollResult("ray", tuple(parsed), (), took)


class AsyncRayDrainWatcher(RayDrainWatcher):
    """The same, asking with a coroutine (the controller's backend): awaited on the controller's
    loop, timed by the loop's clock (virtual in a simulation), no thread."""

    def __init__(self, *, timeout: float, draining: Callable[[float], Awaitable[Mapping[str, int]]]) -> None:
        super().__init__(timeout=timeout)
        self.adraining = draining

    async def apoll(self) -> PollResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            answer = await self.adraining(self.timeout)
        except Exception as exc:  # noqa: BLE001 - as poll()
            return self._result(None, exc, round(loop.time() - t0, 3))
        return self._result(answer, None, round(loop.time() - t0, 3))
