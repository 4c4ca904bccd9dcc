"""Several trainer ranks (``trainer_workers > 1``): their own group, and the multi-sender sync.

**The trainer group.** :func:`form_trainer_group` forms a gloo group of the trainer ranks only
(group ``trainers``, versioned like the weights group: its version is the weights group's
version it was formed under, in the same store, fenced the same way) and has every rank hand
it to the user's ``TrainerWorker.setup(group, rank, world_size)``, before the first sync.
The transport bounds the rendezvous by ``init_timeout_s``.

**The sync.** :class:`ShardedSync` is :class:`~ftstate.controller.sync.WeightSync` with the
transfer step replaced (the vote and the commit are the same code):

1. every trainer rank's ``state_dict()`` is called together (``prepare_shards``); each
   keeps its part and reports its pieces;
2. :func:`~ftstate.core.ownership.plan_ownership` checks the union before a byte is sent:
   overlap, gap, a tensor twice, mismatched shapes or dtypes raise
   :class:`~ftstate.core.errors.OwnershipError` (the attempt is aborted, every rollout keeps
   the version it holds);
3. every owning rank sends its part to every rollout at once, point to point
   (:mod:`ftstate.transport.shards`); each rollout assembles and stages the full state and
   reports the checksum of the full state; all rollouts must agree (each part was already
   verified against its sender's seal);
4. the commit, as for one trainer: ``load_weights`` of the full state, held-bytes proof.

Fault tolerance for several ranks (replacing one rank) is not implemented: the runtime
refuses ``fault_tolerance.enable`` with ``trainer_workers > 1``, and any loss fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ftstate.controller.membership import Member
from ftstate.controller.sync import SyncReport, WeightSync
from ftstate.core.errors import (
    ChecksumMismatch,
    HeldWeightsMismatch,
    MemberLost,
    NoServingWorkers,
    OwnershipError,
    SyncTimeout,
)
from ftstate.core.ownership import Piece, plan_ownership

#: The trainer ranks' group name (its store keys live under ``trainers/v{N}``).
TRAINER_GROUP = "trainers"


async def form_trainer_group(sync: WeightSync) -> int:
    """Form the trainer ranks' group at the weights group's current version and call every
    rank's ``setup``; returns the version. Recorded as ``trainer_group_formed``."""
    ms, formation = sync.membership, sync.formation
    trainers = ms.live("trainer")
    version = ms.group_version
    address = formation.store.address
    await asyncio.gather(*(
        sync.calls.call(m.name, m.handle, "setup_trainer_group", address.host, address.port, TRAINER_GROUP,
                        version, rank, len(trainers), sync.config.init_timeout_s)
        for rank, m in enumerate(trainers)))
    sync.audit.record("trainer_group_formed", machine="group", member="group", group_version=version,
                      members=[m.name for m in trainers])
    return version


