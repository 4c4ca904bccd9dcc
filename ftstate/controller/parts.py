"""What the controller's parts share: one value the runtime builds once, at start, and hands to
each part (drain, scaling, failover, spares, resync, routing, sync, losses, notices), so the list
of what they share is written here and nowhere else. A part keeps only its own extras beside it."""

from __future__ import annotations

import dataclasses
from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.formation import GroupFormation
from ftstate.controller.launcher import ActorLauncher
from ftstate.controller.membership import Membership
from ftstate.controller.nodecopies import NodeCopies
from ftstate.controller.watchdog import Watchdog
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig

__all__ = ["ControllerParts", "Part"]


@dataclasses.dataclass(frozen=True)
class ControllerParts:
    """config, audit: the run's. membership: the one shared membership. calls: the actor calls.
    launcher starts and kills actors; formation forms group versions; watchdog settles suspects.
    node_copies: with ``staging: node``, each node's committed copy (None: private staging)."""

    config: RuntimeConfig
    audit: AuditTrail
    membership: Membership
    calls: ActorCalls
    launcher: ActorLauncher
    formation: GroupFormation
    watchdog: Watchdog
    node_copies: NodeCopies | None = None


class Part:
    """A part of the controller: the shared value's fields read as its own attributes."""

    def __init__(self, parts: ControllerParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.audit = parts.audit
        self.membership = parts.membership
        self.calls = parts.calls
        self.launcher = parts.launcher
        self.formation = parts.formation
        self.watchdog = parts.watchdog
        self.node_copies = parts.node_copies

    @property
    def ft(self) -> Any:
        return self.config.fault_tolerance
