"""A trainer rank's part of a sharded state (``trainer_workers`` > 1): what it owns is prepared,
sent to every rollout at once, and restored from a rollout point to point after a failover;
the ranks' own group version is handed to the user's ``setup``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from ftstate.core.errors import ProtocolError
from ftstate.core.protocol import (
    CallCounts,
    CallsSinceCommit,
    DiscardShards,
    Joined,
    JoinTrainerGroup,
    NoteWeights,
    PartChecksum,
    PartHeld,
    PartLoaded,
    PartSent,
    Prepared,
    PrepareShards,
    ReceivePart,
    ReceiveShards,
    SendPart,
    SendShards,
    Staged,
)
from ftstate.worker.part import HostPart
from ftstate.worker.place import device_host


class TrainerRank(HostPart):
    """The sharded-trainer calls of a worker host; a rollout serves the restore's reads."""

    _shard_part: Any  # this rank's prepared part, until sent
    _shard_senders: dict[int, Any]  # one Sender per peer
    _shard_receivers: dict[int, Any]  # one Receiver per sender rank
    _trainer_comm: Any  # the trainer ranks' own group
    # user calls since the last commit (calls_since_commit)
    _calls_started: int
    _calls_done: int
    # the Transfers and Holdings parts it builds on (mixed in beside it): _require_comm,
    # _receive_proven, _committed_state, _hand_over, _on_bucket, _sender, _loaded, _staged

    async def prepare_shards(self, req: PrepareShards) -> Prepared:
        """Trainer rank: call ``state_dict()`` (every rank together: it may be collective), keep this rank's
        part for :meth:`send_shards`, and return its pieces for the ownership check."""
        trainer_rank = req.trainer_rank
        from ftstate.transport.shards import split_state

        comm = self._require_comm()
        async with self._lock():
            part, pieces = split_state(await self._run(self.user.state_dict), rank=trainer_rank, member=self.member,
                                       device_type=comm.device.type, backend=self.backend)
        self._shard_part = part
        self._tick()
        return Prepared(pieces=tuple(p.record() for p in pieces),
                        nbytes=sum(t.numel() * t.element_size() for t in part.values()))

    async def send_shards(self, req: SendShards) -> PartSent:
        """Trainer rank: send the part :meth:`prepare_shards` kept to every rank in ``peers`` at once."""
        weights_version = req.weights_version
        from ftstate.transport.shards import send_part

        comm = self._require_comm()
        part, self._shard_part = self._shard_part, None
        if part is None:
            raise ProtocolError(self.member, f"a send of its part of weights version {weights_version}",
                                "it prepared none")
        self.busy = True
        try:
            report = await asyncio.to_thread(send_part, self._shard_senders, comm, list(req.peers), part,
                                             weights_version=weights_version, timeout_s=req.timeout_s,
                                             bucket_size=self.bucket_bytes, progress=self._on_bucket)
        finally:
            self.busy = False
        self._tick()
        return PartSent(checksum=report["checksum"], nbytes=report["nbytes"], rejected=report["rejected"])

    async def receive_shards(self, req: ReceiveShards) -> Staged:
        """Rollout: receive every owning rank's part at once, assemble the full state and stage it."""
        weights_version = req.weights_version
        from ftstate.core.errors import ManifestError
        from ftstate.core.ownership import Ownership
        from ftstate.transport.shards import receive_parts

        comm = self._require_comm()
        self._staged = None
        self.busy = True
        try:
            staged = await asyncio.to_thread(receive_parts, self._shard_receivers, comm,
                                             Ownership.from_record(dict(req.ownership)), timeout_s=req.timeout_s,
                                             progress=self._on_bucket)
        finally:
            self.busy = False
        if staged.weights_version != weights_version:
            raise ManifestError(f"{self.member}: field 'weights_version': expected {weights_version}, the trainer "
                                f"ranks sent {staged.weights_version}", field="weights_version")
        self._staged = staged
        self._tick()
        return Staged(checksum=staged.state_checksum, nbytes=staged.nbytes, weights_version=weights_version)

    async def note_weights(self, req: NoteWeights) -> None:
        """Trainer rank: its part went into a version committed with the full ``checksum`` (what its heartbeat
        reports); the calls counted so far are in it."""
        self.weights_version = req.weights_version
        self.checksum = req.checksum
        self._calls_started = self._calls_done = 0

    async def calls_since_commit(self, req: CallsSinceCommit) -> CallCounts:
        """Trainer rank: user calls started, and completed without raising, since its last committed (or
        restored) part; a rank that started more than the controller logged is restored too."""
        return CallCounts(started=self._calls_started, done=self._calls_done)

    async def send_part_to(self, req: SendPart) -> PartSent:
        """Rollout: send rank ``trainer_rank``'s part of its committed version to ``peer``, point to point."""
        peer, trainer_rank, timeout_s = req.peer, req.trainer_rank, req.timeout_s
        from ftstate.core.ownership import Ownership
        from ftstate.transport import Sender
        from ftstate.transport.shards import part_of

        comm = self._require_comm()
        state, version = await self._committed_state()
        tensors = getattr(state, "tensors", state)  # a committed version, or what the engine gave back
        part = part_of(Ownership.from_record(dict(req.ownership)), tensors, trainer_rank)
        if self._sender is None:
            self._sender = Sender(bucket_size=self.bucket_bytes)
        self.busy = True
        try:
            report = await asyncio.to_thread(self._sender.send_to, comm, peer, part,
                                             weights_version=version, timeout_s=timeout_s,
                                             progress=self._on_bucket)
        finally:
            self.busy = False
        if not report.ok:
            from ftstate.core.errors import ChecksumMismatch

            raise ChecksumMismatch(f"{self.member}: rank {peer} rejected its part of weights version "
                                   f"{version}: {dict(report.rejected)}")
        return PartSent(checksum=report.state_checksum, nbytes=report.nbytes)

    async def receive_part_from(self, req: ReceivePart) -> PartLoaded:
        """Trainer rank: receive its part of ``weights_version`` from rollout ``src``, prove it against
        ``checksum`` (None: owned nothing), and hand it to ``load_state_dict``; call counts restart here."""
        src, weights_version, trainer_rank, checksum = req.src, req.weights_version, req.trainer_rank, req.checksum
        from ftstate.core.ownership import Ownership
        from ftstate.transport.shards import part_form

        owned = Ownership.from_record(dict(req.ownership))
        if checksum is None:
            part: dict[str, Any] = {}
        else:
            staged = await self._receive_proven(src, weights_version, checksum, timeout_s=req.timeout_s,
                                                what=f"trainer rank {trainer_rank}'s part")
            part = self._hand_over(staged)
        async with self._lock():
            await self._run(self.user.load_state_dict, part_form(owned, part, trainer_rank))
            self._calls_started = self._calls_done = 0
            self.weights_version = weights_version
        self._tick()
        return PartLoaded(received=checksum, tensors=len(part))

    async def part_checksum(self, req: PartChecksum) -> PartHeld:
        """Trainer rank: the checksum of what ``state_dict()`` owns now (collective), proving a restored part;
        ``pieces``: how many it owns."""
        trainer_rank = req.trainer_rank
        from ftstate.transport import state_checksum
        from ftstate.transport.checksum import function_for
        from ftstate.transport.shards import split_state

        async with self._lock():
            part, pieces = split_state(await self._run(self.user.state_dict), rank=trainer_rank,
                                       member=self.member, device_type=None, backend=self.backend)
        return PartHeld(checksum=await asyncio.to_thread(state_checksum, part, function_for(part.values()))
                        if pieces else None,
                        pieces=len(pieces))

    async def discard_shards(self, req: DiscardShards) -> None:
        """Trainer rank: drop a prepared part (the sync was refused or abandoned)."""
        self._shard_part = None

    async def setup_trainer_group(self, req: JoinTrainerGroup) -> Joined:
        """Trainer rank: form the ranks' own gloo group version and hand it to the user's ``setup``; ``RANK``,
        ``WORLD_SIZE`` and ``FTSTATE_TRAINER_GROUP_VERSION`` are set in the environment."""
        store_host, version, rank, world_size = req.store_host, req.version, req.rank, req.world_size
        from ftstate.transport import create_communicator

        if self._trainer_comm is not None:
            self._trainer_comm.abort("the trainer group formed a new version")
        self._trainer_comm = await asyncio.to_thread(
            create_communicator, self.backend, store_addr=(store_host, req.store_port), group=req.group,
            version=version, rank=rank, world_size=world_size, timeout_s=req.timeout_s, device_host=device_host(store_host))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), FTSTATE_TRAINER_GROUP_VERSION=str(version))
        pg = getattr(self._trainer_comm, "process_group", None)
        if pg is None:
            from ftstate.core.errors import BackendUnavailable

            raise BackendUnavailable(f"{self.member}: the {self.backend} backend hands no process group to "
                                     "setup(); trainer_workers > 1 runs on gloo")
        async with self._lock():
            await self._run(self.user.setup, pg, rank, world_size)
        self._tick()
        return Joined(group_version=version, rank=rank)
