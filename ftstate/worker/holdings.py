"""What a rollout's worker host holds, and the proofs of it: the staged version, the committed one (the
transport's copy, or the engine's via ``held_weights()``) and the checksum of what it serves. Commit happens
only after every rollout staged, under the user lock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ftstate.core.errors import ProtocolError, UserCodeError
from ftstate.core.protocol import Checksum, Commit, Discard, Loaded, TrainerChecksum
from ftstate.worker.inflight import PendingSwap
from ftstate.worker.part import HostPart
from ftstate.worker.usercode import mark_user_error, overrides


class Holdings(HostPart):
    """The staged and committed versions of a worker host."""

    _staged: Any  # a transfer's verified version, not yet committed
    # The committed tensors as the transport holds them (resync source); None while the engine holds the only
    # copy.
    _loaded: Any
    # True once ``held_weights()`` gave the committed version back: sends read it, the transport keeps none
    _engine_holds: bool
    _received: str | None  # the checksum the committed version was received with
    _held_mismatch: bool  # the last proven load did not hash to what was received
    _held_proof: tuple[str, float]
    _staging_spare: bool
    _receiver: Any
    _in_flight: bool  # rollout_updates: in_flight
    _pending: PendingSwap  # a committed version waiting for a safe point
    _swap_tasks: set[asyncio.Task[None]]

    async def commit_weights(self, req: Commit) -> Loaded:
        """Rollout: hand the staged version to ``load_weights`` under the user lock; with in-flight updates
        and a call running, it waits for the call's next safe point instead (``deferred``)."""
        staged = self._staged
        if staged is None or staged.weights_version != req.weights_version:
            have = "nothing" if staged is None else f"version {staged.weights_version}"
            raise ProtocolError(self.member, f"commit of weights version {req.weights_version}", f"it staged {have}")
        if self._in_flight and self._lock().locked():
            self._staged = None
            self._pending.offer(staged)
            task = asyncio.get_running_loop().create_task(self._swap_when_free())
            self._swap_tasks.add(task)
            task.add_done_callback(self._swap_tasks.discard)
            return Loaded(checksum=staged.state_checksum, received=staged.state_checksum,
                          weights_version=req.weights_version, nbytes=staged.nbytes, deferred=True)
        return await self._commit(req.weights_version)

    async def _commit(self, weights_version: int) -> Loaded:
        staged = self._staged
        async with self._lock():
            loaded = await self._load_proven(staged, weights_version)
            self._staged = None
        self._tick()
        return loaded

    async def _load_proven(self, staged: Any, weights_version: int) -> Loaded:
        """Load ``staged`` into the user's worker and prove what it holds then (the user lock held)."""
        device_bytes = await self._load_weights(staged.tensors, weights_version)
        if self._proves(weights_version):
            held, from_engine = await self._held_checksum(staged.tensors, staged.state_checksum)
            self._held_mismatch = held != staged.state_checksum
        else:
            # verified bucket by bucket on receipt; an engine that held its weights still does
            held, from_engine = staged.state_checksum, self._engine_holds
        self.weights_version = weights_version
        self.checksum = held
        self._adopt(staged, from_engine)
        # The controller compares ``checksum`` (what this member holds) with the sender's.
        return Loaded(checksum=held, received=staged.state_checksum, weights_version=weights_version,
                      held_bytes=self._held_bytes(), device_bytes=device_bytes, nbytes=staged.nbytes)

    async def _swap_when_free(self) -> None:
        """The call that held a version back ended without a safe point: load it before anything else."""
        async with self._lock():
            await self._swap_now()

    async def _swap_now(self) -> None:
        """Load the version waiting for a safe point, if any (the user lock held)."""
        staged = self._pending.take()
        if staged is not None:
            await self._load_proven(staged, staged.weights_version)
            self._pending.call_versions.append(staged.weights_version)
            self._tick()

    def swap_at_safe_point(self, pause: bool) -> int:
        """In the user's thread between two steps: load the waiting version, if any, as :meth:`_load_proven`
        does; returns the version in effect."""
        staged = self._pending.take()
        if staged is None:
            return self.weights_version
        from ftstate.transport.checksum import state_checksum_like

        version = staged.weights_version
        try:
            if overrides(self.user, "load_weights_part"):
                self._load_by_parts(staged.tensors, version, self.user.weights_device())
            else:
                self.user.load_weights(dict(staged.tensors), version)
            engine = self._engine_weights_now()
        except Exception as exc:
            mark_user_error(exc, f"{type(self.user).__name__}.load_weights()")
            self._held_mismatch = True  # what it holds is unknown now: the next load is proven
            raise
        if self._proves(version):
            held = state_checksum_like(engine if engine is not None else staged.tensors, staged.state_checksum)
            self._held_mismatch = held != staged.state_checksum
        else:
            held = staged.state_checksum
        self.weights_version, self.checksum = version, held
        # the receiver's buffers are let go at the next commit, on the actor's loop, not here
        self._adopt(staged, engine is not None, release=False)
        self._pending.call_versions.append(version)
        self._tick()
        return version

    def _engine_weights_now(self) -> Mapping[str, Any] | None:
        """:meth:`_engine_weights`, in the calling thread."""
        from ftstate.transport.validate import check_state_dict

        if not self._has_held_hook():
            return None
        returned = self.user.held_weights()
        return None if returned is None else check_state_dict(
            returned, device_type=None, member=self.member, backend=self.backend, what="held_weights()")

    async def _load_weights(self, tensors: Mapping[str, Any], weights_version: int) -> int | None:
        """Hand a verified version to the user: whole to ``load_weights``, or part by part through two device
        buckets for an engine on a device; returns the device bytes used (None: whole)."""
        device = await self._run(self.user.weights_device) if overrides(self.user, "load_weights_part") else None
        if device is None:
            await self._run(self.user.load_weights, dict(tensors), weights_version)
            return None

        def load_weights_part() -> int:  # named so a user error names the hook
            return self._load_by_parts(tensors, weights_version, device)

        return int(await self._run(load_weights_part))

    def _load_by_parts(self, tensors: Mapping[str, Any], weights_version: int, device: Any) -> int:
        """``load_weights_part`` through two device buckets, in the calling thread; the device bytes used."""
        import torch

        from ftstate.transport import devicebuckets

        def part(state: dict[str, Any], first: bool, last: bool) -> None:
            self.user.load_weights_part(state, weights_version, first=first, last=last)

        return int(devicebuckets.load_by_buckets(tensors, device=torch.device(device), bucket_bytes=self.bucket_bytes,
                                                 load=part)["device_bytes"])

    async def discard_weights(self, req: Discard) -> None:
        """Drop a staged version; what the user holds (the previous version) stays current."""
        self._staged = None

    async def trainer_checksum(self, req: TrainerChecksum) -> Checksum:
        """Trainer: the checksum of what ``state_dict()`` returns now (proves a checkpoint's version)."""
        async with self._lock():
            return Checksum(await self._trainer_checksum())

    async def _trainer_checksum(self) -> str:
        from ftstate.transport import state_checksum
        from ftstate.transport.checksum import function_for
        from ftstate.transport.validate import check_state_dict

        state = check_state_dict(await self._run(self.user.state_dict), device_type=None, member=self.member,
                                 backend=self.backend)
        # hashed where its tensors are, with the function its sends use (nh64 on a GPU)
        return await asyncio.to_thread(state_checksum, state, function_for(state.values()))

    def _proves(self, weights_version: int) -> bool:
        """Whether this commit hashes what the rollout holds: always with ``every_sync`` or without a
        ``held_weights()`` hook; with ``admission``, a first load, the load after a failed proof, or a fixed
        per-run draw of ``held_weights_proof_fraction``. Resyncs and re-admissions always prove."""
        mode, fraction = self._held_proof
        if mode == "every_sync" or not self._has_held_hook() or not self._holds_committed or self._held_mismatch:
            return True
        import random

        return random.Random(f"{self.run}/{self.member}/{weights_version}").random() < fraction

    def _has_held_hook(self) -> bool:
        return overrides(self.user, "held_weights")

    async def _held_checksum(self, given: Mapping[str, Any] | None, like: str | None) -> tuple[str, bool]:
        """The whole-state checksum of what this rollout serves from, hashed now, and whether it came from its
        engine (``held_weights()``) or the tensors given to ``load_weights``. ``like``: the checksum it is
        compared with, whose hash function it uses. Call with the user lock held or no call running."""
        from ftstate.transport import state_checksum
        from ftstate.transport.checksum import state_checksum_like

        returned = await self._engine_weights()
        held = returned if returned is not None else given
        if held is None:
            raise UserCodeError(self.member, f"{type(self.user).__name__}.held_weights()", "returned None, but "
                                "the transport kept no copy of the weights it loaded (the engine held them before)")
        if like is None:
            return await asyncio.to_thread(state_checksum, held), returned is not None
        return await asyncio.to_thread(state_checksum_like, held, like), returned is not None

    async def _engine_weights(self) -> Mapping[str, Any] | None:
        """What ``held_weights()`` returns, checked like a state dict; None without the hook."""
        from ftstate.transport.validate import check_state_dict

        if not self._has_held_hook():
            return None
        returned = await self._run(self.user.held_weights)
        if returned is None:
            return None
        return check_state_dict(returned, device_type=None, member=self.member, backend=self.backend,
                                what="held_weights()")

    def _hand_over(self, staged: Any) -> dict[str, Any]:
        """A trainer's weights received back: its ``state_dict()`` is the copy that counts, so the receiver
        lets go of the buffer and the tensors are handed over uncloned (a clone doubles the memory)."""
        if self._receiver is not None:
            self._receiver.release()
        return dict(staged.tensors)

    def _adopt(self, staged: Any, from_engine: bool, *, release: bool = True) -> None:
        """Make ``staged`` committed. When the engine gave it back, the transport lets go of its own buffers
        so the weights are held once (twice with ``staging_spare``, the next sync's staging)."""
        self._engine_holds = from_engine
        self._received = staged.state_checksum
        if from_engine:
            self._loaded = None
            if release and self._receiver is not None:
                self._receiver.release(keep_spare=self._staging_spare)
        else:
            self._loaded = staged

    @property
    def _holds_committed(self) -> bool:
        """Whether this rollout holds a committed version: in the transport, or in its engine."""
        return self._loaded is not None or self._engine_holds

    def _held_bytes(self) -> int:
        """Bytes the transport keeps between syncs beside the user's own weights."""
        return self._receiver.held_bytes if self._receiver is not None else 0

    async def _committed_state(self) -> tuple[Mapping[str, Any] | Any, int]:
        """The committed version to send (a newcomer's resync, a trainer's reverse recovery):
        the transport's copy, or read back from the engine when that is the only copy (under
        the user lock, so no load or generation call changes it while it is read). A version
        waiting for a safe point is newer, committed and verified: it is the one sent."""
        waiting = self._pending.peek()
        if waiting is not None:
            return waiting, waiting.weights_version
        if self._loaded is not None:
            return self._loaded, self._loaded.weights_version
        if self._engine_holds:
            async with self._lock():
                state = await self._engine_weights()
            if state is None:
                raise UserCodeError(self.member, f"{type(self.user).__name__}.held_weights()", "returned None; it "
                                    f"held weights version {self.weights_version} and the transport kept no copy")
            return state, self.weights_version
        raise ProtocolError(self.member, "a send of its committed weights", "it holds none")
