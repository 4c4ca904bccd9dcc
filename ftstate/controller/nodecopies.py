"""The run's node copies (``staging: node``), managed from the controller: one agent actor per node owns them
by its pid, the controller says which copy stays, and the agent serves the committed copy to newcomers
elsewhere (docs/concepts.md, "Node copies")."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

from ftstate.controller.backend import ClusterBackend
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import FTError


class NodeAgent:
    """Actor that owns, by its pid, the node copies made on its node; :meth:`serve` listens on ``address``."""

    def __init__(self, node_id: str, address: str) -> None:
        self.node_id = node_id
        self.address = address

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": self.node_id}

    def settle(self, keep: list[str]) -> list[str]:
        """Unlink every node copy this agent owns except those named in ``keep``; returns what went."""
        from ftstate.transport.nodecopy import copies_of, unlink_names

        gone = [n for n in copies_of(os.getpid()) if n not in keep]
        unlink_names(gone)
        return gone

    def close(self) -> list[str]:
        """The run ends: unlink everything this agent owns."""
        return self.settle([])

    def serve(self, name: str, timeout_s: float) -> dict[str, Any]:
        """Serve node copy ``name`` once, point to point, to a newcomer on another node."""
        from ftstate.transport.nodecopy import serve

        return serve(name, host=self.address, timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class CommittedCopy:
    """The node copy of the committed version on one node: what a newcomer there adopts."""

    node_id: str
    name: str
    owner: int
    group: str
    weights_version: int
    checksum: str
    #: the writer's spare beside it (``node_copy_spare``), kept too
    spare: str | None = None


class NodeCopies:
    """The agents of one run (by node) and the committed node copy of each node."""

    def __init__(self, *, run_id: str, config: RuntimeConfig, audit: AuditTrail, calls: Any,
                 backend: ClusterBackend) -> None:
        self.run_id = run_id
        self.backend = backend
        self.config = config
        self.audit = audit
        self.calls = calls
        self._agents: dict[str, tuple[str, Any, int]] = {}  # node id -> (actor name, handle, pid)
        self.committed: dict[str, CommittedCopy] = {}

    @property
    def enabled(self) -> bool:
        return self.config.staging == "node" and self.config.shared_memory != "off"

    async def owner(self, node_id: str | None) -> int | None:
        """The pid of ``node_id``'s agent (started now if needed), or None: no node copy there this time
        (private staging, unknown node, or no agent within ``init_timeout_s``: ``node_copy_fallback``)."""
        if not self.enabled or node_id is None:
            return None
        known = self._agents.get(node_id)
        if known is not None:
            return known[2]
        name = f"ftstate-{self.run_id}-node-{node_id[:12]}"
        try:
            handle = self.backend.start_node_agent(name, node_id)
            info = await self.calls.call_helper(name, handle, "info", timeout=self.config.init_timeout_s)
        except Exception as exc:  # noqa: BLE001 - Ray's scheduling errors too: recorded, never fatal
            self.audit.record("node_copy_fallback", node=node_id[:8],
                              reason=f"the node agent could not be started: {type(exc).__name__}: {exc}"[:500])
            return None
        self._agents[node_id] = (name, handle, int(info["pid"]))
        self.audit.record("node_agent_started", node=node_id[:8], pid=int(info["pid"]))
        return int(info["pid"])

    def source_for(self, node_id: str | None, weights_version: int, checksum: str | None) -> CommittedCopy | None:
        """The committed node copy a newcomer on ``node_id`` may adopt for that version, if any."""
        copy = self.committed.get(node_id or "")
        if copy is None or copy.weights_version != weights_version or copy.checksum != checksum:
            return None
        return copy

    def remote_source(self, node_id: str | None, weights_version: int, checksum: str | None) -> CommittedCopy | None:
        """Another node's copy of that version, to serve a newcomer on ``node_id`` point to point."""
        for other, copy in sorted(self.committed.items()):
            if other != node_id and self.source_for(other, weights_version, checksum) is not None:
                return copy
        return None

    async def serve(self, copy: CommittedCopy) -> dict[str, Any]:
        """Have ``copy``'s agent serve it once (within ``sync_timeout_s``); its address and one-time token.
        The call is bounded by ``heartbeat_timeout_s``; raises FTError."""
        name, handle, _ = self._agents[copy.node_id]
        return await self.calls.call_helper(name, handle, "serve", copy.name, self.config.sync_timeout_s,
                                     timeout=self.config.heartbeat_timeout_s)

    async def committed_on(self, node_id: str, name: str, *, group: str, weights_version: int,
                           checksum: str, spare: str | None = None) -> None:
        """A sync committed through copy ``name`` on ``node_id``: that node's source for newcomers; every
        other copy there goes but the writer's ``spare``."""
        agent = self._agents.get(node_id)
        if agent is None:
            return
        self.committed[node_id] = CommittedCopy(node_id, name, agent[2], group, weights_version, checksum, spare)
        await self._settle(node_id, [name, *([spare] if spare else [])])

    async def failed_on(self, node_id: str | None) -> None:
        """A sync attempt failed: only the committed copy stays on ``node_id``."""
        if node_id is None or node_id not in self._agents:
            return
        copy = self.committed.get(node_id)
        await self._settle(node_id, [copy.name, *([copy.spare] if copy.spare else [])] if copy is not None else [])

    async def forget(self, node_id: str | None) -> None:
        """A sync committed without a node copy on ``node_id``: the older one there goes."""
        if node_id is not None and self.committed.pop(node_id, None) is not None:
            await self._settle(node_id, [])

    async def _settle(self, node_id: str, keep: list[str]) -> None:
        name, handle, _ = self._agents[node_id]
        try:
            await self.calls.call_helper(name, handle, "settle", keep, timeout=self.config.heartbeat_timeout_s)
        except FTError as exc:  # what it owns goes with it: orphans, swept (see the module docstring)
            self.audit.record("node_copy_fallback", node=node_id[:8], reason=f"the node agent did not settle: {exc}")
            self._agents.pop(node_id, None)
            self.committed.pop(node_id, None)

    async def close(self) -> None:
        """The run ends: every agent unlinks what it owns (within ``heartbeat_timeout_s``) and is killed; an
        unreachable one's copies are swept as orphans."""
        agents, self._agents = self._agents, {}
        self.committed.clear()
        for node_id, (name, handle, _) in agents.items():
            with contextlib.suppress(FTError):
                await self.calls.call_helper(name, handle, "close", timeout=self.config.heartbeat_timeout_s)
            with contextlib.suppress(Exception):  # already gone with its node
                self.backend.kill(handle, pid=None, node=None)
            self.audit.record("node_agent_stopped", node=node_id[:8])


__all__ = ["CommittedCopy", "NodeAgent", "NodeCopies"]
