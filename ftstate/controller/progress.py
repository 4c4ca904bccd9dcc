"""Progress of a run for people, reported by the controller's runtime: each phase (cluster, workers starting,
group formed, each sync and failover) is logged on the ``ftstate`` logger at INFO (silent unless the
application configures logging) and handed to listeners (the demo's view), so a slow start-up does not look
hung. It also warns when workers far outnumber CPUs."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import structlog

#: Worker processes per cluster CPU beyond which start-up warns (``oversubscribed``).
OVERSUBSCRIBED_RATIO = 4.0

_log = structlog.wrap_logger(
    logging.getLogger("ftstate"),
    processors=[structlog.processors.KeyValueRenderer(key_order=["event"], drop_missing=True)],
    wrapper_class=structlog.stdlib.BoundLogger,
)


@dataclasses.dataclass(frozen=True)
class ProgressEvent:
    """One report: ``phase``, a one-line ``message``, ``level`` (``info`` or ``warning``), ``facts`` (its
    numbers) and ``when`` (``time.monotonic()``)."""

    phase: str
    message: str
    level: str
    facts: dict[str, Any]
    when: float


class Progress:
    """Where a runtime's phases are reported (see the module docstring)."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[ProgressEvent], None]] = []
        #: The latest report (None before the first).
        self.last: ProgressEvent | None = None

    def listen(self, callback: Callable[[ProgressEvent], None]) -> None:
        """Call ``callback(event)`` on every report from now on; it must not block."""
        self._listeners.append(callback)

    def report(self, phase: str, message: str, *, level: str = "info", **facts: Any) -> None:
        event = ProgressEvent(phase, message, level, dict(facts), time.monotonic())
        self.last = event
        getattr(_log, level)(message, phase=phase, **facts)
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the run it watches
                _log.exception("progress listener failed", phase=phase)

    def check_capacity(self, processes: int, cpus: float) -> bool:
        """Warn when ``processes`` far exceed ``cpus`` (:data:`OVERSUBSCRIBED_RATIO`); True when it warned."""
        if cpus <= 0 or processes <= OVERSUBSCRIBED_RATIO * cpus:
            return False
        self.report("oversubscribed",
                    f"{processes} worker processes requested on a cluster of {cpus:g} CPUs: each is a Python "
                    "process importing torch and building the model, so start-up will be slow and memory-hungry "
                    "(the fractional worker_cpus only lets Ray place them)",
                    level="warning", processes=processes, cpus=cpus)
        return True


__all__ = ["OVERSUBSCRIBED_RATIO", "Progress", "ProgressEvent"]
