"""Group formation, in the controller: the membership into a numbered, fenced group version of the transport.
All or nothing: a failed join fences the version at once and names the member, and no transfer runs under a
version that was not formed (docs/concepts.md, "Group versions")."""

from __future__ import annotations

from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.causes import root_cause
from ftstate.controller.membership import GROUP, Member, Membership
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.protocol import Join


class GroupFormation:
    """Forms group versions on ``store`` (default: a :class:`~ftstate.transport.StoreServer` bound to
    ``host``, this node's address)."""

    def __init__(
        self, *, config: RuntimeConfig, audit: AuditTrail, membership: Membership, calls: ActorCalls, host: str,
        store: Any = None,
    ) -> None:
        if store is None:
            from ftstate.transport import StoreServer

            store = StoreServer(host=host)
        self.config = config
        self.audit = audit
        self.membership = membership
        self.calls = calls
        self.store: Any = store
        #: The highest group version every member joined (0: none yet).
        self.formed = 0
        # Why the formed version can no longer carry a transfer (communicators aborted), or None.
        self._spoiled: str | None = None

    async def join(self, m: Member, version: int, world_size: int) -> None:
        """Have ``m`` join ``version`` at its rank (its transport's wait is bounded by ``init_timeout_s``)."""
        address = self.store.address
        await self.calls.call(m.name, m.handle, Join(address.host, address.port, GROUP, version, m.rank,
                                                      world_size, self.config.init_timeout_s))

    def arrived(self, version: int, members: list[Member]) -> list[str]:
        """Who registered in the store for ``version``: the transport's own record."""
        by_rank = {m.rank: m.name for m in members}
        try:
            ranks = self.store.arrived(GROUP, version)
        except Exception:  # noqa: BLE001 - the store is the controller's; report what we can
            ranks = []
        return [by_rank[r] for r in ranks if r in by_rank]

    @property
    def usable(self) -> bool:
        """The group's current version was formed and no transfer spoiled it."""
        return self.formed == self.membership.group.group_version and self._spoiled is None

    def mark_formed(self, version: int) -> None:
        """Every member joined ``version`` (the runtime's first rendezvous forms it itself)."""
        self.formed = version
        self._spoiled = None

    def spoil(self, reason: str) -> None:
        """The current version's communicators were aborted: the next transfer needs a new version."""
        self._spoiled = reason

    async def ensure_formed(self) -> None:
        """Form the next group version unless the current one is usable; raises what
        :meth:`reform` raises."""
        if not self.usable:
            group = self.membership.group
            why = self._spoiled or (f"group version {group.group_version} was never formed "
                                    f"(last formed: {self.formed})")
            self.audit.record("group_reform", machine="group", member="group", reason=why,
                              group_version=group.group_version, weights_version=group.weights_version)
            await self.reform()

    async def reform(self) -> None:
        """Form the next group version with every live member; survivors serve on meanwhile, the trainer stays
        rank 0. On a failed join the version is fenced, every join awaited, ``group_form_failed`` recorded and
        the failure raised (a loss first). Bounded by each member's ``init_timeout_s`` and, for a hung member,
        by the watchdog's kill."""
        group = self.membership.group
        if self.config.trainer_workers > 1:
            # A rank's part lives in its process: a version without it would renumber the others.
            self.membership.trainer_ranks(self.config.trainer_workers,
                                          f"group version {group.group_version + 1} needs every trainer rank")
        # The trainer first, whatever ranks the members held, so its replacement takes rank 0.
        members = sorted(self.membership.group_members(), key=lambda m: (m.role != "trainer", m.rank))
        group.group_version += 1
        version = group.group_version
        self.store.fence(GROUP, version)
        for rank, m in enumerate(members):
            m.set_rank(rank)
            m.machine.group_version = version
        address, n = self.store.address, len(members)
        failed: list[str] = []  # in the order their joins failed

        def ended(i: int, outcome: Any) -> None:
            if isinstance(outcome, BaseException):
                if not failed:
                    # A join failed: the version is not formed. Supersede it, releasing the members waiting in
                    # it.
                    self.store.fence(GROUP, version + 1)
                failed.append(members[i].name)

        # One call a node through its agent (ActorCalls.fan_out), cancelled with the caller's deadline.
        results = await self.calls.fan_out(
            members, [Join(address.host, address.port, GROUP, version, m.rank, n, self.config.init_timeout_s)
                      for m in members], ended)
        failures = {m.name: r for m, r in zip(members, results, strict=True) if isinstance(r, BaseException)}
        if failures:
            failures = root_cause(failures, failed)
            self.audit.record("group_form_failed", machine="group", member="group", group_version=version,
                              weights_version=group.weights_version, members=[m.name for m in members],
                              failed={n: f"{type(e).__name__}: {e}" for n, e in failures.items()})
            raise next(iter(failures.values()))
        self.mark_formed(version)
        self.audit.record("group_formed", machine="group", member="group", group_version=version,
                          weights_version=group.weights_version, members=[m.name for m in members])

    def close(self) -> None:
        self.store.close()
