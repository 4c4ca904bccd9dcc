"""A multi-node Ray cluster on one machine, and faithful whole-node loss.

``ray.cluster_utils.Cluster`` starts one raylet per node, every node on 127.0.0.1 (with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` set before Ray is imported), each with its own Ray
node id, its own label ``ftstate-test-node: <name>`` and its own custom resource
``node_<name>`` (so a test or a placement can aim at one node).

A node loss is made faithful by :func:`kill_node`: ``Cluster.remove_node`` alone kills the
raylet, but the worker processes it started outlive it and keep answering calls (DESIGN.md,
measured). So the raylet and every process it started (found as its descendants in
``/proc`` before anything is killed) are SIGKILLed in one loop, then the node is removed
from the cluster object. The raylet's descendants are the node's actor and idle workers and
its agents; :func:`node_pids` cross-checks them against what the GCS says runs on the node.

Used by ``tests/multinode`` (its own pytest session: a driver joins one Ray cluster only)
and by ``benchmarks/node_loss.py``. Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The node label every test node carries, with the node's name as value.
LABEL = "ftstate-test-node"
NAMES = ("a", "b", "c")


def resource(name: str) -> str:
    """The custom resource only node ``name`` has (``node_b``)."""
    return f"node_{name}"


def _prepare_environment() -> None:
    # Before Ray is imported: every node then binds 127.0.0.1 only (DESIGN.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Worker processes import the test worker classes from tests/.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *paths]))


@dataclasses.dataclass
class MultiNode:
    """A running multi-node cluster. cluster: the ``ray.cluster_utils.Cluster``; nodes: its
    ``ray._private.node.Node`` objects by name (``a`` is the head, where the driver is);
    started_s: how long it took to come up (nodes and driver)."""

    cluster: Any
    nodes: dict[str, Any]
    started_s: float

    def node(self, name: str) -> Any:
        return self.nodes[name]

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def name_of(self, node: Any) -> str | None:
        """The name of a Node object, or of a node id (hex), or None."""
        for name, n in self.nodes.items():
            if n is node or n.node_id == node:
                return name
        return None

    def alive(self) -> list[str]:
        """Names of the nodes still in the cluster (not lost)."""
        return [name for name, n in self.nodes.items() if n is self.cluster.head_node or n in self.cluster.worker_nodes]

    def add(self, name: str, *, num_cpus: float = 2, object_store_mb: int = 150, **node_args: Any) -> Any:
        """Add (or bring back) node ``name`` with its label and custom resource; returns the Node."""
        resources = dict(node_args.pop("resources", {}))
        resources.setdefault(resource(name), 4)
        labels = {LABEL: name, **node_args.pop("labels", {})}
        node = self.cluster.add_node(num_cpus=num_cpus, resources=resources, labels=labels,
                                     object_store_memory=object_store_mb * 2**20, **node_args)
        self.nodes[name] = node
        return node

    def kill(self, name: str) -> KilledNode:
        """:func:`kill_node` on node ``name``."""
        return kill_node(self.cluster, self.nodes[name])


def start_cluster(names: tuple[str, ...] = NAMES, *, num_cpus: float = 2, object_store_mb: int = 150,
                  connect: bool = True, system_config: dict[str, Any] | None = None) -> MultiNode:
    """Start a cluster with one node per name (the first is the head) and connect this
    process to it. system_config: Ray's ``_system_config`` for the head (the whole cluster)."""
    _prepare_environment()
    import ray
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    head_args: dict[str, Any] = {"include_dashboard": False}
    if system_config:
        head_args["_system_config"] = system_config
    mn = MultiNode(Cluster(initialize_head=False), {}, 0.0)
    try:
        for i, name in enumerate(names):
            mn.add(name, num_cpus=num_cpus, object_store_mb=object_store_mb, **(head_args if i == 0 else {}))
        mn.cluster.wait_for_nodes()
        if connect:
            ray.init(address=mn.cluster.address, logging_level="ERROR", log_to_driver=False)
    except BaseException:
        stop_cluster(mn)
        raise
    mn.started_s = time.monotonic() - t0
    return mn


