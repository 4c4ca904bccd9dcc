"""WorkerHost: the Ray actor that hosts one user worker (in its own process), and its shell: identity,
heartbeats, the vigil and the user's calls. A raising user constructor is kept and reported on every call, not
fatal to the process; user methods run one at a time, plain ones in a thread so heartbeats are answered.
Holdings, transfers and rank parts are mixed in."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Mapping
from typing import Any

from ftstate.core.errors import EngineProcessDied, FTError, UserCodeError, WorkerInitError
from ftstate.core.liveness import Heartbeat
from ftstate.core.protocol import Beat, Info, Located, UserCall, Versioned, Vigil
from ftstate.core.text import bounded
from ftstate.worker.chaos import Chaos
from ftstate.worker.holdings import Holdings
from ftstate.worker.inflight import PendingSwap, SafePointGate
from ftstate.worker.place import where
from ftstate.worker.ranks import TrainerRank
from ftstate.worker.transfers import Transfers
from ftstate.worker.usercode import init_error, mark_user_error


class WorkerHost(Holdings, Transfers, TrainerRank, Chaos):
    """One worker process. ``bucket_bytes``: broadcast bucket size; ``run``/``secret``: the run's key for the
    transport's MACs (None: unauthenticated); ``held_proof``: ``(held_weights_proof, fraction)``;
    ``staging_spare``: keep the staging buffer when the engine holds the weights; ``in_flight``:
    ``rollout_updates: in_flight``."""

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
        in_flight: bool = False,
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
        self._in_flight = in_flight
        self._pending = PendingSwap()
        # a user worker that declared itself lost (declare_lost): what the vigil raises, and its wake-up
        self._lost_error: FTError | None = None
        self._lost_event: asyncio.Event | None = None
        self._vigil_loop: asyncio.AbstractEventLoop | None = None
        self._swap_tasks: set[asyncio.Task[None]] = set()
        try:
            self.user = user_cls(*args, **dict(kwargs))
        except Exception as exc:  # noqa: BLE001 - the user's constructor: reported, not fatal to the process
            self.user = None
            self._init_error = init_error(member, role, user_cls, exc)
        if self.user is not None and role == "rollout":
            self.user.__dict__["_ftstate_gate"] = SafePointGate(self)
        self.progress = 0
        self.busy = False
        self.weights_version = 0
        self.checksum: str | None = None
        self.group_version = 0
        self._comm: Any = None
        self._sender: Any = None
        self._receiver: Any = None
        self._staged: Any = None
        # The committed tensors as the transport holds them; None while the engine holds the only copy.
        self._loaded: Any = None
        # True once ``held_weights()`` gave the committed version back: the transport then keeps no copy.
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
                self._init_error = init_error(member, role, user_cls, exc)

    async def info(self, req: Info) -> Located:
        """Who and where: pid, node address and Ray node id (nodes may share an address). Raises the
        constructor's :class:`~ftstate.core.errors.WorkerInitError`, if it raised."""
        if self._init_error is not None:
            raise self._init_error
        node, node_id = where()
        # holds_weights: its engine gives its weights back, so it keeps no copy (the sync's plan reads it)
        return Located(pid=os.getpid(), node=node, node_id=node_id, member=self.member, role=self.role,
                       holds_weights=self.role == "rollout" and self._has_held_hook())

    async def heartbeat(self, req: Beat) -> Heartbeat:
        """Progress, busy, and the committed weights version and checksum. ``prove`` (asked of a SUSPECT
        rollout) hashes what it holds afresh; a rollout whose user code is busy reports no checksum, so it
        goes STALE. A trainer reports its last sent checksum, since its weights move every step."""
        checksum = self.checksum
        if req.prove and self.role == "rollout":
            checksum = None
            if self._holds_committed and not (self._has_held_hook() and self._lock().locked()):
                checksum, _ = await self._held_checksum(self._loaded.tensors if self._loaded is not None else None,
                                                        self._received)
                # a rollout that fails this proof goes STALE: its next load is proven too (_proves)
                self._held_mismatch = self._held_mismatch or checksum != self._received
        from ftstate.transport import auth

        busy, progress = self.busy, self.progress
        user = self._user_activity()
        if user is not None:  # the user's own work (a generation) moving, or not
            busy, progress = busy or user[0], progress + user[1]
        # ``forged`` (the watchdog asks): the messages dropped as forged since it last asked, once
        return Heartbeat(progress=progress, busy=busy, weights_version=self.weights_version, checksum=checksum,
                         pid=os.getpid(), forged=tuple(auth.drain_forged()) if req.forged else ())

    def _user_activity(self) -> tuple[bool, int] | None:
        """The user worker's ``activity()``, checked: anything but None or ``(bool, int)`` is an FTError."""
        activity = getattr(self.user, "activity", None)
        if activity is None or self._init_error is not None:
            return None
        value = activity()
        if value is None:
            return None
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool)
                and isinstance(value[1], int) and not isinstance(value[1], bool)):
            raise UserCodeError(self.member, f"{type(self.user).__name__}.activity()", f"returned "
                                f"{bounded(repr(value), 200)}; expected None or (busy: bool, progress: int)")
        return value

    async def vigil(self, req: Vigil) -> None:
        """Never returns while this process lives, so a death surfaces on this pending call at once. Raises
        the error of a worker that declared itself lost, which the controller takes as its death."""
        self._vigil_loop = asyncio.get_running_loop()
        if self._lost_event is None:
            self._lost_event = asyncio.Event()
        if self._lost_error is None:
            await self._lost_event.wait()
        assert self._lost_error is not None  # set before the event
        raise self._lost_error

    def declare_lost(self, error: FTError) -> None:
        """The user worker cannot go on (from any thread): every vigil raises ``error``."""
        if isinstance(error, EngineProcessDied) and not error.member:
            error = error.for_member(self.member)
        self._lost_error = error  # set before the loop is read: the vigil reads them the other way round
        loop = self._vigil_loop
        if loop is not None and self._lost_event is not None:
            loop.call_soon_threadsafe(self._lost_event.set)

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

    async def call(self, req: UserCall) -> Any:
        """A user method. ``logged``: a trainer call kept in the replay log; ``versions``: answer
        :class:`~ftstate.core.protocol.Versioned`. A version waiting for a safe point loads first."""
        method, args, kwargs, logged = req.name, req.args, req.kwargs, req.logged
        if self._init_error is not None:
            raise self._init_error
        fn = getattr(self.user, method, None)
        if fn is None or method.startswith("_") or not callable(fn):
            raise UserCodeError(self.member, type(self.user).__name__, f"has no public method {method!r}")
        async with self._lock():
            await self._swap_now()
            self._pending.call_versions = versions = [self.weights_version]
            self._calls_started += logged
            result = await self._run(fn, *args, **dict(kwargs))
            self._calls_done += logged
        self._tick()
        return Versioned(result, tuple(versions)) if req.versions else result

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a user method; its exception is marked with the method and user frames for the report."""
        if self._init_error is not None:
            raise self._init_error
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            return await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:
            mark_user_error(exc, f"{type(self.user).__name__}.{getattr(fn, '__name__', 'call')}()")
            raise
