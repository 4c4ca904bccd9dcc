"""Group formation: turning the membership into a numbered group version of the transport.

The controller hosts the rendezvous store (:class:`~ftstate.transport.StoreServer`), which
outlives every member. Forming version N has every member join ``weights/vN`` at its rank;
forming N+1 first fences N in the store, so anything still addressed to N (a straggler's
message, a superseded rendezvous) is rejected and its waiters are released at once.

The first version of a run is formed by the runtime inside the group's RENDEZVOUS deadline
(``init_timeout_s``); later versions (after a loss, a promotion, a shrink, an abandoned
transfer) by :meth:`GroupFormation.reform`, inside whatever state's deadline its caller holds;
its joins go one call a node through the node's agent, as a sync's calls do
(:meth:`~ftstate.controller.calls.ActorCalls.fan_out`).

A version is *formed* only when every member's join of it returned. The one thing that must
not happen is a transfer under a version that was not formed: its members left the previous
version when they began to join, so each would answer that it belongs to no group at all.
So formation is all or nothing: when one member's join fails (it died, or is unreachable on a
lost node) the version is abandoned at once (fenced: the members waiting in it for that rank
are released instead of waiting out ``init_timeout_s``), nothing is left joining in the
background, and the error names the member. A transfer abandoned mid-stream spoils its version
too (:meth:`GroupFormation.spoil`). :meth:`GroupFormation.ensure_formed` is what a sync calls
first: it forms the next version when the current one is not usable, so the controller never
runs a transfer under a version that was abandoned or never completed.
"""

from __future__ import annotations

from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.causes import root_cause
from ftstate.controller.membership import GROUP, Member, Membership
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.protocol import Join


class GroupFormation:
    """Forms group versions. host: the address the store binds (this node's); store: the
    rendezvous store to form them on (the cluster backend's; default: a
    :class:`~ftstate.transport.StoreServer` bound to ``host``)."""

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
        # Why the formed version can no longer carry a transfer (its communicators were
        # aborted mid-stream), or None while it can.
        self._spoiled: str | None = None

    async def join(self, m: Member, version: int, world_size: int) -> None:
        """Have ``m`` join ``version`` at its rank (its transport bounds its own wait by
        ``init_timeout_s``; the caller's state deadline bounds the whole formation)."""
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
        """The current version's communicators were aborted (a transfer abandoned mid-stream):
        the next transfer needs a new version (:meth:`ensure_formed`)."""
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
        """Form the next group version with every live member (after a loss, a promotion or
        an abandoned transfer); survivors keep serving what they hold meanwhile. Ranks are
        per version and contiguous; the trainer (rank 0) stays first.

        All or nothing (see the module docstring): when a join fails, the version is fenced so
        the others stop waiting in it, every join is awaited (they end at once), the failure
        is recorded (``group_form_failed``) and raised, a member's loss first. Bounded by each
        member's own wait (``init_timeout_s``) and, for a member that hangs, by the watchdog:
        a member declared LOST is killed, which ends its pending join."""
        group = self.membership.group
        if self.config.trainer_workers > 1:
            # A rank's part lives in its process: a version without one would renumber the
            # others, and the replacement could not take the lost rank. (Its failover takes
            # every lost rank in before it forms the next version.)
            self.membership.trainer_ranks(self.config.trainer_workers,
                                          f"group version {group.group_version + 1} needs every trainer rank")
        # The trainer first, whatever the ranks the members held: a version formed while the
        # trainer was gone (rollouts only) numbered the rollouts from 0, and its replacement,
        # which takes the lost trainer's rank 0, must not sort behind one of them.
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
                    # A join failed: the version is not formed, whatever the others saw (the
                    # failed member may have registered before its call failed). Supersede it, so
                    # nobody uses it and the members waiting in it for a missing rank are released now.
                    self.store.fence(GROUP, version + 1)
                failed.append(members[i].name)

        # One call a node through its agent (ActorCalls.fan_out), as a sync's: a reform after a
        # trainer rank's loss has every member join, 10,000 calls in flight at once otherwise.
        # Cancelled with the caller's state deadline, the joins go with it.
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
