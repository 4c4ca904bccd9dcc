"""Several trainer ranks (``trainer_workers > 1``), in the controller: the ranks' own group
(:func:`form_trainer_group`), the multi-sender sync (:class:`ShardedSync`: ownership checked before a byte
moves, every part sent point to point, then the usual vote and commit) and the replacement of lost ranks
(:func:`recover_ranks`); docs/concepts.md, "Several trainer ranks"."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ftstate.controller.calls import ActorCalls
from ftstate.controller.formation import GroupFormation
from ftstate.controller.membership import CommittedParts, Member, Membership, walk_proven
from ftstate.controller.sync import SyncReport, WeightSync
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import (
    ChecksumMismatch,
    HeldWeightsMismatch,
    MemberLost,
    OwnershipError,
    RankNotRecoverable,
    SyncTimeout,
)
from ftstate.core.ownership import Piece, plan_ownership
from ftstate.core.protocol import (
    CallsSinceCommit,
    DiscardShards,
    JoinTrainerGroup,
    NoteWeights,
    PartChecksum,
    PrepareShards,
    ReceivePart,
    ReceiveShards,
    SendPart,
    SendShards,
    UserCall,
)

#: The trainer ranks' group name (its store keys live under ``trainers/v{N}``).
TRAINER_GROUP = "trainers"


async def form_trainer_group(*, membership: Membership, formation: GroupFormation, calls: ActorCalls,
                             audit: AuditTrail, timeout_s: float) -> int:
    """Form the trainer ranks' group at the weights group's current version (older ones fenced) and call every
    rank's ``setup``; returns the version. ``timeout_s`` bounds the rendezvous."""
    trainers = membership.live("trainer")
    version = membership.group_version
    formation.store.fence(TRAINER_GROUP, version)
    address = formation.store.address
    await asyncio.gather(*(
        calls.call(m.name, m.handle, JoinTrainerGroup(address.host, address.port, TRAINER_GROUP,
                                                      version, m.rank, len(trainers), timeout_s))
        for m in trainers))
    audit.record("trainer_group_formed", machine="group", member="group", group_version=version,
                 members=[m.name for m in trainers])
    return version


async def recover_ranks(newcomers: list[Member], *, config: RuntimeConfig, audit: AuditTrail,
                        membership: Membership, calls: ActorCalls, formation: GroupFormation,
                        rank_local_calls: bool, new_optimizer: Callable[[Member], Awaitable[None]]) -> None:
    """Bring replaced ranks (``newcomers``) and any survivor that needs it to the state of the calls logged
    since the last sync. Raises MemberLost (re-form and retry), TransportError (a part damaged: transfer
    again) or RankNotRecoverable (nothing committed yet)."""
    ms = membership
    trainers = ms.trainer_ranks(config.trainer_workers, "the ranks are recovered together")
    fresh = {m.name for m in newcomers}
    for m in newcomers:
        if m.machine.state == "RENDEZVOUS":
            await m.machine.fire("joined")
        elif m.machine.state == "RESYNCING":
            await m.machine.fire("resync_failed", reason="rank recovery to be made again")
    logged = list(ms.trainer_calls)
    survivors = [m for m in trainers if m.name not in fresh]
    counts = await asyncio.gather(*(calls.call(m.name, m.handle, CallsSinceCommit()) for m in survivors))
    # A survivor whose own count differs from the log holds what no replay reproduces.
    unsure = {m.name for m, c in zip(survivors, counts, strict=True)
              if (c.started, c.done) != (len(logged), len(logged))}
    if rank_local_calls or not (logged or unsure):
        restore = [m for m in trainers if m.name in fresh or m.name in unsure]
    else:
        restore = list(trainers)
    await form_trainer_group(membership=ms, formation=formation, calls=calls, audit=audit,
                             timeout_s=config.init_timeout_s)
    parts = ms.parts
    if parts is None or ms.weights_version == 0:
        kept = [m.name for m in restore if m.name not in fresh]
        if kept:
            err = RankNotRecoverable(kept)
            await ms.group.fire("fail", reason=str(err), error=err)
            raise err
        for m in newcomers:
            await m.machine.fire("resync")
            await m.machine.fire("verified", reason="no committed version yet: constructed weights")
    else:
        await _restore_parts(restore, parts, config=config, membership=ms, calls=calls)
        # Proof, not trust: every restored rank must own exactly what it sent at the commit.
        owned = await asyncio.gather(*(calls.call(m.name, m.handle, PartChecksum(m.rank)) for m in trainers))
        for m, got in zip(trainers, owned, strict=True):
            if m not in restore:
                continue
            expected = parts.checksums.get(m.rank)
            if got.checksum != expected:
                raise HeldWeightsMismatch(m.name, weights_version=ms.weights_version, held=got.checksum,
                                          expected=expected, what="after load_state_dict of its part")
            if m.name in fresh:
                await walk_proven(m.machine, "RESYNCED", part_checksum=expected)
            else:
                m.machine.record("part_restored", part_checksum=expected)
    for m in newcomers:
        await new_optimizer(m)
    for c in logged:
        await asyncio.gather(*(calls.call(m.name, m.handle, UserCall(c.method, tuple(c.args), dict(c.kwargs), True))
                               for m in restore))
    audit.record("trainer_ranks_recovered", machine="group", member="group", weights_version=ms.weights_version,
                 newcomers=sorted(fresh), restored=[m.name for m in restore],
                 untouched=[m.name for m in trainers if m not in restore], replayed=[c.method for c in logged])
    for m in newcomers:
        await walk_proven(m.machine, "READY")


