"""The per-node maintenance watcher: a light actor the backend pins to each node that hosts members (a
metadata server answers only its own VM). It detects and polls that node's sources, one per call, for the
driver's runner; it imports no Ray itself."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ftstate.controller.maintenance.base import PollProblem, PollResult
from ftstate.controller.maintenance.detect import DMI_DIR, detect_sources
from ftstate.controller.maintenance.registry import build_watchers
from ftstate.core.config import FaultToleranceConfig

#: The sources a node watcher runs (``ray`` is the driver's: it asks the GCS, not the node).
NODE_SOURCES = ("gce", "aws", "azure", "file")
#: Seconds an actor call may add to a source's own poll bound.
ACTOR_CALL_S = 1.0


class NodeWatcherActor:
    """Polls the maintenance sources of the node it runs on (as a Ray actor)."""

    def __init__(
        self,
        sources: Sequence[str] = ("auto",),
        *,
        timeout: float = 2.0,
        endpoints: Mapping[str, str] | None = None,
        maintenance_file: str | None = None,
        include: Sequence[str] = NODE_SOURCES,
        dmi_dir: str | os.PathLike[str] = DMI_DIR,
        node_id: str,
    ) -> None:
        self.node_id = node_id
        self.detection = detect_sources(sources, endpoints=endpoints, maintenance_file=maintenance_file,
                                        dmi_dir=dmi_dir)
        here = [s for s in self.detection.sources if s in include]
        built = build_watchers(here, timeout=timeout, endpoints=endpoints, maintenance_file=maintenance_file)
        self._watchers = {w.source: w for w in built}

    @staticmethod
    def options_from(ft: FaultToleranceConfig) -> dict[str, Any]:
        """The constructor's keyword arguments from a ``fault_tolerance`` block."""
        return {"sources": list(ft.maintenance_sources), "timeout": ft.maintenance_request_timeout_s,
                "endpoints": dict(ft.maintenance_endpoints), "maintenance_file": ft.maintenance_file}

    def describe(self) -> dict[str, Any]:
        """This node's id, its detection, and each source's poll bound in seconds."""
        return {"node_id": self.node_id, "detection": self.detection,
                "bounds": {s: w.bound_s for s, w in self._watchers.items()}}

    def poll(self, source: str) -> PollResult:
        """One poll of ``source`` on this node (never raises for a bad server)."""
        watcher = self._watchers.get(source)
        if watcher is None:
            return PollResult(source, (), (PollProblem(source, f"node {self.node_id}", "error",
                                                       f"no {source} watcher on this node"),))
        return watcher.poll().on_node(self.node_id)

    def acknowledge(self, event_id: str) -> PollProblem | None:
        """Acknowledge an Azure scheduled event from this node (its IMDS only takes it from
        the VM itself): None when taken, else the problem."""
        watcher = self._watchers.get("azure")
        if watcher is None:
            return PollProblem("azure", f"node {self.node_id}", "error", "no azure watcher on this node")
        return watcher.acknowledge(event_id)  # type: ignore[attr-defined]


class ActorWatcher:
    """One source of a :class:`NodeWatcherActor`, as a watcher the runner can poll (through
    the controller's backend)."""

    def __init__(self, backend: Any, handle: Any, node_id: str, source: str, bound_s: float) -> None:
        self.backend = backend
        self.handle = handle
        self.node_id = node_id
        self.source = source
        self.label = f"{source}@{node_id[:12]}"
        self._bound_s = bound_s + ACTOR_CALL_S

    @property
    def bound_s(self) -> float:
        return self._bound_s

    async def apoll(self) -> PollResult:
        return await self.backend.call_helper(self.handle, "poll", (self.source,), self._bound_s)

    def poll(self) -> PollResult:  # pragma: no cover - the runner awaits apoll()
        raise TypeError(f"{self.label}: a node watcher is polled by apoll(), on the controller's loop")


async def actor_watchers(backend: Any, handle: Any, timeout: float | None = None) -> tuple[Any, list[ActorWatcher]]:
    """The node's detection and one :class:`ActorWatcher` per source it runs (``backend``: the
    :class:`~ftstate.controller.backend.ClusterBackend` that started ``handle``)."""
    info = await backend.call_helper(handle, "describe", (), timeout)
    return info["detection"], [ActorWatcher(backend, handle, info["node_id"], s, b) for s, b in info["bounds"].items()]
