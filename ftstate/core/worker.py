"""The classes a user subclasses: their code, running inside an ftstate-managed Ray actor.

A :class:`TrainerWorker` owns the authoritative weights and hands them out through
:meth:`~TrainerWorker.state_dict`; a :class:`RolloutWorker` receives them through
:meth:`~RolloutWorker.load_weights`, which ftstate calls only after the atomic commit: every
bucket received, every checksum matched, and every other rollout staged the same version.
Any other method is the user's own and is reached with ``rt.trainer("name", ...)`` or
``rt.rollout("name", ...)``.

User methods may be plain functions or coroutines. Plain ones run in a worker thread so the
actor keeps answering heartbeats while they compute; ftstate runs at most one user call of a
worker at a time (and never while weights are being read or loaded), so user code needs no
locking of its own.

This module imports neither Ray nor torch; the weights are whatever tensors the user returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class Worker:
    """Base of every ftstate worker. ``role`` names the side it plays."""

    role: ClassVar[str] = ""

    def activity(self) -> tuple[bool, int] | None:
        """What this worker's own work is doing, for the heartbeats: ``(busy, progress)``, busy
        while a call that must keep moving is under way (a generation), progress a counter it
        moves as that call moves (an engine step). A worker busy that way whose counter stands
        still for the watchdog's stall bound (half ``heartbeat_timeout_s``) is suspected like
        one stuck in a transfer: a generation wedged in a kernel that released the GIL, while
        the actor still answers, is then declared lost and replaced. None (the default): only
        ftstate's own work counts. Called on the actor's event loop while a user call runs in a
        thread: return at once (no lock, no device work)."""
        return None


class TrainerWorker(Worker):
    """The trainer: the source of the weights.

    A replaced trainer gets back the last committed weights version from a rollout
    (``reverse_weight_sync``) or from ``checkpoint_dir``; what no rollout holds is the
    optimizer state, so ftstate then calls :meth:`reset_optimizer` or
    :meth:`load_optimizer_checkpoint` as ``fault_tolerance.optimizer_state`` says.
    """

    role: ClassVar[str] = "trainer"
    #: True when ``state_dict()`` is a lossy view of the master weights (e.g. bf16 copies of
    #: fp32 masters): rebuilding the trainer from a rollout then loses precision, and ftstate
    #: refuses unless ``fault_tolerance.allow_lossy_recovery`` is on.
    lossy_state_dict: ClassVar[bool] = False
    #: With several trainer ranks: True when every trainer call touches only this rank's own
    #: state (no collective on the trainer group). A replaced rank then replays the calls since
    #: the last sync alone and the survivors keep their state. False (the default): calls may
    #: hold collectives, so after a loss with calls made since the last sync every rank gets
    #: its part of that sync back from a rollout and all replay the calls together.
    rank_local_calls: ClassVar[bool] = False

    def setup(self, group: Any, rank: int, world_size: int) -> None:
        """With ``trainer_workers > 1``: the trainer ranks' own process group (a torch gloo
        group; ``RANK``/``WORLD_SIZE`` are set in the environment too), handed over before the
        first sync, to build the user's DDP/FSDP on. The default does nothing."""

    def state_dict(self) -> Mapping[str, Any]:
        """The named tensors to push to the rollouts (CPU tensors for gloo, CUDA for nccl). With
        ``trainer_workers > 1``: only what this rank owns, ``{name: tensor}`` for a whole tensor
        or ``{name: ftstate.Shard(slice, dim, index, count)}`` for a slice (may return ``{}``);
        every rank is called together (it may be collective). Rollouts always get full tensors."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_dict()")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take weights back (recovery of a replaced trainer from a rollout or a checkpoint).
        With ``trainer_workers > 1``: this rank's part of the last committed version, in the
        form its ``state_dict()`` returned it (``{}`` if it owned nothing); called on the ranks
        being restored only, so it must not be collective. The tensors are the trainer's to
        keep or copy from: ftstate holds no reference to them after the call."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_state_dict()")

    def reset_optimizer(self) -> None:
        """Start the optimizer afresh after recovery from a rollout. The default does nothing,
        right for optimizers without state (plain SGD); override it otherwise."""

    def load_optimizer_checkpoint(self, path: str) -> None:
        """Load only the optimizer state from ``path`` (weights came back from a rollout)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement load_optimizer_checkpoint() for optimizer_state: checkpoint"
        )

    def load_checkpoint(self, path: str) -> None:
        """Load weights and optimizer state from the checkpoint folder ``path``."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_checkpoint() to recover from {path}")


class RolloutWorker(Worker):
    """A rollout (inference) worker: receives the weights, serves generation calls."""

    role: ClassVar[str] = "rollout"

    def safe_point(self, pause: bool = False) -> int:
        """Call between two steps of a long call (tokens, decode steps): with
        ``rollout_updates: in_flight``, a committed version waiting for this worker is loaded
        here, in the calling thread, through :meth:`load_weights` under the same proof as any
        load; the steps before ran wholly on the old version, those after run wholly on the new.
        Returns the weights version in effect. ``pause``: for an engine that cannot swap inside a
        request, the swap is recorded as a pause (the requests are held, the version loaded, the
        same requests resumed with their tokens so far): they span two versions. Outside a run
        (or with ``barrier`` updates, where nothing waits) it only returns the version."""
        gate = self.__dict__.get("_ftstate_gate")
        return gate.reached(pause) if gate is not None else self.weights_version

    def declare_lost(self, error: Exception) -> None:
        """This worker cannot go on (a process of its engine died, say): ftstate declares the
        member lost now, as if its process had died, kills its actor and replaces it. ``error``:
        an :class:`~ftstate.core.errors.FTError` saying what happened (it is what the run
        records). Callable from any thread; outside a run it does nothing."""
        gate = self.__dict__.get("_ftstate_gate")
        if gate is not None:
            gate.lost(error)

    @property
    def weights_version(self) -> int:
        """The weights version this worker computes with now (0 before its first load)."""
        gate = self.__dict__.get("_ftstate_gate")
        return gate.weights_version if gate is not None else int(self.__dict__.get("_ftstate_version", 0))

    @weights_version.setter
    def weights_version(self, value: int) -> None:
        # an engine's own bookkeeping (VLLMRollout) may set it; under ftstate the host's is what counts
        self.__dict__["_ftstate_version"] = value

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Adopt a complete, verified set of weights; ``version`` is the weights version."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_weights()")

    def weights_device(self) -> Any | None:
        """The device its engine's weights live on (``"cuda:0"``, a ``torch.device``) when it
        loads a version part by part through :meth:`load_weights_part`; None (the default):
        :meth:`load_weights` gets the whole version on the host. With a device, a committed
        version is moved from the host (its node's copy, ``staging: node``) to the device in
        parts of at most ``bucket_size_mb`` through two device buffers
        (:mod:`ftstate.transport.devicebuckets`): at most two buckets of device memory beyond
        the engine's weights while it loads, none after, and none reserved by a warm spare."""
        return None

    def load_weights_part(self, state: Mapping[str, Any], version: int, *, first: bool, last: bool) -> None:
        """One part of a verified version, on :meth:`weights_device` (used when both are
        defined): copy ``state``'s tensors into the engine's weights before returning (they are
        views into a device bucket that is reused two parts later). ``first`` / ``last``: the
        first and the last part of ``version`` (an engine that must finish a reload, e.g.
        re-pack its kernels, does so at ``last``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_weights_part() to load by parts")

    def held_weights(self) -> Mapping[str, Any] | None:
        """The named tensors this worker serves from, read back, when its engine keeps its own
        copy of what :meth:`load_weights` was given (``{name: tensor}`` with the names, dtypes
        and shapes it was given). After every load, and when a SUSPECT worker is re-admitted,
        ftstate hashes what this returns and admits the worker to serving only if that equals
        the sender's checksum: a copy torn or corrupted inside the engine takes the worker out
        of serving (STALE). The default, None, means "the tensors given to ``load_weights``":
        those are hashed instead (a ``load_weights`` that wrote into them shows).

        Memory: once this returns the weights, the engine's copy is the rollout's only one.
        ftstate then keeps no committed copy and no spare staging buffer of its own after a
        load (without the hook it keeps both: about 2x the weights per rollout), and reads
        this hook again, under the same lock as ``load_weights``, to send the committed
        version to a newcomer or to rebuild a trainer. So what it returns must be the
        version last loaded, under the names, dtypes and shapes it was given; a copy made
        for the occasion is fine (it lives only while it is sent)."""
        return None
