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


class TrainerWorker(Worker):
    """The trainer: the source of the weights."""

    role: ClassVar[str] = "trainer"

    def state_dict(self) -> Mapping[str, Any]:
        """The named tensors to push to the rollouts (CPU tensors for gloo, CUDA for nccl)."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_dict()")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take weights back (recovery of a replaced trainer from a rollout or a checkpoint)."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_state_dict()")


class RolloutWorker(Worker):
    """A rollout (inference) worker: receives the weights, serves generation calls."""

    role: ClassVar[str] = "rollout"

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Adopt a complete, verified set of weights; ``version`` is the weights version."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_weights()")