async def _restore_parts(ranks: list[Member], parts: CommittedParts, *, config: RuntimeConfig,
                         membership: Membership, calls: ActorCalls) -> None:
    """Each of ``ranks`` gets its part of the current version from a serving rollout, spread over holders."""
    ms = membership
    holders = ms.holders()
    if not holders:
        raise MemberLost(ranks[0].name, "no rollout holds the current weights version to restore trainer ranks from",
                         group_version=ms.group_version)
    by_source: dict[str, list[Member]] = {}
    for i, m in enumerate(ranks):
        by_source.setdefault(holders[i % len(holders)].name, []).append(m)
    timeout = config.sync_timeout_s

    async def from_source(src: Member, targets: list[Member]) -> None:
        for m in targets:
            expected = parts.checksums.get(m.rank)
            if m.machine.state == "STALE":  # a newcomer (a survivor restored stays READY: it serves on)
                await m.machine.fire("resync", source=src.name)
            receive = calls.call(m.name, m.handle, ReceivePart(src.rank, ms.weights_version,
                                                               parts.ownership, m.rank, expected, timeout))
            if expected is None:  # it owned nothing: nothing travels, load_state_dict({}) all the same
                await receive
                continue
            await asyncio.gather(
                calls.call(src.name, src.handle, SendPart(m.rank, parts.ownership, m.rank, timeout)), receive)

    await asyncio.gather(*(from_source(ms.get(name), targets) for name, targets in by_source.items()))