def stop_cluster(mn: MultiNode) -> None:
    """Disconnect and shut every remaining node down (the processes of lost nodes are gone)."""
    import ray

    try:
        ray.shutdown()
    finally:
        try:
            mn.cluster.shutdown()
        finally:
            # Cluster.shutdown resets the "current cluster" file that a bare ray.init() on this
            # machine would follow; make sure of it even when a removal failed half way.
            import ray._common.utils

            ray._common.utils.reset_ray_address()


# -- processes of a node ----------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
    return int(rest[1]), rest[0]


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a SIGKILLed one nobody reaped yet is dead)."""
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                out.setdefault(st[0], []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree."""
    children = _children()
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if pid_alive(p):
            out.append(p)
        todo.extend(children.get(p, []))
    return out


def raylet_pid(node: Any) -> int | None:
    """The pid of a node's raylet (None once it was removed)."""
    from ray._private import ray_constants

    infos = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET) or []
    return infos[0].process.pid if infos else None


def node_pids(node: Any) -> list[int]:
    """The node's raylet and every live process it started (workers, agents)."""
    pid = raylet_pid(node)
    if pid is None or not pid_alive(pid):
        return []
    return [pid, *descendants(pid)]


def actor_pids_by_node() -> dict[str, set[int]]:
    """What the GCS says: the pids of the cluster's live actors, by node id (hex). Needs no
    dashboard (the global state accessor reads the GCS)."""
    import ray

    out: dict[str, set[int]] = {}
    for info in ray._private.state.actors().values():
        if info.get("State") == "ALIVE" and info.get("Pid"):
            out.setdefault(info["Address"]["NodeID"], set()).add(int(info["Pid"]))
    return out


def node_of(mn_or_cluster: MultiNode | Any, *, pid: int | None = None, node_id: str | None = None) -> Any:
    """The Node object a process (by pid: the raylet whose process tree holds it) or a Ray
    node id belongs to; None if none of the cluster's current nodes."""
    cluster = mn_or_cluster.cluster if isinstance(mn_or_cluster, MultiNode) else mn_or_cluster
    nodes = cluster.list_all_nodes()
    if node_id is not None:
        return next((n for n in nodes if n.node_id == node_id), None)
    if pid is None:
        raise ValueError("node_of needs pid= or node_id=")
    raylets = {raylet_pid(n): n for n in nodes}
    seen: set[int] = set()
    p: int | None = pid
    while p and p not in seen:  # walk up the tree to a raylet (a worker's parent)
        if p in raylets:
            return raylets[p]
        seen.add(p)
        st = _stat(p)
        p = st[0] if st else None
    return None


# -- the loss -----------------------------------------------------------------------------------


@dataclasses.dataclass
class KilledNode:
    """What :func:`kill_node` did. node_id: the lost node's Ray node id; pids: every process
    SIGKILLed (the raylet first); killed_at: ``time.monotonic()`` of the first kill;
    kill_s: the whole kill loop; removed_s: the kill and the ``remove_node`` after it."""

    node_id: str
    pids: list[int]
    killed_at: float
    kill_s: float
    removed_s: float


def kill_node(cluster: Any, node: Any) -> KilledNode:
    """A whole-node loss: SIGKILL the node's raylet and every process it started in one loop,
    then ``cluster.remove_node(node, allow_graceful=False)``. Refuses the driver's own node
    (removing it would break the driver). The tree is read before the first kill, so the
    workers are found even though the raylet's death orphans them."""
    import ray

    global_node = ray._private.worker.global_worker.node
    if global_node is not None and node._raylet_socket_name == global_node._raylet_socket_name:
        raise ValueError("kill_node: this is the driver's node; lose another one")
    node_id = node.node_id
    pids = node_pids(node)
    t0 = time.monotonic()
    for pid in pids:  # the raylet first: nothing of the node reports the others' deaths
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    t1 = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 2.0  # a SIGKILLed process is gone within moments
    while (left := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    if left:
        raise RuntimeError(f"kill_node: processes of node {node_id[:8]} still alive: {left}")
    return KilledNode(node_id, pids, t0, t1 - t0, time.monotonic() - t0)
