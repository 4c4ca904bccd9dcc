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
with a bounded RPC, and reports each as a ``drain`` notice on that node id with the drain's
deadline. The reason is not exposed by that call and is not reported. A node that died
leaves the list: its notice is withdrawn, and its loss is the failover's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

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


def gcs_draining_nodes(timeout: float) -> Mapping[str, int]:
    """The connected driver's view of the draining nodes (Ray imported here, on first use)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised in this process")
    gcs = ray._private.worker.global_worker.gcs_client
    return gcs.get_draining_nodes(timeout=timeout)


class RayDrainWatcher:
    """Polls the GCS for draining nodes, one RPC bounded by ``timeout``.

    draining: how to ask (default :func:`gcs_draining_nodes`; injected in tests)."""

    source = "ray"

    def __init__(self, *, timeout: float, draining: DrainingNodes | None = None) -> None:
        self.timeout = timeout
        self.draining = draining or gcs_draining_nodes

    @property
    def bound_s(self) -> float:
        return self.timeout

    def poll(self) -> PollResult:
        t0 = time.monotonic()
        where = "gcs.get_draining_nodes"
        try:
            answer = self.draining(self.timeout)
        except Exception as exc:  # noqa: BLE001 - an RPC error, a lost GCS: a warning, never a crash
            took = round(time.monotonic() - t0, 3)
            kind = "timeout" if "timeout" in type(exc).__name__.lower() or "timed out" in str(exc).lower() else "error"
            return PollResult("ray", (), (PollProblem("ray", where, kind, f"{type(exc).__name__}: {exc}", took),), took)
        took = round(time.monotonic() - t0, 3)
        parsed = parse_draining(answer, where=where)
        if isinstance(parsed, PollProblem):
            return PollResult("ray", (), (parsed.took(took),), took)
        return PollResult("ray", tuple(parsed), (), took)
