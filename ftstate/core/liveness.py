"""Liveness: heartbeats (or their absence) into worker events, for the controller's watchdog. Pure (no clock,
no I/O, no Ray or torch); the rules are in docs/concepts.md, "Liveness rules". A node's round may
:class:`Vouch` for unchanged, idle answers instead of handing each over."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: States in which a missed heartbeat makes a worker SUSPECT.
WATCHED = frozenset({"STALE", "RESYNCING", "RESYNCED", "READY", "SYNCING", "DRAINING"})
#: States with nothing to prove (no weights held): silence past the timeout is ``unresponsive``.
HOLDS_NOTHING = frozenset({"STANDBY", "PROMOTING", "RENDEZVOUS"})


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """One worker's answer to a heartbeat poll: ``progress`` is a counter bumped whenever its own work moves,
    ``busy`` means in a weights transfer now, and the version and checksum it holds committed."""

    progress: int
    busy: bool
    weights_version: int
    checksum: str | None
    pid: int = 0
    #: the messages it dropped as forged since the watchdog last asked (for the audit trail)
    forged: tuple[Mapping[str, Any], ...] = ()


class Vouch:
    """When a round last answered (``at``) for the workers it vouches for: unchanged and not busy then."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None


class Liveness:
    """Per-worker heartbeat bookkeeping. ``stall_s``: how long a busy worker may make no progress before that
    counts as a miss; ``timeout_s``: how long a spare may stay silent before ``unresponsive``."""

    __slots__ = ("last_answer_at", "last_progress", "last_progress_at", "missed", "stall_s", "timeout_s", "vouch")

    def __init__(self, stall_s: float, timeout_s: float) -> None:
        self.stall_s = stall_s
        self.timeout_s = timeout_s
        #: The last answer's progress counter (not the answer: a kept object would be scanned by every
        #: collection).
        self.last_progress: int | None = None
        self.last_progress_at: float | None = None
        self.last_answer_at: float | None = None
        self.missed = 0
        #: Set by the watchdog while this worker's answers are unchanged and idle; None: each is handed over.
        self.vouch: Vouch | None = None

    def observe(
        self,
        now: float,
        heartbeat: Heartbeat | None,
        *,
        state: str,
        current_version: int,
        current_checksum: str | None,
        source: bool = False,
    ) -> str | None:
        """Record one poll's outcome; returns the trigger to fire, or None. ``source``: a trainer rank, proven
        by an answer at the committed version or later, checksum aside."""
        if self.vouch is not None:
            self._vouched()
        if heartbeat is None:
            self.missed += 1
            if self.last_answer_at is None:
                self.last_answer_at = now
            if state in HOLDS_NOTHING and now - self.last_answer_at >= self.timeout_s:
                return "unresponsive"
            return "heartbeat_missed" if state in WATCHED else None
        self.missed = 0
        self.last_answer_at = now
        previous, self.last_progress = self.last_progress, heartbeat.progress
        if previous is None or heartbeat.progress != previous or not heartbeat.busy:
            self.last_progress_at = now
        stalled = (
            heartbeat.busy
            and self.last_progress_at is not None
            and now - self.last_progress_at >= self.stall_s
        )
        if stalled:
            return "heartbeat_missed" if state in WATCHED else None
        if state == "SUSPECT":
            if source:
                proven = heartbeat.weights_version >= current_version
            else:
                proven = heartbeat.weights_version == current_version and (
                    current_checksum is None or heartbeat.checksum == current_checksum
                )
            return "verified" if proven else "alive_stale"
        return None

    def unvouch(self) -> None:
        """Take the :attr:`vouch` back, keeping what it said (the rounds it moved in were answers)."""
        if self.vouch is not None:
            self._vouched()
            self.vouch = None

    def _vouched(self) -> None:
        at = self.vouch.at if self.vouch is not None else None
        if at is None:
            return
        # It answered at ``at``, as before and not busy: what observe would have recorded then.
        if self.last_answer_at is None or at > self.last_answer_at:
            self.last_answer_at = at
        if self.last_progress_at is None or at > self.last_progress_at:
            self.last_progress_at = at
