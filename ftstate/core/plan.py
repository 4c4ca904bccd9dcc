"""The route plan of one weight transfer: which receiver gets the bytes how, from where members run.

A transfer's bytes should cross a socket only where they must. The plan groups the
receivers by the node (Ray's node id) they run on, against the sender's node:

* a receiver on the **sender's node** reads every bucket from shared memory
  (``shm``: :mod:`ftstate.transport.samehost`): written once by the sender, read by all of
  them, no socket;
* a receiver on **another node** gets it over the collective (``collective``: gloo or
  NCCL); today one copy per remote receiver. (Relaying one copy per remote node and fanning it
  out there through that node's shared memory is the next step; the plan already
  groups the remote receivers by node, in :attr:`Plan.remote_nodes`.)

When no receiver shares the sender's node, or ``shared_memory`` is ``off``, the plan is the
plain broadcast (:attr:`Plan.uses_shm` false) and nothing changes on the wire. A member whose
node is unknown (outside Ray) is never assumed to share a host.

The plan is data: the sync's audit record (``sync_start``) carries :meth:`Plan.record`,
and the runtime's ``SyncReport`` says which rollout got the weights how. This module is pure
(no Ray, no torch): unit-tested with nodes given as strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

#: The values of the ``shared_memory`` config key.
SharedMemoryMode = Literal["auto", "off", "require"]

SHM = "shm"
COLLECTIVE = "collective"


@dataclass(frozen=True)
class Endpoint:
    """A member as the plan sees it: its name, rank in the group version, and node."""

    name: str
    rank: int
    node_id: str | None


@dataclass(frozen=True)
class Plan:
    """How each receiver of one transfer gets the bytes (``routes``: name → ``shm`` or ``collective``)."""

    sender: Endpoint
    routes: Mapping[str, str]
    ranks: Mapping[str, int]
    remote_nodes: Mapping[str, tuple[str, ...]]
    mode: SharedMemoryMode

    @property
    def same_host_ranks(self) -> tuple[int, ...]:
        """Ranks that read shared memory, in rank order."""
        return tuple(sorted(self.ranks[n] for n, how in self.routes.items() if how == SHM))

    @property
    def uses_shm(self) -> bool:
        return bool(self.same_host_ranks)

    @property
    def require_shm(self) -> bool:
        return self.mode == "require"

    def with_fallback(self) -> Plan:
        """The plan after the sender found shared memory unavailable (``auto``): all collective."""
        return Plan(self.sender, {n: COLLECTIVE for n in self.routes}, self.ranks, self.remote_nodes, self.mode)

    def record(self) -> dict[str, object]:
        """What the audit trail keeps: the sender's node and every receiver's route."""
        return {"sender": self.sender.name, "node": _short(self.sender.node_id), "mode": self.mode,
                "routes": dict(sorted(self.routes.items())),
                "remote_nodes": {_short(k): list(v) for k, v in sorted(self.remote_nodes.items())}}


def _short(node_id: str | None) -> str | None:
    return node_id[:8] if node_id else node_id


def plan_transfer(sender: Endpoint, receivers: Iterable[Endpoint], mode: SharedMemoryMode) -> Plan:
    """The plan for ``sender`` → ``receivers`` under the ``shared_memory`` setting ``mode``."""
    routes: dict[str, str] = {}
    ranks: dict[str, int] = {}
    remote: dict[str, list[str]] = {}
    for r in receivers:
        ranks[r.name] = r.rank
        same = mode != "off" and sender.node_id is not None and r.node_id == sender.node_id
        routes[r.name] = SHM if same else COLLECTIVE
        if not same and r.node_id != sender.node_id:
            remote.setdefault(r.node_id or "?", []).append(r.name)
    return Plan(sender, routes, ranks, {k: tuple(v) for k, v in remote.items()}, mode)


__all__ = ["COLLECTIVE", "SHM", "Endpoint", "Plan", "SharedMemoryMode", "plan_transfer"]
