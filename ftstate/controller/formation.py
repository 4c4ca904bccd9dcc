"""Group formation: turning the membership into a numbered group version of the transport.

The controller hosts the rendezvous store (:class:`~ftstate.transport.StoreServer`), which
outlives every member. Forming version N has every member join ``weights/vN`` at its rank;
forming N+1 first fences N in the store, so anything still addressed to N (a straggler's
message, a superseded rendezvous) is rejected and its waiters are released at once.

The first version of a run is formed by the runtime inside the group's RENDEZVOUS deadline
(``init_timeout_s``); later versions (after a loss, a promotion, a shrink, an abandoned
transfer) by :meth:`GroupFormation.reform`, inside whatever state's deadline its caller holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.membership import GROUP, Member, Membership
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig


class GroupFormation:
    """Forms group versions. host: the address the store binds (this node's)."""

    def __init__(
        self, *, config: RuntimeConfig, audit: AuditTrail, membership: Membership, calls: ActorCalls, host: str
    ) -> None:
        from ftstate.transport import StoreServer

        self.config = config
        self.audit = audit
        self.membership = membership
        self.calls = calls
        self.store: Any = StoreServer(host=host)

    async def join(self, m: Member, version: int, world_size: int) -> None:
        """Have ``m`` join ``version`` at its rank (its transport bounds its own wait by
        ``init_timeout_s``; the caller's state deadline bounds the whole formation)."""
        address = self.store.address
        await self.calls.call(m.name, m.handle, "join", address.host, address.port, GROUP, version, m.rank,
                              world_size, self.config.init_timeout_s)

    def arrived(self, version: int, members: list[Member]) -> list[str]:
        """Who registered in the store for ``version``: the transport's own record."""
        by_rank = {m.rank: m.name for m in members}
        try:
            ranks = self.store.arrived(GROUP, version)
        except Exception:  # noqa: BLE001 - the store is the controller's; report what we can
            ranks = []
        return [by_rank[r] for r in ranks if r in by_rank]

    async def reform(self) -> None:
        """Form the next group version with every live member (after a loss, a promotion or
        an abandoned transfer); survivors keep serving what they hold meanwhile. Ranks are
        per version and contiguous; the trainer (rank 0) stays first."""
        group = self.membership.group
        group.group_version += 1
        version = group.group_version
        self.store.fence(GROUP, version)
        members = self.membership.group_members()
        for rank, m in enumerate(members):
            m.set_rank(rank)
            m.machine.group_version = version
        await asyncio.gather(*(self.join(m, version, len(members)) for m in members))
        self.audit.record("group_formed", machine="group", member="group", group_version=version,
                          weights_version=group.weights_version, members=[m.name for m in members])

    def close(self) -> None:
        self.store.close()
