"""Progress of a run, for people: what the runtime is doing and what it waits for.

Start-up can take a while (a Ray cluster, then one process per worker importing torch and
building the user's model: seconds each, more when workers outnumber CPUs), and a run that
says nothing meanwhile looks hung. The runtime reports each phase here: connecting to the
cluster, ``starting 24 workers: 7 ready`` as each worker answers, the group formed; then
each completed sync (``weights version 3 synced to 2 rollouts in 0.084s``) and each failover
(who was lost, why, who serves now and after how long). Each
report is logged through structlog on the standard ``logging`` logger ``ftstate`` (INFO;
silent unless the application configures logging, as a library's logs should be; a warning
reaches stderr through logging's last-resort handler) and handed to every listener
(:meth:`Progress.listen`: the demo prints them as plain lines without a terminal and shows the
latest in its live view on one).

It also warns when the run asks for far more worker processes than the cluster has CPUs
(:data:`OVERSUBSCRIBED_RATIO`): each is a full Python process with torch, so 50 rollouts on
2 CPUs take minutes and gigabytes to start, whatever ``worker_cpus`` lets Ray place.
"""

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
    """One report: phase (``cluster``, ``workers``, ``group``, ``oversubscribed``, ``sync``,
    ``failover``), message
    (one line for a person), level (``info`` or ``warning``), facts (the numbers in it), and
    when (``time.monotonic()``)."""

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
        """Warn when ``processes`` worker processes far exceed ``cpus`` (see
        :data:`OVERSUBSCRIBED_RATIO`); True when it warned."""
        if cpus <= 0 or processes <= OVERSUBSCRIBED_RATIO * cpus:
            return False
        self.report("oversubscribed",
                    f"{processes} worker processes requested on a cluster of {cpus:g} CPUs: each is a Python "
                    "process importing torch and building the model, so start-up will be slow and memory-hungry "
                    "(the fractional worker_cpus only lets Ray place them)",
                    level="warning", processes=processes, cpus=cpus)
        return True


__all__ = ["OVERSUBSCRIBED_RATIO", "Progress", "ProgressEvent"]
