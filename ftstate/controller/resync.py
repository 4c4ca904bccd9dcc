"""Resync: bringing a newcomer to the group's current weights, proven by checksum.

A newcomer (a failover's replacement, a drained member's successor, a rollout added to the
fleet) holds no weights yet. A rollout gets them point to point from a surviving holder (over
shared memory beside it, else the collective), or from its node's committed copy (``staging:
node``: adopted in place, or served by another node's agent); a trainer gets them back from a
rollout (``reverse_weight_sync``) or loads ``checkpoint_dir``, the calls since the last commit
replayed; several trainer ranks are recovered together (:mod:`ftstate.controller.ranks`). It is
admitted only once it proves it holds the current version (``HeldWeightsMismatch`` otherwise).
The failover (:mod:`ftstate.controller.failover`), the drain and the scaler call it.

Runs in the driver process, on the controller's event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ftstate.controller.membership import Member, walk_proven
from ftstate.controller.parts import ControllerParts, Part
from ftstate.controller.ranks import recover_ranks
from ftstate.controller.sync import device_field, plan_for
from ftstate.core.errors import (
    ChecksumMismatch,
    DeadlineExceeded,
    HeldWeightsMismatch,
    LossyRecoveryRefused,
    ManifestError,
    MemberLost,
    StaleCheckpointRefused,
    TransportError,
)
from ftstate.core.protocol import (
    AdoptNodeCopy,
    FetchNodeCopy,
    Loaded,
    ReceiveFrom,
    SendTo,
    TrainerChecksum,
    UserCall,
)


class Resync(Part):
    """Moves the current weights to newcomers. trainer_lossy: the user trainer class's
    ``lossy_state_dict`` (reverse recovery from a lossy copy is refused unless
    ``allow_lossy_recovery``); rank_local_calls: its ``rank_local_calls`` (several ranks:
    who replays, :mod:`ftstate.controller.ranks`); node_copies (the parts'): with ``staging: node``,
    each node's committed copy, which a rollout newcomer there adopts."""

    def __init__(self, parts: ControllerParts, *, trainer_lossy: bool, trainer_class_name: str,
                 rank_local_calls: bool = False) -> None:
        super().__init__(parts)
        self.trainer_lossy = trainer_lossy
        self.trainer_class_name = trainer_class_name
        self.rank_local_calls = rank_local_calls
        self._stages: dict[str, dict[str, Any]] = {}  # newcomer -> its resync's stage timings
        self._device: dict[str, int] = {}  # newcomer -> the device bytes of its resync's load by parts
        self._fed_by: dict[str, str] = {}  # newcomer -> who its last resync read from (a member, a node copy)
        #: Bytes of the last committed weights version (the runtime sets it at each commit): what
        #: a resync moves, for its route (``resync_shared_memory_min_mb``).
        self.weights_bytes = 0

    async def resync(self, newcomer: Member, source: Member | None = None) -> bool:
        """Move the current version to the newcomer only; False when it must wait for the next
        sync. ``source``: the holder to send it, when it still holds it (else one is chosen)."""
        group = self.membership.group
        _still_up(newcomer)
        # Idempotent on a retry: the newcomer may be anywhere between RENDEZVOUS and STALE.
        if newcomer.machine.state == "RENDEZVOUS":
            await newcomer.machine.fire("joined")
        elif newcomer.machine.state == "RESYNCING":
            await newcomer.machine.fire("resync_failed", reason="transfer to be made again")
        version, checksum = group.weights_version, self.membership.checksum
        if version == 0 or checksum is None:
            if newcomer.role == "trainer":
                await self._trainer_without_weights(newcomer)
            return False
        def holders() -> list[Member]:
            return self.membership.holders(exclude=newcomer)

        sources = holders()
        if not sources and newcomer.role == "trainer":
            # Rollouts blocked behind the hung trainer were suspected too; let them prove
            # their weights before concluding that nobody holds them.
            await self.watchdog.settle_suspects(done=lambda: bool(holders()))
            sources = holders()
        if newcomer.role == "trainer":
            if not self.ft.reverse_weight_sync:
                await self._trainer_from_checkpoint(newcomer)
                return True
            await self._refuse_lossy(newcomer)
            if not sources:
                err = MemberLost(newcomer.name, "no rollout holds the current weights version to rebuild the trainer")
                await group.fire("fail", reason=str(err), error=err)
                raise err
        elif await self._adopt_node_copy(newcomer, version, checksum) or await self._fetch_node_copy(
                newcomer, version, checksum, sources):
            return True
        elif not sources:
            return False  # no survivor holds it: the next sync resyncs the newcomer
        # a holder on the newcomer's node first: the plan then reads shared memory, no socket
        src = source if source in sources else min(
            sources, key=lambda m: m.node_id is None or m.node_id != newcomer.node_id)
        # under the new group version shared memory means new slots, dearer than the collective
        # for one newcomer below resync_shared_memory_min_mb (measured, docs/benchmarks.md)
        small = self.config.shared_memory == "auto" \
            and self.weights_bytes < self.config.resync_shared_memory_min_mb * 2**20
        plan = plan_for(self.config, src, [newcomer], "off" if small else None)
        record = plan.record()
        if small and src.node_id is not None and src.node_id == newcomer.node_id:
            record["collective"] = (f"{self.weights_bytes} bytes, below resync_shared_memory_min_mb "
                                    f"({self.config.resync_shared_memory_min_mb:g} MiB)")
        _still_up(newcomer)
        self._fed_by[newcomer.name] = src.name
        await newcomer.machine.fire("resync", source=src.name, plan=record)
        timeout = self.config.sync_timeout_s
        shm = plan.uses_shm
        sent, got = await asyncio.gather(
            self.calls.call(src.name, src.handle, SendTo(newcomer.rank, timeout, shm, plan.require_shm)),
            self.calls.call(newcomer.name, newcomer.handle, ReceiveFrom(src.rank, version, checksum, timeout, shm)),
        )
        if got.checksum != checksum:
            # It received the version intact but does not hold it after loading (a rollout's
            # engine copy, or a trainer whose state_dict() differs from what it loaded).
            raise HeldWeightsMismatch(newcomer.name, weights_version=version, held=got.checksum,
                                      expected=checksum, what=f"after loading it from {src.name}")
        newcomer.machine.now_holds(version)
        self._stages[newcomer.name] = {"source": src.name, "route": "shm" if shm else "gloo",
                                       "sender": dict(sent.stages), "newcomer": dict(got.stages)}
        await walk_proven(newcomer.machine, "RESYNCED", checksum=got.checksum, source=src.name,
                          **self._loaded_by_parts(newcomer, got))
        if newcomer.role == "trainer":
            await self._optimizer_policy(newcomer)
            await self._replay(newcomer)
        await walk_proven(newcomer.machine, "READY")
        return True

    async def _adopt_node_copy(self, newcomer: Member, version: int, checksum: str) -> bool:
        """A rollout newcomer on a node holding the committed version's node copy
        (``staging: node``) takes it from there: mapped and hashed in place, no transfer (route
        ``node_copy`` in its ``resync`` record). False when there is none; when the copy turns
        out gone or not that version, the newcomer is STALE again, ``node_copy_fallback``
        records why, and the caller resyncs it point to point."""
        copy = self.node_copies.source_for(newcomer.node_id, version, checksum) if self.node_copies else None
        if copy is None:
            return False
        return await self._from_node_copy(
            newcomer, copy, version, checksum, source="node copy", route="node_copy", errors=(ManifestError,
            ChecksumMismatch), refused="the node copy could not be adopted", instead="point to point",
            load=lambda: self.calls.call(newcomer.name, newcomer.handle,
                                         AdoptNodeCopy(copy.name, copy.owner, copy.group, version, checksum)))

    async def _fetch_node_copy(self, newcomer: Member, version: int, checksum: str,
                               holders: list[Member]) -> bool:
        """A rollout newcomer on a node with neither the committed node copy nor a holder (``holders``) is
        served point to point by another node's agent from that node's copy (checkpoint-engine's
        P2P mode: no rollout engine and no trainer sends; ``resync`` record source ``node copy
        on <node>``, route ``node_copy_p2p``), proving it by checksum. False when no node holds
        one; when serving or receiving fails, the newcomer is STALE again, ``node_copy_fallback``
        records why, and the caller resyncs it from a holder."""
        if any(m.node_id is not None and m.node_id == newcomer.node_id for m in holders):
            return False  # a holder beside it: shared memory, no network
        copy = self.node_copies.remote_source(newcomer.node_id, version, checksum) if self.node_copies else None
        if copy is None:
            return False
        async def load() -> Loaded:
            served = await self.node_copies.serve(copy)
            # bounded inside the newcomer by sync_timeout_s, and by the failover's deadline here
            return await self.calls.call(newcomer.name, newcomer.handle, FetchNodeCopy(
                served, copy.name, copy.owner, copy.group, version, checksum, self.config.sync_timeout_s))

        # MemberLost: the serving agent gone (the newcomer's own death is re-raised)
        return await self._from_node_copy(
            newcomer, copy, version, checksum, source=f"node copy on {copy.node_id[:8]}", route="node_copy_p2p",
            errors=(ManifestError, ChecksumMismatch, TransportError, DeadlineExceeded, MemberLost),
            refused="the node copy could not be served point to point", instead="from a holder", load=load)

    async def _from_node_copy(self, newcomer: Member, copy: Any, version: int, checksum: str, *, source: str,
                              route: str, errors: tuple[type[Exception], ...], refused: str, instead: str,
                              load: Any) -> bool:
        """Resync ``newcomer`` from node copy ``copy`` through ``load()`` (its ``resync`` record:
        ``source``, route ``route``); one of ``errors`` makes it STALE again with a
        ``node_copy_fallback`` record (False: the caller tries the next source)."""
        plan = {"sender": source, "node": copy.node_id[:8], "mode": self.config.shared_memory,
                "routes": {newcomer.name: route}, "segment": copy.name}
        _still_up(newcomer)
        self._fed_by[newcomer.name] = source
        await newcomer.machine.fire("resync", source=source, plan=plan)
        try:
            got = await load()
        except errors as exc:
            if isinstance(exc, MemberLost) and exc.member == newcomer.name:
                raise  # the newcomer itself died: the failover handles that
            self.audit.record("node_copy_fallback", member=newcomer.name, node=copy.node_id[:8],
                              reason=f"{refused}: {exc}"[:500])
            await newcomer.machine.fire("resync_failed", reason=f"node copy refused; {instead} instead")
            return False
        if got.checksum != checksum:
            raise HeldWeightsMismatch(newcomer.name, weights_version=version, held=got.checksum,
                                      expected=checksum, what=f"after loading it from the {source}")
        newcomer.machine.now_holds(version)
        await walk_proven(newcomer.machine, "RESYNCED", checksum=got.checksum, source=source,
                          **self._loaded_by_parts(newcomer, got))
        await walk_proven(newcomer.machine, "READY")
        return True

    def _loaded_by_parts(self, newcomer: Member, got: Loaded) -> dict[str, int]:
        """The ``device_bytes`` of a newcomer's resync that loaded by parts (``got``: its host's
        answer), kept for its :class:`~ftstate.controller.failover.FailoverRecord`, as fields for the record of the edge that
        says it holds the weights; empty for a load whole."""
        device = got.device_bytes
        if device is None:
            return {}
        self._device[newcomer.name] = int(device)
        return device_field(int(device))

    def resync_facts(self, newcomer: str) -> tuple[str | None, dict[str, Any] | None, int | None]:
        """Who fed ``newcomer`` in its last :meth:`resync` (None: nobody yet), and the stage
        timings and load-by-parts device bytes kept for it (for a record other than a
        :class:`~ftstate.controller.failover.FailoverRecord`), taken out."""
        return self._fed_by.pop(newcomer, None), self._stages.pop(newcomer, None), self._device.pop(newcomer, None)

    async def _refuse_lossy(self, newcomer: Member) -> None:
        """Fail the run rather than rebuild a trainer from a lossy copy (unless allowed)."""
        if self.trainer_lossy and not self.ft.allow_lossy_recovery:
            err = LossyRecoveryRefused(
                f"{newcomer.name}: refusing to rebuild the trainer from rollout weights: "
                f"{self.trainer_class_name}.lossy_state_dict is true (rollouts hold a lossy copy "
                "of the master weights); set fault_tolerance.allow_lossy_recovery or use checkpoint_dir"
            )
            await self.membership.group.fire("fail", reason=str(err), error=err)
            raise err

    async def recover_ranks(self, newcomers: list[Member]) -> None:
        """Replaced trainer ranks (several ranks): :func:`ftstate.controller.ranks.recover_ranks`
        (after a loss, or a drain that moved them)."""
        ms = self.membership
        if ms.weights_version:
            await self._refuse_lossy(newcomers[0])
            if not ms.holders():
                # Rollouts blocked behind a hung rank were suspected too: let them prove their weights.
                await self.watchdog.settle_suspects(done=lambda: bool(ms.holders()))
        await recover_ranks(newcomers, config=self.config, audit=self.audit, membership=ms, calls=self.calls,
                            formation=self.formation, rank_local_calls=self.rank_local_calls,
                            new_optimizer=self._optimizer_policy)

    async def _replay(self, trainer: Member) -> None:
        """Re-run, on the new trainer, the calls made since the last committed sync."""
        calls = list(self.membership.trainer_calls)
        for c in calls:
            await self.calls.call(trainer.name, trainer.handle, UserCall(c.method, tuple(c.args), dict(c.kwargs), True))
        if calls:
            self.audit.record("trainer_replay", member=trainer.name, calls=[c.method for c in calls])

    async def _trainer_without_weights(self, newcomer: Member) -> None:
        # No version was ever committed: the new trainer starts from its own construction,
        # like the first one did, unless a checkpoint is named.
        if self.ft.checkpoint_dir is not None:
            await self._trainer_from_checkpoint(newcomer)
            return
        await newcomer.machine.fire("resync")
        await newcomer.machine.fire("verified", reason="no committed version yet: constructed weights")
        await newcomer.machine.fire("admit")

    async def _trainer_from_checkpoint(self, newcomer: Member) -> None:
        path = self.ft.checkpoint_dir
        if path is None:
            err = MemberLost(newcomer.name, "trainer lost with reverse_weight_sync off and no checkpoint_dir to "
                                            "recover from")
            await self.membership.group.fire("fail", reason=str(err), error=err)
            raise err
        await newcomer.machine.fire("resync", source=path)
        await self.calls.call(newcomer.name, newcomer.handle, UserCall("load_checkpoint", (path,)))
        # Proof, not trust: what the trainer holds now is hashed and matched against the
        # versions this run committed. Only the current one is admitted as is (and the calls
        # since it replayed); an older one would silently roll the run back.
        held = (await self.calls.call(newcomer.name, newcomer.handle, TrainerChecksum())).checksum
        ms = self.membership
        version, expected = ms.weights_version, ms.checksum
        if expected is None or held == expected:
            await newcomer.machine.fire("verified", source=path, checksum=held)
            if expected is not None:
                await self._replay(newcomer)
            await newcomer.machine.fire("admit")
            return
        matches = ms.versions_by_checksum.get(held)
        if not self.ft.allow_checkpoint_rollback:
            err = StaleCheckpointRefused(member=newcomer.name, checkpoint=path, held=held, expected=expected,
                                         current_version=version, matches_version=matches)
            await ms.group.fire("fail", reason=str(err), error=err)
            raise err
        self.audit.record("checkpoint_rollback", member=newcomer.name, checkpoint=path, checksum=held,
                          matches_version=matches, weights_version=version,
                          calls_dropped=[c.method for c in ms.trainer_calls])
        ms.trainer_calls.clear()
        await newcomer.machine.fire("verified", source=path, checksum=held,
                                    reason=f"checkpoint rollback accepted (holds version {matches})")
        await newcomer.machine.fire("admit")

    async def _optimizer_policy(self, newcomer: Member) -> None:
        if self.ft.optimizer_state == "checkpoint":
            await self.calls.call(newcomer.name, newcomer.handle,
                                  UserCall("load_optimizer_checkpoint", (self.ft.checkpoint_dir,)))
        else:
            await self.calls.call(newcomer.name, newcomer.handle, UserCall("reset_optimizer"))


def _still_up(newcomer: Member) -> None:
    """A newcomer that died while it was being brought up (its death reached its machine
    between two steps of the round) is the round's MemberLost: the next candidate takes over."""
    if newcomer.gone:
        error = newcomer.machine.error
        raise MemberLost(newcomer.name, error.reason if isinstance(error, MemberLost) else
                         str(error or "died while being brought up"))
