"""The Ray maintenance source on a real multi-node cluster: a node drained through the GCS's
DrainNode RPC (what ``ray drain-node``, the autoscaler and KubeRay's SIGTERM do) is a ``drain``
notice on that node id with the drain's deadline, and the node leaving withdraws it."""

from __future__ import annotations

import asyncio
import time

from ftstate.controller.maintenance import MaintenanceWatcher
from ftstate.controller.maintenance.ray_drain import AsyncRayDrainWatcher
from ftstate.controller.ray.backend import RayBackend
from tests.multinode.harness import resource


class Busy:
    def ping(self) -> str:
        return "pong"


def test_a_drained_node_is_a_drain_notice_until_it_is_gone(multinode_cluster, restore_nodes):
    import ray
    from ray.core.generated import autoscaler_pb2

    node_c = multinode_cluster.node_id("c")
    # A node drained while idle exits at once; an actor keeps it up until the test lets it go.
    busy = ray.remote(Busy).options(num_cpus=0.01, resources={resource("c"): 1}).remote()
    assert ray.get(busy.ping.remote(), timeout=30) == "pong"

    notices, withdrawn, problems = [], [], []
    runner = MaintenanceWatcher([AsyncRayDrainWatcher(timeout=2.0, draining=RayBackend().draining_nodes)], interval=0.05, on_notice=notices.append,
                                on_withdrawn=withdrawn.append, on_problem=problems.append)
    gcs = ray._private.worker.global_worker.gcs_client
    deadline_ms = int(time.time() * 1000) + 120_000

    async def scenario() -> None:
        await runner.poll_once()
        assert notices == [] and problems == []
        accepted, why = gcs.drain_node(node_c, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       "ftstate test: host maintenance", deadline_ms)
        assert accepted, why
        await runner.poll_once()
        ray.kill(busy)  # idle now: the drained node's raylet exits by itself
        t1 = time.monotonic()
        while not withdrawn and time.monotonic() - t1 < 30:
            await runner.poll_once()
            await asyncio.sleep(0.05)

    try:
        asyncio.run(scenario())
    finally:
        runner.close()
        if "c" in multinode_cluster.alive():
            multinode_cluster.kill("c")  # its raylet is gone or going: let restore_nodes bring c back
    assert [(n.source, n.kind, n.node, n.deadline) for n in notices] == [("ray", "drain", node_c, deadline_ms / 1000)]
    # no poll ran past its bound (it would be a "timeout" problem); the withdrawal is waited for
    # above. Measured: seen at the first poll after the RPC (~1 ms); withdrawn ~0.1 s after the
    # node went idle
    assert [n.node for n in withdrawn] == [node_c] and problems == []
