"""The route plan of one weight transfer, made in the controller: bytes cross a socket once per node.
Receivers on the sender's node read shared memory (``shm``); a lone receiver elsewhere takes the collective;
on a node with several, the lowest rank is the relay (``collective``) and its peers read its shared memory
(``relay``), verifying against the sender's seal. ``auto`` falls back to the collective, ``require`` fails,
and an unknown node never shares a host. Pure data, recorded on ``sync_start``; docs/operations.md ("Across
nodes")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

#: The values of the ``shared_memory`` config key.
SharedMemoryMode = Literal["auto", "off", "require"]

SHM = "shm"
COLLECTIVE = "collective"
RELAY = "relay"


@dataclass(frozen=True)
class Endpoint:
    """A member as the plan sees it: its name, rank in the group version, and node."""

    name: str
    rank: int
    node_id: str | None


@dataclass(frozen=True)
class Plan:
    """How each receiver of one transfer gets the bytes (``routes``: name → ``shm``,
    ``collective`` or ``relay``); ``relays``: each relay's name → its node peers' names."""

    sender: Endpoint
    routes: Mapping[str, str]
    ranks: Mapping[str, int]
    remote_nodes: Mapping[str, tuple[str, ...]]
    mode: SharedMemoryMode
    relays: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def same_host_ranks(self) -> tuple[int, ...]:
        """Ranks that read the sender's shared memory, in rank order."""
        return tuple(sorted(self.ranks[n] for n, how in self.routes.items() if how == SHM))

    @property
    def relay_ranks(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(relay rank, its peers' ranks)`` for every relay, in rank order."""
        return tuple(sorted((self.ranks[r], tuple(sorted(self.ranks[p] for p in peers)))
                            for r, peers in self.relays.items()))

    @property
    def uses_shm(self) -> bool:
        """Whether any receiver reads shared memory (the sender's, or a relay's)."""
        return bool(self.same_host_ranks) or bool(self.relays)

    @property
    def require_shm(self) -> bool:
        return self.mode == "require"

    def with_fallback(self) -> Plan:
        """The plan after shared memory was found unavailable everywhere (``auto``): all collective."""
        return Plan(self.sender, {n: COLLECTIVE for n in self.routes}, self.ranks, self.remote_nodes, self.mode)

    def record(self) -> dict[str, object]:
        """What the audit trail keeps: the sender's node, every receiver's route, the relays."""
        node_of = {n: k for k, names in self.remote_nodes.items() for n in names}
        return {"sender": self.sender.name, "node": _short(self.sender.node_id), "mode": self.mode,
                "routes": dict(sorted(self.routes.items())),
                "remote_nodes": {_short(k): list(v) for k, v in sorted(self.remote_nodes.items())},
                "relays": {_short(node_of[r]): {"relay": r, "peers": list(p)}
                           for r, p in sorted(self.relays.items())}}


def _short(node_id: str | None) -> str | None:
    return node_id[:8] if node_id else node_id


def plan_transfer(sender: Endpoint, receivers: Iterable[Endpoint], mode: SharedMemoryMode) -> Plan:
    """The plan for ``sender`` → ``receivers`` under the ``shared_memory`` setting ``mode``."""
    routes: dict[str, str] = {}
    ranks: dict[str, int] = {}
    remote: dict[str, list[Endpoint]] = {}
    for r in receivers:
        ranks[r.name] = r.rank
        same = mode != "off" and sender.node_id is not None and r.node_id == sender.node_id
        routes[r.name] = SHM if same else COLLECTIVE
        if not same and r.node_id != sender.node_id:
            remote.setdefault(r.node_id or "?", []).append(r)
    relays: dict[str, tuple[str, ...]] = {}
    if mode != "off":
        for node, members in remote.items():
            if node == "?" or len(members) < 2:  # an unknown node is nobody's shared host
                continue
            relay, *peers = sorted(members, key=lambda e: e.rank)
            relays[relay.name] = tuple(p.name for p in peers)
            routes.update({p.name: RELAY for p in peers})
    return Plan(sender, routes, ranks, {k: tuple(e.name for e in v) for k, v in remote.items()}, mode, relays)


__all__ = ["COLLECTIVE", "RELAY", "SHM", "Endpoint", "Plan", "SharedMemoryMode", "plan_transfer"]