class ShardedSync(WeightSync):
    """The sync for several trainer ranks; see the module docstring."""

    async def attempt(self) -> SyncReport:
        ms = self.membership
        group = ms.group
        t0, previous, previous_checksum = self._opening()
        target = previous + 1
        trainers = ms.trainer_ranks(self.config.trainer_workers, "every rank sends its part")
        rollouts = await self._begin(trainers, target, lambda _: {"senders": [t.name for t in trainers],
                                                                   "route": "collective"})
        timeout = self.config.sync_timeout_s
        try:
            async with group.deadline_scope():
                ownership_rec = await self._prepare(trainers, rollouts, previous)
                sent: dict[str, Any] = {}
                owners = {r for t in ownership_rec.values() for r, *_ in t[3]}
                senders = [t for i, t in enumerate(trainers) if i in owners]
                for i, t in enumerate(trainers):
                    if i not in owners:  # owns nothing this version: nothing to send
                        await self.calls.call(t.name, t.handle, DiscardShards())
                peers = [m.rank for m in rollouts]
                send, receive = SendShards(target, tuple(peers), timeout), ReceiveShards(target, ownership_rec, timeout)
                results = await self._transfer([*senders, *rollouts], [send] * len(senders) + [receive] * len(rollouts))
                failures = self._failures([*senders, *rollouts], results)
                if not failures:
                    part_checksums: dict[int, str | None] = {t.rank: None for t in trainers}
                    part_checksums.update({t.rank: r.checksum for t, r in zip(senders, results, strict=False)})
                    staged = {m.name: r for m, r in zip(rollouts, results[len(senders):], strict=True)}
                    checksum = staged[rollouts[0].name].checksum
                    torn = [n for n, r in staged.items() if r.checksum != checksum]
                    if torn:
                        failures = {n: ChecksumMismatch(
                            f"{n} assembled weights version {target} with checksum {staged[n].checksum}, "
                            f"{rollouts[0].name} with {checksum}") for n in torn}
                    sent = {"checksum": checksum, "nbytes": staged[rollouts[0].name].nbytes}
                if failures:
                    await self._abort_all(trainers, rollouts, previous, failures)
                    raise next(iter(failures.values()))
                ms.current(target, sent["checksum"])  # the vote (see Membership.current)
                not_loaded = await self._commit(trainers[0], rollouts, target, sent["checksum"])
                for t in trainers[1:]:
                    t.machine.now_holds(target)
                    if t.machine.state == "SYNCING":
                        await t.machine.fire("committed", checksum=sent["checksum"])
                # Each rank's heartbeat then reports the committed version and full checksum.
                failed: list[BaseException] = []  # in the order they end: the first to fail is raised

                def note_failure(_: int, outcome: Any) -> None:
                    if isinstance(outcome, BaseException):
                        failed.append(outcome)

                await self._to_each([t for t in trainers if not t.gone], NoteWeights(target, sent["checksum"]),
                                    on_end=note_failure)
                if failed:
                    raise failed[0]
                self.raise_if_failed()
        except SyncTimeout:
            ms.current(previous, previous_checksum)
            raise
        ms.committed(target, sent["checksum"])
        ms.parts = CommittedParts(ownership_rec, part_checksums)
        device = {n: b for n, b in self.device_bytes.items() if n not in not_loaded}
        await group.fire("sync_done", checksum=sent["checksum"], nbytes=sent["nbytes"],
                         **({"peak_device_bytes": max(device.values()), "device_bytes": device} if device else {}))
        user_errors = [e for e in not_loaded.values() if not isinstance(e, (MemberLost, HeldWeightsMismatch))]
        if user_errors:
            raise user_errors[0]
        return SyncReport(
            weights_version=target, checksum=sent["checksum"], nbytes=sent["nbytes"],
            seconds=asyncio.get_running_loop().time() - t0, failovers=0, group_version=group.group_version,
            rollouts=tuple(m.name for m in rollouts if m.name not in not_loaded),
            stale=tuple(n for n, e in not_loaded.items() if isinstance(e, HeldWeightsMismatch)),
            routes={m.name: "collective" for m in rollouts if m.name not in not_loaded},
            pending=tuple(n for n in self.pending if n not in not_loaded),
            device_bytes=device,
        )

    async def _prepare(self, trainers: list[Member], rollouts: list[Member], previous: int) -> dict[str, Any]:
        """Every rank's state_dict() together, then the ownership check; returns the ownership's record."""
        results = await self._fan_out(trainers, [PrepareShards(i) for i in range(len(trainers))])
        failures = self._failures(trainers, results)
        if not failures:
            pieces = [Piece.from_record(rec) for r in results for rec in r.pieces]
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
                    await self.calls.call(t.name, t.handle, DiscardShards())
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
            group.now_holds(previous)
            first = next(iter(failures.items()))
            if group.state == "SYNCING":
                await group.fire("sync_failed", reason=f"{first[0]}: {type(first[1]).__name__}: {first[1]}")
            return
        await self._abort(trainers[0], rollouts, previous, failures, senders=trainers[1:])
