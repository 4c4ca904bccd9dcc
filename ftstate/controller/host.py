"""WorkerHost: the Ray actor that hosts one user worker and its end of the weight transport.

The controller (:class:`ftstate.controller.runtime.Runtime`) never talks to user code directly; it
calls a host, which

- constructs the user's :class:`~ftstate.core.worker.TrainerWorker` / ``RolloutWorker``; a
  constructor that raises does not kill the process (Ray would report only "the actor died
  in its creation task", the user's line buried in a coloured traceback): the host keeps
  the error and answers every call with a :class:`~ftstate.core.errors.WorkerInitError`
  naming the member, the class, the user's exception and the frame in their code;
- marks every exception the user's code raises with the method that raised it
  (``MyRollout.load_weights()``) and the user's own frames, which
  :mod:`ftstate.controller.calls` puts in front of the caller;
- joins weight-sync group versions and sends, stages, commits or discards weights;
- runs user methods one at a time, plain ones in a thread so the actor's event loop keeps
  answering heartbeats (a blocking call in an async actor would freeze it, DESIGN.md);
- answers heartbeats with a progress counter, whether it is busy in a transfer, and the
  weights version and checksum it holds committed.

Weights are committed in two phases so no rollout ever holds a torn or a lone version:
``receive_weights`` stages and verifies every bucket (the previous version stays in place);
``commit_weights`` hands the staged state to ``load_weights`` only after the controller saw
every rollout stage the same version; ``discard_weights`` drops it otherwise. The user lock
is held during the commit, so no generation call runs against half-loaded weights.

This is the shell: it imports torch (through the transport) and runs inside Ray.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import sys
import sysconfig
import time
import traceback
from collections.abc import Mapping
from typing import Any

from ftstate.core.errors import FTError, TransportError, WorkerInitError
from ftstate.core.text import bounded, clean


class WorkerHost:
    """One worker process.

    member: its name (``rollout-1``); role: ``trainer`` or ``rollout``; user_cls, args,
    kwargs: the user's class and constructor arguments; backend: ``gloo`` or ``nccl``;
    bucket_bytes: broadcast bucket size; run, secret: the run's id and secret (installed for the
    transport's MACs; None: the run does not authenticate); integrity: ``security.integrity``;
    held_proof: ``(held_weights_proof, held_weights_proof_fraction)``, when a commit hashes what
    the rollout's ``held_weights()`` returns (:meth:`_proves`); staging_spare: a rollout
    whose engine holds its weights keeps its staging buffer for the next sync (:meth:`_adopt`).
    """

    def __init__(
        self,
        member: str,
        role: str,
        user_cls: type,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        backend: str,
        bucket_bytes: int,
        *,
        run: str = "",
        secret: bytes | None = None,
        integrity: str = "xxh3",
        held_proof: tuple[str, float] = ("every_sync", 0.0),
        staging_spare: bool = False,
    ) -> None:
        from ftstate.transport import auth, checksum

        # the run's secret, handed over by Ray (security.authenticate; ftstate.transport.auth)
        if secret is not None:
            auth.install(run, secret)
        checksum.use_integrity(integrity)
        self.member = member
        self.role = role
        self.run = run
        self._held_proof = held_proof
        self._staging_spare = staging_spare
        self._held_mismatch = False  # the last proven load did not hash to what was received
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self._init_error: WorkerInitError | None = None
        try:
            self.user = user_cls(*args, **dict(kwargs))
        except Exception as exc:  # noqa: BLE001 - the user's constructor: reported, not fatal to the process
            self.user = None
            self._init_error = _init_error(member, role, user_cls, exc)
        self.progress = 0
        self.busy = False
        self.weights_version = 0
        self.checksum: str | None = None
        self.group_version = 0
        self._comm: Any = None
        self._sender: Any = None
        self._receiver: Any = None
        self._staged: Any = None
        # The committed version's tensors as the transport holds them: the source of resyncs and
        # reverse recovery. None while the engine holds the only copy (``_engine_holds``).
        self._loaded: Any = None
        # True once ``held_weights()`` gave the committed version back from the user's engine:
        # the engine's weights are then this rollout's copy, and the transport keeps none (no
        # second full copy beside the engine's; sends read ``held_weights()`` instead).
        self._engine_holds = False
        # the checksum the committed version was received with (what a fresh proof must find)
        self._received: str | None = None
        self._corrupt_next = False
        self._signal_at_progress: tuple[int, int] | None = None
        self._user_lock: asyncio.Lock | None = None
        # several trainer ranks: this rank's prepared part, one Sender per peer / Receiver per sender rank
        self._shard_part: Any = None
        self._shard_senders: dict[int, Any] = {}
        self._shard_receivers: dict[int, Any] = {}
        self._trainer_comm: Any = None
        # trainer ranks: user calls since the last commit (see calls_since_commit)
        self._calls_started = 0
        self._calls_done = 0
        if self._init_error is None:
            try:  # an activity() of the wrong shape is the class's: said at its start, not at a heartbeat
                self._user_activity()
            except Exception as exc:  # noqa: BLE001 - reported as the constructor's would be
                self._init_error = _init_error(member, role, user_cls, exc)

    # -- identity and liveness ----------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """Who and where: pid, the node's address, and Ray's node id (several nodes may share
        one address, e.g. a test cluster on one machine: only the id tells them apart).
        Raises the :class:`~ftstate.core.errors.WorkerInitError` of a constructor that raised."""
        if self._init_error is not None:
            raise self._init_error
        node, node_id = _where()
        # holds_weights: a rollout whose engine gives its weights back (held_weights()): it keeps
        # no copy of its own, which the sync's plan reads (a lone one stages privately)
        return {"pid": os.getpid(), "node": node, "node_id": node_id, "member": self.member, "role": self.role,
                "holds_weights": self.role == "rollout" and self._has_held_hook()}

    async def heartbeat(self, prove: bool = False, forged: bool = False) -> dict[str, Any]:
        """Progress, busy, and the weights version and checksum held committed. ``prove`` (the
        watchdog asks a SUSPECT rollout): the checksum is hashed afresh from the bytes it holds
        (:meth:`_held_checksum`, ~10 ms per 256 MiB here), not the one cached at its commit; a
        rollout whose user code is busy (the ``held_weights()`` hook would wait for it) reports
        no checksum, which does not prove it (it goes STALE and is resynced). A trainer reports
        its last sent checksum: its weights move on with every step by design."""
        checksum = self.checksum
        if prove and self.role == "rollout":
            checksum = None
            if self._holds_committed and not (self._has_held_hook() and self._lock().locked()):
                checksum, _ = await self._held_checksum(self._loaded.tensors if self._loaded is not None else None)
                # a rollout that fails this proof goes STALE: its next load is proven too (_proves)
                self._held_mismatch = self._held_mismatch or checksum != self._received
        from ftstate.transport import auth

        busy, progress = self.busy, self.progress
        user = self._user_activity()
        if user is not None:  # the user's own work (a generation) moving, or not
            busy, progress = busy or user[0], progress + user[1]
        return {
            "progress": progress,
            "busy": busy,
            "weights_version": self.weights_version,
            "checksum": checksum,
            "pid": os.getpid(),
            # ``forged`` (the watchdog asks): the messages this member dropped as forged since it
            # last asked, handed over once, for the audit trail; left out when there are none (an
            # answer of plain values is not tracked by the controller's collector)
            **({"forged": dropped} if forged and (dropped := auth.drain_forged()) else {}),
        }

    def _user_activity(self) -> tuple[bool, int] | None:
        """The user worker's :meth:`~ftstate.core.worker.Worker.activity`, checked: anything but
        None or ``(bool, int)`` is a :class:`~ftstate.core.errors.FTError` naming the method."""
        activity = getattr(self.user, "activity", None)
        if activity is None or self._init_error is not None:
            return None
        value = activity()
        if value is None:
            return None
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool)
                and isinstance(value[1], int) and not isinstance(value[1], bool)):
            raise FTError(f"{self.member}: {type(self.user).__name__}.activity() returned {bounded(repr(value), 200)}; "
                          f"expected None or (busy: bool, progress: int)")
        return value

    async def vigil(self) -> None:
        """Never returns while this process lives: the controller keeps this call pending so
        that a death surfaces as Ray's ``ActorDiedError`` at once, idle or not
        (:mod:`ftstate.controller.vigil`)."""
        await asyncio.Event().wait()

    def _lock(self) -> asyncio.Lock:
        if self._user_lock is None:
            self._user_lock = asyncio.Lock()
        return self._user_lock

    def _tick(self) -> None:
        # Called from the event loop and from transfer threads (per bucket).
        self.progress += 1
        if self._signal_at_progress is not None and self.progress >= self._signal_at_progress[0]:
            sig = self._signal_at_progress[1]
            self._signal_at_progress = None
            os.kill(os.getpid(), sig)

    # -- the group --------------------------------------------------------------------

    async def join(
        self, store_host: str, store_port: int, group: str, version: int, rank: int, world_size: int, timeout_s: float
    ) -> dict[str, Any]:
        """Form group version ``version`` as ``rank`` of ``world_size``. ``timeout_s`` bounds the
        transport's own wait (the controller's state deadline bounds the whole rendezvous)."""
        from ftstate.transport import create_communicator

        self.leave()
        self._comm = await asyncio.to_thread(
            create_communicator,
            self.backend,
            store_addr=(store_host, store_port),
            group=group,
            version=version,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            # This member's own node: its gloo device binds and announces the address Ray
            # reports for the node it runs on (loopback on the embedded default), never 0.0.0.0.
            device_host=_device_host(store_host),
        )
        self.group_version = version
        from ftstate.transport.shm import sweep_orphans

        sweep_orphans()  # segments a SIGKILLed sender of an older version left named on this host
        self._tick()
        return {"group_version": version, "rank": rank}

    async def abandon_transfer(self, reason: str) -> None:
        """Give up the transfer in flight on this group version (the controller learned that
        another participant failed): its waits end at once with CommunicatorAborted (gloo:
        its connections closed, a millisecond's wait here), and the version is not used again
        (the controller forms the next). Runs beside the transfer: the actor serves calls
        concurrently."""
        if self._comm is not None:
            self._comm.abandon(reason)

    def leave(self) -> None:
        if "ftstate.transport.samehost" in sys.modules:  # it ever took part in a same-host transfer
            from ftstate.transport import samehost

            if self._sender is not None:
                samehost.drop_slots(self._sender)  # the next version makes its own
            samehost.drop_mappings()  # and a reader maps the next version's
        if self._comm is not None:
            try:
                self._comm.abort("left the group version")
            finally:
                self._comm = None

    # -- weights ------------------------------------------------------------------------

    async def send_weights(
        self, weights_version: int, timeout_s: float, same_host: list[int] | None = None, require_shm: bool = False,
        relays: list[tuple[int, list[int]]] | None = None, node_copy_owner: int | None = None,
        node_copy_spare: bool = False,
    ) -> dict[str, Any]:
        """Trainer: broadcast the user's ``state_dict()`` to the group as ``weights_version``.
        ``timeout_s`` bounds the transfer (the controller passes what is left of sync_timeout_s).
        ``same_host``: the plan's ranks on this node, which read shared memory
        (:mod:`ftstate.transport.samehost`; ``require_shm``: fail rather than fall back);
        ``relays``: ``(relay rank, its node peers' ranks)`` of the plan's other nodes.
        ``node_copy_owner`` (``staging: node``): the pid of this node's agent, which owns the node
        copy the same-host ranks verify in place (:mod:`ftstate.transport.nodecopy`); the result's
        ``node_copy`` names it once committed; ``node_copy_spare``: the previous one is kept
        (``node_spare``) and rewritten as the next.
        A ``state_dict()`` the transport cannot send (not a mapping, empty, a value that is not
        a dense tensor on the backend's device…) raises
        :class:`~ftstate.core.errors.StateDictError` naming this member and the tensor, before
        anything is sent."""
        from ftstate.transport import Sender
        from ftstate.transport.validate import check_state_dict

        comm = self._require_comm()
        if self._sender is None:
            self._sender = Sender(bucket_size=self.bucket_bytes)
        async with self._lock():
            # If this raises, the controller has the waiting rollouts abandon the transfer.
            state = check_state_dict(
                await self._run(self.user.state_dict),
                device_type=comm.device.type, member=self.member, backend=self.backend,
            )
            self.busy = True
            try:
                if same_host or relays:
                    from ftstate.transport import samehost

                    report = await asyncio.to_thread(
                        samehost.broadcast, self._sender, comm, state, same_host=same_host or [],
                        relays={r: list(p) for r, p in relays or ()}, require_shm=require_shm,
                        weights_version=weights_version, timeout_s=timeout_s, progress=self._on_bucket,
                        node_copy_owner=node_copy_owner, node_copy_spare=node_copy_spare,
                    )
                else:
                    report = await asyncio.to_thread(
                        self._sender.broadcast, comm, state, weights_version=weights_version,
                        timeout_s=timeout_s, progress=self._on_bucket,
                    )
            finally:
                self.busy = False
        if report.ok:
            self.weights_version = weights_version
            self.checksum = report.state_checksum
        self._tick()
        return {"checksum": report.state_checksum, "nbytes": report.nbytes,
                "rejected": {int(k): v for k, v in report.rejected.items()},
                "routes": {int(k): v for k, v in report.routes.items()}, "shm_fallback": report.shm_fallback,
                "node_copy": report.node_copy, "node_spare": report.node_spare,
                **_node_copy_size(report.node_copy, recycled=report.node_copy_recycled)}

    async def receive_weights(
        self, weights_version: int, src: int, timeout_s: float, planned: bool = False,
        node_copy_owner: int | None = None,
    ) -> dict[str, Any]:
        """Rollout: receive and verify the broadcast of ``weights_version`` from rank ``src``.
        It is staged: the user's ``load_weights`` is not called until :meth:`commit_weights`.
        ``planned``: the sender uses the same-host route (its offer says how this member reads:
        from the sender's shared memory, over the collective, or from its node's relay, or as the relay).
        ``node_copy_owner`` (``staging: node``, this member its node's relay): the pid of its
        node's agent, owner of the node copy it receives into for its peers; the result's
        ``node_copy`` names the node copy its staged state is in (its own or one it read)."""
        from ftstate.core.errors import ManifestError

        self._staged = None
        if planned:
            staged = await self._receive("samehost", src, timeout_s=timeout_s, node_copy_owner=node_copy_owner)
        else:
            staged = await self._receive("receive_broadcast", root=src, timeout_s=timeout_s)
        if staged.weights_version != weights_version:
            raise ManifestError(
                f"{self.member}: field 'weights_version': expected {weights_version}, the sender sent "
                f"{staged.weights_version}",
                field="weights_version",
            )
        self._staged = staged
        self._tick()
        # staging_bytes: the most transport memory this rollout held during the transfer (the
        # new version's staging plus the committed copy it kept meanwhile), for the records;
        # node_copy: the node copy its staged state is in (staging: node), else None
        return {"checksum": staged.state_checksum, "nbytes": staged.nbytes, "weights_version": staged.weights_version,
                "staging_bytes": self._receiver.peak_bytes, "node_copy": staged._node,
                **_node_copy_size(staged._node, recycled=False)}  # a relay never recycles its node's copy

    # -- several trainer ranks (trainer_workers > 1: ftstate.transport.shards) ---------------

    async def prepare_shards(self, trainer_rank: int) -> dict[str, Any]:
        """Trainer rank: call the user's ``state_dict()`` (every rank is called together: it may
        be collective) and keep this rank's part for :meth:`send_shards`; returns the pieces
        (names, dtypes, shapes, slices) for the controller's ownership check."""
        from ftstate.transport.shards import split_state

        comm = self._require_comm()
        async with self._lock():
            part, pieces = split_state(await self._run(self.user.state_dict), rank=trainer_rank, member=self.member,
                                       device_type=comm.device.type, backend=self.backend)
        self._shard_part = part
        self._tick()
        return {"pieces": [p.record() for p in pieces],
                "nbytes": sum(t.numel() * t.element_size() for t in part.values())}

    async def send_shards(self, weights_version: int, peers: list[int], timeout_s: float) -> dict[str, Any]:
        """Trainer rank: send the part :meth:`prepare_shards` kept to every rank in ``peers`` at once."""
        from ftstate.transport.shards import send_part

        comm = self._require_comm()
        part, self._shard_part = self._shard_part, None
        if part is None:
            raise FTError(f"{self.member}: asked to send its part of weights version {weights_version} "
                          "but prepared none")
        self.busy = True
        try:
            report = await asyncio.to_thread(send_part, self._shard_senders, comm, peers, part,
                                             weights_version=weights_version, timeout_s=timeout_s,
                                             bucket_size=self.bucket_bytes, progress=self._on_bucket)
        finally:
            self.busy = False
        self._tick()
        return report

    async def receive_shards(self, weights_version: int, ownership: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Rollout: receive every owning trainer rank's part at once, assemble the full state and
        stage it (committed by :meth:`commit_weights`, like a broadcast)."""
        from ftstate.core.errors import ManifestError
        from ftstate.core.ownership import Ownership
        from ftstate.transport.shards import receive_parts

        comm = self._require_comm()
        self._staged = None
        self.busy = True
        try:
            staged = await asyncio.to_thread(receive_parts, self._shard_receivers, comm,
                                             Ownership.from_record(ownership), timeout_s=timeout_s,
                                             progress=self._on_bucket)
        finally:
            self.busy = False
        if staged.weights_version != weights_version:
            raise ManifestError(f"{self.member}: field 'weights_version': expected {weights_version}, the trainer "
                                f"ranks sent {staged.weights_version}", field="weights_version")
        self._staged = staged
        self._tick()
        return {"checksum": staged.state_checksum, "nbytes": staged.nbytes, "weights_version": weights_version}

    async def note_weights(self, weights_version: int, checksum: str) -> None:
        """Trainer rank: the version its part went into was committed with the full state's
        ``checksum`` (what its heartbeat then reports, like a single trainer's after a send).
        The calls counted since the previous commit are in it now."""
        self.weights_version = weights_version
        self.checksum = checksum
        self._calls_started = self._calls_done = 0

    async def calls_since_commit(self) -> dict[str, int]:
        """Trainer rank: user calls started, and completed without raising, since its part went
        into the last committed version (or was restored to it). The controller compares them
        with the calls it logged as completed on every rank: a rank that started more (a call
        cut short by a peer's death, or one that completed here only) holds a state that no
        replay from the log reproduces, so it is restored too."""
        return {"started": self._calls_started, "done": self._calls_done}

    async def send_part_to(self, peer: int, ownership: dict[str, Any], trainer_rank: int,
                           timeout_s: float) -> dict[str, Any]:
        """Rollout: send what trainer rank ``trainer_rank`` owned of the committed version this
        rollout holds (its part only, sliced out of the full tensors) to ``peer``, point to point."""
        from ftstate.core.ownership import Ownership
        from ftstate.transport import Sender
        from ftstate.transport.shards import part_of

        comm = self._require_comm()
        state, version = await self._committed_state()
        tensors = state.tensors if state is self._loaded else state
        part = part_of(Ownership.from_record(ownership), tensors, trainer_rank)
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
        return {"checksum": report.state_checksum, "nbytes": report.nbytes}

    async def receive_part_from(self, src: int, weights_version: int, ownership: dict[str, Any], trainer_rank: int,
                                checksum: str | None, timeout_s: float) -> dict[str, Any]:
        """Trainer rank: receive this rank's part of committed version ``weights_version`` from
        rollout rank ``src``, prove it is the part this rank sent then (``checksum``: what it
        sent; None: it owned nothing) and hand it to ``load_state_dict`` in the form
        ``state_dict()`` returned it. The calls since the commit start over from here."""
        from ftstate.core.ownership import Ownership
        from ftstate.transport.shards import part_form

        owned = Ownership.from_record(ownership)
        if checksum is None:
            part: dict[str, Any] = {}
        else:
            staged = await self._receive_proven(src, weights_version, checksum, timeout_s=timeout_s,
                                                what=f"trainer rank {trainer_rank}'s part")
            part = self._hand_over(staged)
        async with self._lock():
            await self._run(self.user.load_state_dict, part_form(owned, part, trainer_rank))
            self._calls_started = self._calls_done = 0
            self.weights_version = weights_version
        self._tick()
        return {"received": checksum, "tensors": len(part)}

    async def part_checksum(self, trainer_rank: int) -> dict[str, Any]:
        """Trainer rank: the checksum of what this rank's ``state_dict()`` owns now (every rank
        is called together: it may be collective); the proof that a restored rank holds its
        part of the committed version. ``pieces``: how many it owns (0: nothing)."""
        from ftstate.transport import state_checksum
        from ftstate.transport.shards import split_state

        async with self._lock():
            part, pieces = split_state(await self._run(self.user.state_dict), rank=trainer_rank,
                                       member=self.member, device_type=None, backend=self.backend)
        return {"checksum": await asyncio.to_thread(state_checksum, part) if pieces else None,
                "pieces": len(pieces)}

    async def discard_shards(self) -> None:
        """Trainer rank: drop a prepared part (the sync was refused or abandoned)."""
        self._shard_part = None

    async def setup_trainer_group(self, store_host: str, store_port: int, group: str, version: int, rank: int,
                                  world_size: int, timeout_s: float) -> dict[str, Any]:
        """Trainer rank: form the trainer ranks' own group version (gloo here) and hand it to the
        user's ``setup(group, rank, world_size)``; ``RANK``, ``WORLD_SIZE`` and
        ``FTSTATE_TRAINER_GROUP_VERSION`` are set in this process for libraries that read them."""
        from ftstate.transport import create_communicator

        if self._trainer_comm is not None:
            self._trainer_comm.abort("the trainer group formed a new version")
        self._trainer_comm = await asyncio.to_thread(
            create_communicator, self.backend, store_addr=(store_host, store_port), group=group, version=version,
            rank=rank, world_size=world_size, timeout_s=timeout_s, device_host=_device_host(store_host))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), FTSTATE_TRAINER_GROUP_VERSION=str(version))
        pg = getattr(self._trainer_comm, "process_group", None)
        if pg is None:
            from ftstate.core.errors import BackendUnavailable

            raise BackendUnavailable(f"{self.member}: the {self.backend} backend hands no process group to "
                                     "setup(); trainer_workers > 1 runs on gloo")
        async with self._lock():
            await self._run(self.user.setup, pg, rank, world_size)
        self._tick()
        return {"group_version": version, "rank": rank}

    async def commit_weights(self, weights_version: int) -> dict[str, Any]:
        """Rollout: hand the staged version to ``load_weights``; the user lock pauses calls meanwhile."""
        staged = self._staged
        if staged is None or staged.weights_version != weights_version:
            have = "nothing" if staged is None else f"version {staged.weights_version}"
            raise FTError(f"{self.member}: asked to commit weights version {weights_version} but staged {have}")
        async with self._lock():
            device_bytes = await self._load_weights(staged.tensors, weights_version)
            if self._proves(weights_version):
                held, from_engine = await self._held_checksum(staged.tensors)
                self._held_mismatch = held != staged.state_checksum
            else:
                # verified bucket by bucket on receipt; an engine that held its weights still does
                held, from_engine = staged.state_checksum, self._engine_holds
            self.weights_version = weights_version
            self.checksum = held
            self._adopt(staged, from_engine)
            self._staged = None
        self._tick()
        # The controller compares ``checksum`` (what this member holds) with the sender's.
        # device_bytes: the device buckets a load by parts used (weights_device()), else absent
        return {"checksum": held, "received": staged.state_checksum, "weights_version": weights_version,
                "held_bytes": self._held_bytes(), **({"device_bytes": device_bytes} if device_bytes is not None else {})}

    async def _load_weights(self, tensors: Mapping[str, Any], weights_version: int) -> int | None:
        """Hand a verified version to the user: whole to ``load_weights``, or, for an engine on
        a device (``weights_device()`` and ``load_weights_part``), part by part through two device
        buckets (:func:`ftstate.transport.devicebuckets.load_by_buckets`); returns the device
        bytes that took (None: a whole load)."""
        device = await self._run(self.user.weights_device) if _overrides(self.user, "load_weights_part") else None
        if device is None:
            await self._run(self.user.load_weights, dict(tensors), weights_version)
            return None
        import torch

        from ftstate.transport import devicebuckets

        def part(state: dict[str, Any], first: bool, last: bool) -> None:
            self.user.load_weights_part(state, weights_version, first=first, last=last)

        def load_weights_part() -> dict[str, Any]:  # named so a user error names the hook
            return devicebuckets.load_by_buckets(tensors, device=torch.device(device), bucket_bytes=self.bucket_bytes,
                                                 load=part)

        return int((await self._run(load_weights_part))["device_bytes"])

    async def adopt_node_copy(self, name: str, owner: int, group: str, weights_version: int,
                              checksum: str) -> dict[str, Any]:
        """Rollout newcomer: take the committed version from its node's copy ``name`` (owned by
        pid ``owner``; :func:`ftstate.transport.nodecopy.adopt`: hashed in place, committed only
        if it is ``weights_version`` with ``checksum``), then ``load_weights`` it. No transfer:
        the result's ``route`` says so for the controller's records. Loaded as a sync's staged
        version is (:meth:`commit_weights`): it is one, verified against the committed checksum."""
        from ftstate.transport import nodecopy

        return await self._load_node_copy("node_copy", nodecopy.adopt, name, group=group, owner=owner,
                                          weights_version=weights_version, checksum=checksum)

    async def fetch_node_copy(self, served: dict[str, Any], name: str, owner: int, group: str,
                              weights_version: int, checksum: str, timeout_s: float) -> dict[str, Any]:
        """Rollout newcomer on a node without the committed node copy: receive another node's
        copy ``name`` point to point from the agent serving it (``served``;
        :func:`ftstate.transport.nodecopy.fetch`, proven by ``checksum``), then load it as
        :meth:`adopt_node_copy` does."""
        from ftstate.transport import nodecopy

        return await self._load_node_copy("node_copy_p2p", nodecopy.fetch, served, name=name, group=group,
                                          owner=owner, weights_version=weights_version, checksum=checksum,
                                          timeout_s=timeout_s)

    async def _load_node_copy(self, route: str, take: Any, *args: Any, weights_version: int,
                              **kwargs: Any) -> dict[str, Any]:
        """``take`` (a node copy's :func:`~ftstate.transport.nodecopy.adopt` or ``fetch``) the
        committed version into this rollout's receiver, in a thread, then load it as a sync's
        staged version is (:meth:`commit_weights`): it is one, proven by the committed checksum."""
        from ftstate.transport import Receiver

        if self._receiver is None:
            self._receiver = Receiver()
        self._staged = None
        self.busy = True
        try:
            staged = await asyncio.to_thread(take, self._receiver, *args, weights_version=weights_version, **kwargs)
        finally:
            self.busy = False
        self._staged = staged
        return {**await self.commit_weights(weights_version), "nbytes": staged.nbytes, "route": route}

    async def discard_weights(self) -> None:
        """Drop a staged version; what the user holds (the previous version) stays current."""
        self._staged = None

    async def prewarm(self) -> dict[str, Any]:
        """A spare's warm-up: import the transport (torch, the backend) now, not on promotion."""
        import ftstate.transport.samehost  # noqa: F401 - the import is the warm-up (sync, torch, zmq)

        return await self.info()

    async def reserve_staging(self, nbytes: int) -> None:
        """A spare: have its receiver's staging buffer for the next transfer allocated and
        touched now (:meth:`ftstate.transport.Receiver.reserve`), sized for the current weights
        version (``nbytes`` and slack for the manifest's alignment). Host memory only (gloo):
        a GPU allocation has no page faults to pay in advance."""
        if self.backend != "gloo":
            return
        import torch

        from ftstate.transport import Receiver

        if self._receiver is None:
            self._receiver = Receiver()
        await asyncio.to_thread(self._receiver.reserve, nbytes + nbytes // 64 + (1 << 20), torch.device("cpu"))

    async def send_weights_to(
        self, peer: int, timeout_s: float, same_host: bool = False, require_shm: bool = False
    ) -> dict[str, Any]:
        """Point to point: send the committed version this rollout holds to ``peer`` only
        (recovery of a newcomer, or reverse recovery of a new trainer); through shared memory
        when the plan puts ``peer`` on this node (``same_host``)."""
        from ftstate.transport import Sender

        comm = self._require_comm()
        t0 = time.perf_counter()
        state, version = await self._committed_state()
        t_state = time.perf_counter()
        if self._sender is None:
            self._sender = Sender(bucket_size=self.bucket_bytes)
        self.busy = True
        try:
            if same_host:
                from ftstate.transport import samehost

                report = await asyncio.to_thread(
                    samehost.send_to, self._sender, comm, peer, state, require_shm=require_shm,
                    weights_version=version, timeout_s=timeout_s, progress=self._on_bucket,
                )
            else:
                report = await asyncio.to_thread(
                    self._sender.send_to, comm, peer, state, weights_version=version, timeout_s=timeout_s,
                    progress=self._on_bucket,
                )
        finally:
            self.busy = False
        if not report.ok:
            from ftstate.core.errors import ChecksumMismatch

            raise ChecksumMismatch(f"{self.member}: rank {peer} rejected weights version "
                                   f"{version}: {dict(report.rejected)}")
        # ``stages``: where the sender's time went (the failover record's stage timings).
        return {"checksum": report.state_checksum, "nbytes": report.nbytes, "weights_version": version,
                "stages": {"state": round(t_state - t0, 6), "send": round(time.perf_counter() - t_state, 6)}}

    async def receive_weights_from(
        self, src: int, weights_version: int, checksum: str, timeout_s: float, same_host: bool = False
    ) -> dict[str, Any]:
        """Point to point: receive the current version from ``src``, prove it is that version
        (``checksum``), and adopt it: a rollout through ``load_weights``, a trainer through
        ``load_state_dict``."""
        t0 = time.perf_counter()
        staged = await self._receive_proven(src, weights_version, checksum, timeout_s=timeout_s, same_host=same_host)
        t_received = time.perf_counter()
        device_bytes = None
        async with self._lock():
            t_locked = time.perf_counter()
            if self.role == "trainer":
                await self._run(self.user.load_state_dict, self._hand_over(staged))
                t_loaded = time.perf_counter()
                held = await self._trainer_checksum()
            else:
                device_bytes = await self._load_weights(staged.tensors, weights_version)
                t_loaded = time.perf_counter()
                held, from_engine = await self._held_checksum(staged.tensors)
            t_proven = time.perf_counter()
            self.weights_version = weights_version
            self.checksum = held
            if self.role == "rollout":
                self._adopt(staged, from_engine)
        self._tick()
        # ``checksum``: what this member holds after loading, for the controller to compare.
        # ``stages``: where the newcomer's time went: the transfer into staging (verified), the
        # wait for the user lock, the user's load, the proof of what it holds then.
        # ``device_bytes``: the device buckets a load by parts used, as at a commit, else absent.
        stages = {"receive": t_received - t0, "lock": t_locked - t_received, "load": t_loaded - t_locked,
                  "prove": t_proven - t_loaded}
        return {"checksum": held, "received": staged.state_checksum, "nbytes": staged.nbytes,
                "weights_version": weights_version, "stages": {k: round(v, 6) for k, v in stages.items()},
                **({"device_bytes": device_bytes} if device_bytes is not None else {})}

    async def _receive_proven(self, src: int, weights_version: int, checksum: str, *, timeout_s: float,
                              same_host: bool = False, what: str = "weights") -> Any:
        """Point to point from ``src`` (through shared memory when ``same_host``), then proof
        that it is ``what`` of ``weights_version``: its checksum must be ``checksum``."""
        from ftstate.core.errors import ChecksumMismatch

        if same_host:
            staged = await self._receive("samehost", src, point_to_point=True, timeout_s=timeout_s)
        else:
            staged = await self._receive("receive_from", src, timeout_s=timeout_s)
        if staged.weights_version != weights_version or staged.state_checksum != checksum:
            raise ChecksumMismatch(
                f"{self.member}: received {what} of weights version {staged.weights_version} "
                f"({staged.state_checksum}) from rank {src}, expected {what} of version {weights_version} ({checksum})")
        return staged

    async def trainer_checksum(self) -> str:
        """Trainer: the checksum of what its ``state_dict()`` returns now (the proof that a
        trainer loaded from a checkpoint holds the version it claims)."""
        async with self._lock():
            return await self._trainer_checksum()

    async def _trainer_checksum(self) -> str:
        from ftstate.transport import state_checksum
        from ftstate.transport.validate import check_state_dict

        state = check_state_dict(await self._run(self.user.state_dict), device_type=None, member=self.member,
                                 backend=self.backend)
        return await asyncio.to_thread(state_checksum, state)

    def _proves(self, weights_version: int) -> bool:
        """Whether the commit of ``weights_version`` hashes what this rollout holds
        (``held_weights_proof``): always with ``every_sync``, and for a rollout without a
        ``held_weights()`` hook (hashing the tensors it was given is cheap); with ``admission``,
        a hook's first load in this process and the first after a proof that failed, else a
        draw of ``held_weights_proof_fraction`` fixed by the run, member and version. (A
        resync and a re-admission always prove: :meth:`receive_weights_from`, :meth:`heartbeat`.)"""
        mode, fraction = self._held_proof
        if mode == "every_sync" or not self._has_held_hook() or not self._holds_committed or self._held_mismatch:
            return True
        import random

        return random.Random(f"{self.run}/{self.member}/{weights_version}").random() < fraction

    def _has_held_hook(self) -> bool:
        return _overrides(self.user, "held_weights")

    async def _held_checksum(self, given: Mapping[str, Any] | None) -> tuple[str, bool]:
        """The whole-state checksum of the bytes this rollout serves from, hashed now, and
        whether they came from its engine: what its ``held_weights()`` returns when the user's
        engine keeps its own copy, else the tensors handed to ``load_weights`` (``given``; a
        ``load_weights`` that wrote into them shows here). Called with the user lock held or
        with no user call running."""
        from ftstate.transport import state_checksum

        returned = await self._engine_weights()
        held = returned if returned is not None else given
        if held is None:
            raise FTError(f"{self.member}: {type(self.user).__name__}.held_weights() returned None, but the "
                          "transport kept no copy of the weights it loaded (the engine held them before)")
        return await asyncio.to_thread(state_checksum, held), returned is not None

    async def _engine_weights(self) -> Mapping[str, Any] | None:
        """What the user's ``held_weights()`` returns, checked like a state dict; None without
        the hook or when it returns None."""
        from ftstate.transport.validate import check_state_dict

        if not self._has_held_hook():
            return None
        returned = await self._run(self.user.held_weights)
        if returned is None:
            return None
        return check_state_dict(returned, device_type=None, member=self.member, backend=self.backend,
                                what="held_weights()")

    def _hand_over(self, staged: Any) -> dict[str, Any]:
        """A trainer's weights received back: its ``state_dict()`` is the copy that counts, so
        the receiver lets go of the buffer they landed in (it would stage the next transfer
        there) and the tensors are the trainer's own, not cloned. A clone here was 512 MiB of
        fresh memory per 512 MiB trainer failover: 0.7-1.0 s of page faults and copying on the
        2-core machine, the largest stage of a trainer's failover (issue 28's stage timings)."""
        if self._receiver is not None:
            self._receiver.release()
        return dict(staged.tensors)

    def _adopt(self, staged: Any, from_engine: bool) -> None:
        """Make ``staged`` the committed version. When the engine gave it back (``from_engine``)
        the engine's weights are the copy: the transport lets go of its own (the receiver's
        buffers, ``_loaded``), so a rollout holds the weights once, not three times; with
        ``staging_spare`` it keeps the buffer, as the next sync's staging (twice, not three times)."""
        self._engine_holds = from_engine
        self._received = staged.state_checksum
        if from_engine:
            self._loaded = None
            if self._receiver is not None:
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
        the user lock, so no load or generation call changes it while it is read)."""
        if self._loaded is not None:
            return self._loaded, self._loaded.weights_version
        if self._engine_holds:
            async with self._lock():
                state = await self._engine_weights()
            if state is None:
                raise FTError(f"{self.member}: {type(self.user).__name__}.held_weights() returned None; it held "
                              f"weights version {self.weights_version} and the transport kept no copy")
            return state, self.weights_version
        raise FTError(f"{self.member}: holds no committed weights to send")

    async def bench_raw_broadcast(self, nbytes: int, root: int, timeout_s: float, to: int | None = None) -> float:
        """Benchmarks only: a bare broadcast of ``nbytes`` on the current group version (every
        member must call it), the baseline ftstate's transfers are compared with. Seconds.
        ``to``: a bare point-to-point send from ``root`` to that rank instead (a failover's
        baseline: the same bytes to the same newcomer); the other ranks return 0 at once."""
        import time

        import torch

        from ftstate.transport.samehost import NET_CHUNK

        comm = self._require_comm()

        def run() -> float:
            # made here, not on the event loop: 512 MiB filled there kept heartbeats from being
            # answered for longer than heartbeat_interval_s (the benchmark's own members went SUSPECT)
            if to is not None and comm.rank not in (root, to):
                return 0.0
            buf = torch.empty(nbytes, dtype=torch.uint8)
            # every rank touches its buffer before the clock starts, as ftstate's staging is
            # (reserved and touched ahead): a fresh buffer would charge the baseline page faults
            buf.fill_(7 if comm.rank == root else 0)
            # both sides start the clock together: Ray delivers the calls tens of ms apart, which
            # a clock started on arrival would add to the baseline
            if to is None:
                comm.barrier(timeout_s=timeout_s)
            else:
                hello = torch.zeros(1, dtype=torch.uint8)  # root -> to, then back (a send waits for its recv)
                for sender in (root, to):
                    if comm.rank == sender:
                        comm.send(hello, root + to - sender, tag=0x7EA0, timeout_s=timeout_s).wait()
                    else:
                        comm.recv(hello, sender, tag=0x7EA0, timeout_s=timeout_s).wait()
            t0 = time.perf_counter()
            if to is None:
                comm.broadcast(buf, root, timeout_s=timeout_s).wait()
            else:
                # in NET_CHUNK messages all posted at once, as ftstate's point-to-point route sends,
                # so the two differ only in what ftstate adds (manifest, hashing, vote, load, proof)
                op = comm.send if comm.rank == root else comm.recv
                peer = to if comm.rank == root else root
                pending = [op(buf[i : i + NET_CHUNK], peer, tag=0x7EB0 + k, timeout_s=timeout_s)
                           for k, i in enumerate(range(0, nbytes, NET_CHUNK))]
                for p in pending:
                    p.wait()
            return time.perf_counter() - t0

        return await asyncio.to_thread(run)

    async def chaos_hang(self) -> None:
        """Stop this process (SIGSTOP): alive, holding its sockets, making no progress."""
        os.kill(os.getpid(), signal.SIGSTOP)

    async def _receive(self, how: str, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """One transfer into this worker's Receiver (``receive_broadcast``, ``receive_from``, or
        ``samehost``: :func:`ftstate.transport.samehost.receive`), in a thread, marked busy for
        the watchdog, with a pending chaos corruption applied."""
        import functools

        from ftstate.transport import Receiver, samehost

        comm = self._require_comm()
        if self._receiver is None:
            self._receiver = Receiver()
        if self._corrupt_next:
            self._corrupt_next = False
            self._receiver.corrupt_next_bucket()
        self.busy = True
        try:
            fn = functools.partial(samehost.receive, self._receiver) if how == "samehost" else getattr(
                self._receiver, how)
            return await asyncio.to_thread(fn, comm, *args, timeout_s=timeout_s, progress=self._on_bucket, **kwargs)
        finally:
            self.busy = False

    def _on_bucket(self, done: int, total: int) -> None:
        self._tick()

    def _require_comm(self) -> Any:
        if self._comm is None:
            # The controller never transfers under a version it did not form (formation.py);
            # should it happen, a transport error: the attempt is abandoned and the next one
            # forms a new version, instead of an internal error ending the run.
            raise TransportError(f"{self.member}: not a member of any group version (its last join did not "
                                 f"complete); the next transfer forms a new one")
        return self._comm

    # -- user calls ---------------------------------------------------------------------

    async def call(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], logged: bool = False) -> Any:
        """A user method. ``logged``: a trainer call the controller keeps in its replay log
        (``rt.trainer(...)``, or its replay), counted by :meth:`calls_since_commit`."""
        if self._init_error is not None:
            raise self._init_error
        fn = getattr(self.user, method, None)
        if fn is None or method.startswith("_") or not callable(fn):
            raise FTError(f"{self.member}: {type(self.user).__name__} has no public method {method!r}")
        async with self._lock():
            self._calls_started += logged
            result = await self._run(fn, *args, **dict(kwargs))
            self._calls_done += logged
        self._tick()
        return result

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a user method; an exception it raises is marked with the method and the user's
        frames (:func:`mark_user_error`) for the controller's report."""
        if self._init_error is not None:
            raise self._init_error
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            return await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:
            mark_user_error(exc, f"{type(self.user).__name__}.{getattr(fn, '__name__', 'call')}()")
            raise

    # -- chaos (tests, benchmarks, demo) ---------------------------------------------------

    async def chaos_corrupt_next_bucket(self) -> None:
        self._corrupt_next = True

    async def chaos_kill(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    async def chaos_kill_after_progress(self, steps: int) -> None:
        """SIGKILL this process once ``steps`` more units of progress (buckets, calls) are made:
        a deterministic death in the middle of a transfer."""
        self._signal_at_progress = (self.progress + steps, signal.SIGKILL)

    async def chaos_hang_after_progress(self, steps: int) -> None:
        """SIGSTOP this process after ``steps`` more units of progress: hung mid-transfer."""
        self._signal_at_progress = (self.progress + steps, signal.SIGSTOP)


_FTSTATE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def user_frames(exc: BaseException) -> tuple[str, str]:
    """The user's part of ``exc``'s traceback: ``(where, frames)``. frames: the frames outside
    ftstate and the standard library, formatted as ``traceback`` does (bounded); where: the
    innermost of them that is the user's own file (outside ``site-packages`` too: a library
    the user called is not where they look first), ``file:line in function``."""
    outside = [f for f in traceback.extract_tb(exc.__traceback__)
               if not f.filename.startswith("<")
               and not os.path.abspath(f.filename).startswith((_FTSTATE_DIR, _STDLIB_DIR))]
    own = [f for f in outside if f"{os.sep}site-packages{os.sep}" not in f.filename] or outside
    where = f"{own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""
    return where, bounded(clean("".join(traceback.format_list(outside[-20:]))), 8000)


def _init_error(member: str, role: str, user_cls: Any, exc: BaseException) -> WorkerInitError:
    """The :class:`~ftstate.core.errors.WorkerInitError` of a user class that could not start."""
    where, frames = user_frames(exc)
    return WorkerInitError(member=member, role=role, cls=getattr(user_cls, "__name__", repr(user_cls)),
                           exc_type=type(exc).__name__, message=bounded(clean(str(exc))), where=where,
                           traceback=frames)


def mark_user_error(exc: BaseException, method: str) -> None:
    """Note on ``exc`` (as attributes, which travel with it through Ray's pickling) which user
    method raised it and where in the user's code; the first marking (the innermost call) wins."""
    if getattr(exc, "ftstate_method", None):
        return
    where, frames = user_frames(exc)
    try:
        exc.ftstate_method = method  # type: ignore[attr-defined]
        exc.ftstate_where = where  # type: ignore[attr-defined]
        exc.ftstate_frames = frames  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception class without a __dict__: reported without them
        pass


def _where() -> tuple[str, str | None]:
    """This process's node address and Ray node id (outside Ray: the host name, no id)."""
    try:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (unit use): the host name will do
        return socket.gethostname(), None


def _device_host(store_host: str) -> str:
    node, node_id = _where()
    return node if node_id is not None else store_host  # outside Ray: where the store is


def _node_copy_size(name: str | None, *, recycled: bool) -> dict[str, Any]:
    """For the records: the bytes of node copy ``name`` (read on its node: the controller may run
    on another) and whether it was the writer's spare rewritten."""
    if not name:
        return {}
    from ftstate.transport import nodecopy

    return {"node_copy_bytes": nodecopy.segment_bytes(name), "node_copy_recycled": recycled}


def _overrides(user: Any, hook: str) -> bool:
    """Whether the user's class defines ``hook`` itself rather than inheriting the base
    worker's default (which says "not provided"): the optional hooks (``held_weights``,
    ``load_weights_part``) change what the host does, so only a real override counts."""
    from ftstate.core import worker

    fn = getattr(type(user), hook, None)
    defaults = (getattr(worker.RolloutWorker, hook, None), getattr(worker.TrainerWorker, hook, None))
    return fn is not None and fn not in defaults
