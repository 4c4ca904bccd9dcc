"""Liveness: turning heartbeats (or their absence) into worker events.

The runtime polls every worker every ``heartbeat_interval_s`` and hands each answer, or the
fact that none came within the interval, to that worker's :class:`Liveness`. It answers
with the trigger to fire on the worker's machine, if any:

- no answer within the interval -> ``heartbeat_missed`` (the worker becomes SUSPECT);
- an answer while busy in a transfer whose progress counter has not moved for ``stall_s``
  (half of ``heartbeat_timeout_s``, at least one interval) -> ``heartbeat_missed`` too: a
  worker stuck in a collective answers pings but is hung. Half the timeout, not one
  interval: a receiver legitimately waits while the sender packs a bucket or serves
  another receiver, and a CPU-starved machine stretches that wait;
- a spare (STANDBY), or a worker being promoted or joining a group version, silent for
  ``heartbeat_timeout_s`` -> ``unresponsive`` (straight to LOST: a hung spare promoted later,
  or a newcomer hung in the re-rendezvous, would only burn the failover deadline);
- an answer showing progress from a SUSPECT worker -> ``verified`` only if it reports the
  current weights version with the current checksum (a trainer rank: that version or a later
  one), else ``alive_stale``. A worker that
  merely answers proves nothing about its weights; it must show them: a suspect rollout's
  checksum is hashed afresh from the bytes it holds when it answers (the watchdog asks it to
  prove), not the value it cached at its last commit.

An answer the same as the worker's last one, not busy, outside SUSPECT implies nothing but
"it answered now". A watchdog polling thousands of workers a round need not hand each such
answer over one by one: it gives the worker's liveness a :class:`Vouch` (one per node's round,
whose time it moves each round), and until it takes the vouch back each time the vouch moved
counts as such an answer; :meth:`Liveness.observe` reads it first. What a vouched round does not
record is ``missed`` (reset by the next answer judged one by one; nothing decides by it).

SUSPECT carries the ``heartbeat_timeout_s`` deadline in the worker spec, so a suspect that
does not recover is declared LOST by the machine itself, not by this module. A process that
died is reported by the failing call (``ActorDiedError``), not here.

Pure: no clock of its own, no I/O. This module imports neither Ray nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: States in which a missed heartbeat makes a worker SUSPECT.
WATCHED = frozenset({"STALE", "RESYNCING", "RESYNCED", "READY", "SYNCING", "DRAINING"})
#: States with nothing to prove (no weights held): silence past the timeout is ``unresponsive``.
QUIET = frozenset({"STANDBY", "PROMOTING", "RENDEZVOUS"})


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """One worker's answer to a heartbeat poll.

    progress: a counter the worker bumps whenever its own work moves (a bucket sent or
    received, a call finished); busy: in a weights transfer right now; weights_version /
    checksum: what it holds committed.
    """

    progress: int
    busy: bool
    weights_version: int
    checksum: str | None
    pid: int = 0
    #: the messages it dropped as forged since the watchdog last asked (for the audit trail)
    forged: tuple[Mapping[str, Any], ...] = ()


class Vouch:
    """When a round last answered for the workers it vouches for (``at``; None before its
    first round): each of them answered then, the same as its last answer and not busy."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None


class Liveness:
    """Per-worker heartbeat bookkeeping. stall_s: how long a busy worker may make no progress
    before that counts as a missed heartbeat. timeout_s: how long a spare may stay silent
    before it is ``unresponsive`` (a spare has no SUSPECT state: it serves nothing)."""

    __slots__ = ("last_answer_at", "last_progress", "last_progress_at", "missed", "stall_s", "timeout_s", "vouch")

    def __init__(self, stall_s: float, timeout_s: float) -> None:
        self.stall_s = stall_s
        self.timeout_s = timeout_s
        #: The progress counter of the last answer (not the answer itself: kept for an interval,
        #: an object a member would be promoted and scanned by every full collection).
        self.last_progress: int | None = None
        self.last_progress_at: float | None = None
        self.last_answer_at: float | None = None
        self.missed = 0
        #: Set by the watchdog while this worker's answers in its node's rounds are the same as
        #: its last one and not busy (the module docstring); None: every answer is handed over.
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
        """Record one poll's outcome; returns the trigger to fire on the worker, or None.
        ``source``: the worker is a trainer rank, whose weights move ahead of the committed
        version by design (mid-sync it reports the version it is sending): it is proven by an
        answer at the committed version or later, checksum aside."""
        if self.vouch is not None:
            self._vouched()
        if heartbeat is None:
            self.missed += 1
            if self.last_answer_at is None:
                self.last_answer_at = now
            if state in QUIET and now - self.last_answer_at >= self.timeout_s:
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
