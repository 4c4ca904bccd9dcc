"""In-flight updates (``rollout_updates: in_flight``): a committed version that reaches a rollout
while one of its user calls runs waits here, and is loaded at the call's next safe point.

The rule that keeps a generation whole: the swap happens only inside
:meth:`~ftstate.core.worker.RolloutWorker.safe_point`, which the user's own loop calls between
two steps, in the thread that computes them; so no step ever runs on a mix of two versions.
Only a version the controller committed (every rollout staged and verified it) is offered; a
newer one replaces an older one still waiting, so a swap always goes to the newest. When the
call ends without reaching a safe point, the host loads what waits before its next call.
"""

from __future__ import annotations

import threading
from typing import Any


class PendingSwap:
    """The committed version waiting for its safe point (one at a time, the newest), and the
    versions each user call ran under. Written on the actor's event loop, taken by the user's
    thread: every access holds the lock."""

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
        """Load the version waiting, if any, and return the version now in effect. ``pause``:
        the engine holds its requests around the load and resumes them (the swap itself is the
        same: the call's versions show its requests span two)."""
        return int(self._host.swap_at_safe_point(pause))

    def lost(self, error: Any) -> None:
        """The rollout declared itself lost: the host's vigil raises ``error``."""
        self._host.declare_lost(error)

    @property
    def weights_version(self) -> int:
        return int(self._host.weights_version)