class ShardedSync(WeightSync):
    """The sync for several trainer ranks; see the module docstring."""

    async def attempt(self) -> SyncReport:
        ms = self.membership
        group = ms.group
        t0 = time.perf_counter()
        previous = group.weights_version
        target = previous + 1
        trainers = ms.live("trainer")
        if len(trainers) != self.config.trainer_workers:
            raise MemberLost(f"trainer-{len(trainers)}", "a trainer rank is gone", group_version=group.group_version)
        for t in trainers:
            if t.machine.state != "READY":
                raise MemberLost(t.name, f"cannot send weights from state {t.machine.state}",
                                 group_version=group.group_version)
        rollouts = [m for m in ms.role("rollout") if m.machine.state in ("READY", "STALE")]
        if not rollouts:
            raise NoServingWorkers(f"no rollout can receive weights version {target}: {ms.states_text()}")
        group.weights_version = target
        await group.fire("sync_start", rollouts=[m.name for m in rollouts],
                         plan={"senders": [t.name for t in trainers], "route": "collective"})
        group.weights_version = previous
        for t in trainers:
            await t.machine.fire("sync")
        for m in rollouts:
            await m.machine.fire("sync" if m.machine.state == "READY" else "resync")
        group.describe_wait(f"weight sync to version {target}", missing=[m.name for m in [*trainers, *rollouts]])
        timeout = self.config.sync_timeout_s
        try:
            async with group.deadline_scope():
                ownership_rec = await self._prepare(trainers, rollouts, previous)
                sent: dict[str, Any] = {}
                owners = {r for t in ownership_rec.values() for r, *_ in t[3]}
                senders = [t for i, t in enumerate(trainers) if i in owners]
                for i, t in enumerate(trainers):
                    if i not in owners:  # owns nothing this version: nothing to send
                        await self.calls.call(t.name, t.handle, "discard_shards")
                peers = [m.rank for m in rollouts]
                results = await self._transfer([
                    *((t, self.calls.call(t.name, t.handle, "send_shards", target, peers, timeout)) for t in senders),
                    *((m, self.calls.call(m.name, m.handle, "receive_shards", target, ownership_rec, timeout))
                      for m in rollouts),
                ])
                failures = self._failures([*senders, *rollouts], results)
                if not failures:
                    staged = {m.name: r for m, r in zip(rollouts, results[len(senders):], strict=True)}
                    checksum = staged[rollouts[0].name]["checksum"]
                    torn = [n for n, r in staged.items() if r["checksum"] != checksum]
                    if torn:
                        failures = {n: ChecksumMismatch(
                            f"{n} assembled weights version {target} with checksum {staged[n]['checksum']}, "
                            f"{rollouts[0].name} with {checksum}") for n in torn}
                    sent = {"checksum": checksum, "nbytes": staged[rollouts[0].name]["nbytes"]}
                if failures:
                    await self._abort_all(trainers, rollouts, previous, failures)
                    raise next(iter(failures.values()))
                group.weights_version = target
                not_loaded = await self._commit(trainers[0], rollouts, target, sent["checksum"])
                for t in trainers[1:]:
                    t.machine.weights_version = target
                    if t.machine.state == "SYNCING":
                        await t.machine.fire("committed", checksum=sent["checksum"])
                # each rank's heartbeat then reports the committed version and full checksum
                # (a rank suspected later is re-admitted on it, as a single trainer is)
                await asyncio.gather(*(self.calls.call(t.name, t.handle, "note_weights", target, sent["checksum"])
                                       for t in trainers if not t.gone))
                self.raise_if_failed()
        except SyncTimeout:
            group.weights_version = previous
            raise
        ms.committed(target, sent["checksum"])
        await group.fire("sync_done", checksum=sent["checksum"], nbytes=sent["nbytes"])
        user_errors = [e for e in not_loaded.values() if not isinstance(e, (MemberLost, HeldWeightsMismatch))]
        if user_errors:
            raise user_errors[0]
        return SyncReport(
            weights_version=target, checksum=sent["checksum"], nbytes=sent["nbytes"],
            seconds=time.perf_counter() - t0, failovers=0, group_version=group.group_version,
            rollouts=tuple(m.name for m in rollouts if m.name not in not_loaded),
            stale=tuple(n for n, e in not_loaded.items() if isinstance(e, HeldWeightsMismatch)),
            routes={m.name: "collective" for m in rollouts if m.name not in not_loaded},
        )

    async def _prepare(self, trainers: list[Member], rollouts: list[Member], previous: int) -> dict[str, Any]:
        """Every rank's state_dict() together, then the ownership check (before any byte moves);
        returns the ownership's record (what each rollout is told to expect)."""
        results = await asyncio.gather(*(self.calls.call(t.name, t.handle, "prepare_shards", i)
                                         for i, t in enumerate(trainers)), return_exceptions=True)
        failures = self._failures(trainers, results)
        if not failures:
            pieces = [Piece.from_record(rec) for r in results for rec in r["pieces"]]
            try:
                ownership = plan_ownership(pieces, ranks=len(trainers))
            except OwnershipError as exc:
                self.audit.record("ownership_refused", reason=str(exc), tensor=exc.tensor, ranks=list(exc.ranks))
                failures = {trainers[exc.ranks[0] if exc.ranks else 0].name: exc}
        if failures:
            await self._abort_all(trainers, rollouts, previous, failures, reform=False)
            raise next(iter(failures.values()))
        return ownership.record()

    async def _abort_all(self, trainers: list[Member], rollouts: list[Member], previous: int,
                         failures: dict[str, BaseException], *, reform: bool = True) -> None:
        """Nobody committed: every rank drops its part, every survivor keeps ``previous``."""
        for t in trainers[1:]:
            if not t.gone:
                with contextlib.suppress(MemberLost):
                    await self.calls.call(t.name, t.handle, "discard_shards")
                if t.machine.state == "SYNCING":
                    err = failures.get(t.name)
                    await t.machine.fire("sync_aborted", reason=str(err) if err else "sync aborted")
        if not reform:
            # Nothing was sent: the group version is sound, no need for a new one.
            group = self.membership.group
            for m in [trainers[0], *rollouts]:
                if m.machine.state == "SYNCING":
                    await m.machine.fire("sync_aborted", reason="sync refused before any transfer")
                elif m.machine.state == "RESYNCING":
                    await m.machine.fire("resync_failed", reason="sync refused before any transfer")
            group.weights_version = previous
            first = next(iter(failures.items()))
            if group.state == "SYNCING":
                await group.fire("sync_failed", reason=f"{first[0]}: {type(first[1]).__name__}: {first[1]}")
            return
        await self._abort(trainers[0], rollouts, previous, failures)
