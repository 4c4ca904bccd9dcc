"""The classes a user subclasses, whose code runs inside an ftstate-managed Ray actor.

A :class:`TrainerWorker` hands out weights through ``state_dict``; a :class:`RolloutWorker` receives them
through ``load_weights`` only after the atomic commit. Other methods are the user's, reached with
``rt.trainer(...)`` / ``rt.rollout(...)``; plain ones run in a thread, one user call at a time, so user code
needs no locking. Imports neither Ray nor torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class Worker:
    """Base of every ftstate worker. ``role`` names the side it plays."""

    role: ClassVar[str] = ""

    def activity(self) -> tuple[bool, int] | None:
        """``(busy, progress)`` for the heartbeats: busy while a call that must keep moving runs, progress a
        counter it moves (an engine step). A busy counter standing still for half ``heartbeat_timeout_s`` is
        suspected as a wedge. None (default): only ftstate's work counts. Called on the actor's event loop:
        return at once (no lock, no device work)."""
        return None


class TrainerWorker(Worker):
    """The trainer: the source of the weights. A replaced trainer gets the last committed version back from a
    rollout or ``checkpoint_dir``; its optimizer follows ``fault_tolerance.optimizer_state``."""

    role: ClassVar[str] = "trainer"
    #: True when ``state_dict()`` is a lossy view of the masters (bf16 copies of fp32): recovery from
    #: a rollout is then refused unless ``fault_tolerance.allow_lossy_recovery`` is on.
    lossy_state_dict: ClassVar[bool] = False
    #: Several trainer ranks: True when every call touches only this rank's state (no collective), so a
    #: replaced rank replays alone; False: after a loss every rank is restored and all replay together.
    rank_local_calls: ClassVar[bool] = False

    def setup(self, group: Any, rank: int, world_size: int) -> None:
        """With ``trainer_workers > 1``: the ranks' own torch gloo group (``RANK``/``WORLD_SIZE`` set too),
        handed over before the first sync, for the user's DDP/FSDP. The default does nothing."""

    def state_dict(self) -> Mapping[str, Any]:
        """The named tensors to push (CPU for gloo, CUDA for nccl). With several ranks: only what this rank
        owns, whole tensors or ``ftstate.Shard`` slices (may be ``{}``); all ranks are called together.
        Rollouts always get full tensors."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_dict()")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take weights back when a trainer is recovered. With several ranks: this rank's part, in its
        ``state_dict()`` form; called on restored ranks only, so never collective. ftstate keeps no reference
        to the tensors afterwards."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_state_dict()")

    def reset_optimizer(self) -> None:
        """Start the optimizer afresh after recovery from a rollout; the default suits stateless SGD."""

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
        """Call between two steps of a long call: with ``rollout_updates: in_flight`` a waiting committed
        version is loaded here, so earlier steps ran on the old version and later ones on the new. Returns the
        version in effect. ``pause``: record the swap as a pause (requests held and resumed), for engines that
        cannot swap inside a request. Outside a run it only returns."""
        gate = self.__dict__.get("_ftstate_gate")
        return gate.reached(pause) if gate is not None else self.weights_version

    def declare_lost(self, error: Exception) -> None:
        """This worker cannot go on: ftstate declares it lost now, kills and replaces its actor. ``error``: an
        :class:`~ftstate.core.errors.FTError` saying why. Callable from any thread."""
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
        """The device its engine's weights live on when it loads by parts through :meth:`load_weights_part`;
        None (default): :meth:`load_weights` gets the whole version on the host. With a device, a version
        moves in parts of at most ``bucket_size_mb`` through two device buffers, freed after the load."""
        return None

    def load_weights_part(self, state: Mapping[str, Any], version: int, *, first: bool, last: bool) -> None:
        """One part of a verified version on :meth:`weights_device`: copy ``state`` into the engine before
        returning (the views are reused two parts later). ``first`` / ``last`` mark the version's first and
        last part."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_weights_part() to load by parts")

    def held_weights(self) -> Mapping[str, Any] | None:
        """The tensors the engine serves from, read back, when it keeps its own copy of what ``load_weights``
        got (same names, dtypes, shapes); None (default) hashes the tensors given. After every load and on
        re-admission ftstate hashes this and serves the worker only if it equals the sender's checksum. With
        it, ftstate keeps no copy of its own (the engine's is the only one) and reads it again to feed
        newcomers, so it must return the version last loaded."""
        return None
