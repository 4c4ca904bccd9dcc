"""A local multi-node Ray cluster (all on 127.0.0.1) for the demo's ``--maintenance`` scenario and
benchmarks/drain.py, started from the driver. Each node may get environment variables of its own, set only
around its ``add_node`` so its raylet and workers inherit them (how each gets its own metadata server). Ray's
current-cluster file is restored at shutdown, so ``address: auto`` still finds a cluster started with ``ray
start``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: The node label every node of the local cluster carries, with its name as value.
LABEL = "ftstate-demo-node"
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def node_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """Set ``variables`` in this process's environment for the block, then restore each one
    (unset again where it was unset)."""
    before = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclasses.dataclass
class LocalCluster:
    """A running local cluster: the ``Cluster``, its nodes and their env by name, how long it took to start,
    and whether this process is its driver."""

    cluster: Any
    nodes: dict[str, Any]
    env: dict[str, dict[str, str]]
    num_cpus: float
    object_store_mb: int
    started_s: float = 0.0
    connected: bool = False
    _previous_address: str | None = None

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def node_id(self, name: str) -> str:
        return str(self.nodes[name].node_id)

    def name_of(self, node_id: str | None) -> str | None:
        """The name of the node with this Ray node id (hex), None if none of ours."""
        return next((name for name, n in self.nodes.items() if n.node_id == node_id), None)

    def names(self) -> dict[str, str]:
        """Node id -> name, for every node started (a re-added node under its new id too)."""
        return {n.node_id: name for name, n in self.nodes.items()}

    def add(self, name: str, *, head_args: Mapping[str, Any] | None = None) -> Any:
        """Add (or bring back, under a fresh node id) node ``name``, with its label and its own
        environment variables; returns the Node."""
        with node_environment(self.env.get(name, {})):
            node = self.cluster.add_node(num_cpus=self.num_cpus, labels={LABEL: name},
                                         object_store_memory=self.object_store_mb * 2**20, **dict(head_args or {}))
        self.nodes[name] = node
        return node

    def shutdown(self) -> None:
        """Disconnect (if this process is the driver), stop every node, and put Ray's
        current-cluster file back as it was."""
        import ray

        try:
            if self.connected and ray.is_initialized():
                ray.shutdown()
        finally:
            try:
                self.cluster.shutdown()
            finally:
                _restore_address(self._previous_address, self.address)


def _address_file() -> str | None:
    """Ray's current-cluster file (``ray_current_cluster`` in its temp folder), if this Ray says."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # another Ray: the file is left as Ray leaves it
        return None
    return str(get_ray_address_file(None))


def _read_address() -> str | None:
    path = _address_file()
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _restore_address(previous: str | None, ours: str) -> None:
    """After our cluster is gone: the current-cluster file says what it said before, or nothing."""
    path = _address_file()
    now = _read_address()
    if path is None or now not in (None, ours):
        return  # someone else's cluster started meanwhile: theirs now
    with contextlib.suppress(OSError):
        if previous:
            with open(path, "w", encoding="utf-8") as f:
                f.write(previous)
        elif now is not None:
            os.remove(path)


def start_local_cluster(names: Sequence[str] = ("a", "b", "c"), *, env: Mapping[str, Mapping[str, str]] | None = None,
                        num_cpus: float = 2, object_store_mb: int = 200, connect: bool = True,
                        log_to_driver: bool = False) -> LocalCluster:
    """Start one node per name (the first the head, no dashboard) and, with ``connect``, make this process its
    driver; ``env``: variables per node name."""
    if "ray" not in sys.modules:
        os.environ.setdefault(_LOOPBACK_ENV, "0")
    if os.environ.get(_LOOPBACK_ENV) != "0":
        from ftstate.core.errors import UsageError

        raise UsageError(f"a local Ray cluster must bind loopback: set {_LOOPBACK_ENV}=0 before Ray is imported")
    import ray
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    lc = LocalCluster(Cluster(initialize_head=False), {}, {k: dict(v) for k, v in (env or {}).items()},
                      num_cpus, object_store_mb, _previous_address=_read_address())
    try:
        for i, name in enumerate(names):
            lc.add(name, head_args={"include_dashboard": False} if i == 0 else None)
        lc.cluster.wait_for_nodes()
        if connect:
            ray.init(address=lc.address, logging_level="ERROR", log_to_driver=log_to_driver)
            lc.connected = True
    except BaseException:
        lc.shutdown()
        raise
    lc.started_s = time.monotonic() - t0
    return lc


__all__ = ["LABEL", "LocalCluster", "node_environment", "start_local_cluster"]
