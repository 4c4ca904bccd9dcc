"""Real faults on request (tests, benchmarks, the demo): a worker kills or stops its own process,
at once or after a number of progress units, or corrupts its next received bucket.
"""

from __future__ import annotations

import os
import signal

from ftstate.core.protocol import ChaosCorrupt, ChaosHang, ChaosKill
from ftstate.worker.part import HostPart


class Chaos(HostPart):
    """The chaos calls of a worker host (driven by :mod:`ftstate.controller.chaos`)."""

    _corrupt_next: bool
    _signal_at_progress: tuple[int, int] | None

    async def chaos_hang(self, req: ChaosHang) -> None:
        """Stop this process (SIGSTOP): alive, holding its sockets, making no progress; at once,
        or after ``req.after_progress`` more units of progress (hung mid-transfer)."""
        self._signal_or_arm(signal.SIGSTOP, req.after_progress)

    async def chaos_kill(self, req: ChaosKill) -> None:
        """SIGKILL this process: at once, or once ``req.after_progress`` more units of progress
        (buckets, calls) are made: a deterministic death in the middle of a transfer."""
        self._signal_or_arm(signal.SIGKILL, req.after_progress)

    async def chaos_corrupt_next_bucket(self, req: ChaosCorrupt) -> None:
        self._corrupt_next = True

    def _signal_or_arm(self, sig: int, after_progress: int | None) -> None:
        if after_progress is None:
            os.kill(os.getpid(), sig)
        else:
            self._signal_at_progress = (self.progress + after_progress, sig)
