"""In-flight updates in a rollout's worker host (``rollout_updates: in_flight``): a committed version that
arrives while a user call runs waits here and is loaded at the call's next ``safe_point``, in the computing
thread, so no step runs on two versions; a newer version replaces an older one waiting, and a call ending
without a safe point loads it before the next."""

from __future__ import annotations

import threading
from typing import Any


class PendingSwap:
    """The committed version waiting for its safe point (the newest) and the versions each call ran under;
    written on the event loop, taken by the user's thread, always under the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: Any = None
        #: Versions in effect during the user call in progress (its start and each swap).
        self.call_versions: list[int] = []

    def offer(self, staged: Any) -> None:
        """``staged`` (a committed version) waits for the next safe point; an older one waiting goes."""
        with self._lock:
            if self._staged is None or staged.weights_version >= self._staged.weights_version:
                self._staged = staged

    def take(self) -> Any:
        """The version waiting, handed to whoever loads it (None: nothing waits)."""
        with self._lock:
            staged, self._staged = self._staged, None
            return staged

    def peek(self) -> Any:
        """The version waiting, left in place (a resync may send it: it is committed and verified)."""
        with self._lock:
            return self._staged

    @property
    def version(self) -> int | None:
        with self._lock:
            return None if self._staged is None else int(self._staged.weights_version)


class SafePointGate:
    """What a rollout's :meth:`~ftstate.core.worker.RolloutWorker.safe_point` calls: the host's
    swap, run in the caller's thread."""

    def __init__(self, host: Any) -> None:
        self._host = host

    def reached(self, pause: bool) -> int:
        """Load the waiting version, if any; returns the version now in effect. ``pause``: the engine holds
        its requests around the load."""
        return int(self._host.swap_at_safe_point(pause))

    def lost(self, error: Any) -> None:
        """The rollout declared itself lost: the host's vigil raises ``error``."""
        self._host.declare_lost(error)

    @property
    def weights_version(self) -> int:
        return int(self._host.weights_version)
