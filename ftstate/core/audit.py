"""The audit trail: one JSON line for everything that happened, written where it happened.

Every transition, deadline expiry, budget spend and error of every machine is one record,
written by :class:`ftstate.core.machine.StateMachine` at the one place its state changes (and by
the runtime for events that are not transitions). The trail is the evidence an operator
reads at 3 a.m. and the input of ``ftstate audit --check``, so each line is flushed as it is
written: a run that dies still leaves everything up to its last event.

Record fields (absent when they do not apply):

=====================  ============================================================
``ts``                 wall-clock time, ISO 8601 UTC
``t``                  seconds since the trail was opened (monotonic clock)
``event``              ``transition``, ``deadline_expired``, ``budget_spent``,
                       ``budget_exhausted``, ``error`` or a runtime event name
``machine``            the spec's name (``group``, ``worker``)
``member``             who: ``group`` or ``rollout-1``; plus ``role``, ``rank``, ``pid``, ``node``
``from`` / ``to``      the states left and entered; ``trigger`` the event that moved it
``group_version``      membership version at the time
``weights_version``    the weights version the member holds (group: the current one)
``seconds_in_state``   time spent in the state that was left
``error``/``message``  the error class and its message, for expiries and errors
``reason``             why, in one line
``detail``             the rest of a multi-line ``reason`` or ``message`` (a remote
                       traceback), kept apart so every other field stays one line
=====================  ============================================================

Writing goes through structlog (JSON renderer, ~20-30 µs a record); this module imports
neither Ray nor torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import structlog

#: Events that change a machine's state; everything else is context.
TRANSITION = "transition"
DEADLINE_EXPIRED = "deadline_expired"
BUDGET_SPENT = "budget_spent"
BUDGET_EXHAUSTED = "budget_exhausted"
ERROR = "error"
#: Fields written as one line (their further lines go to ``detail``).
ONE_LINE_FIELDS = ("reason", "message")


class AuditTrail:
    """Appends records to a JSON-lines file (or only to memory when ``path`` is None).

    path: the file; its parent folders are created. keep: also keep every record in
    ``self.records`` (the runtime's report and the tests read them). clock: a monotonic
    clock in seconds for the ``t`` field (injected by tests).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        keep: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.records: list[dict[str, Any]] = []
        self._keep = keep
        self._clock = clock
        self._t0 = clock()
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        processors: list[Any] = [
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            self._keep_record,
        ]
        if self._file is not None:
            processors.append(structlog.processors.JSONRenderer(serializer=_dumps))
            logger: Any = structlog.WriteLogger(self._file)
        else:
            processors.append(_drop)
            logger = structlog.ReturnLogger()
        self._log = structlog.wrap_logger(logger, processors=processors, context_class=dict)

    def record(self, event: str, **fields: Any) -> None:
        """Write one record. ``fields`` may use ``from``/``to`` via ``**{"from": ...}``.
        A multi-line ``reason`` or ``message`` keeps its first line; the rest goes to ``detail``."""
        for key in ONE_LINE_FIELDS:
            value = fields.get(key)
            if isinstance(value, str) and "\n" in value.strip():
                first, _, rest = value.strip().partition("\n")
                fields[key] = first.strip()
                fields.setdefault("detail", rest.strip())
        self._log.msg(event=event, t=round(self._clock() - self._t0, 6), **fields)

    def _keep_record(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if self._keep:
            self.records.append(dict(event_dict))
        return event_dict

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> AuditTrail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dumps(obj: Any, **kw: Any) -> str:
    # Order the keys so a human reading the raw file sees time, event and who first.
    front = ("ts", "t", "event", "machine", "member", "from", "to", "trigger")
    ordered = {k: obj[k] for k in front if k in obj}
    ordered.update((k, v) for k, v in obj.items() if k not in ordered)
    return json.dumps(ordered, default=str)


def _drop(_logger: Any, _name: str, _event_dict: dict[str, Any]) -> str:
    return ""


def as_records(trail: Any) -> list[dict[str, Any]]:
    """Records from whatever a caller holds: a trail file's path, an :class:`AuditTrail`, or an
    iterable of records or of ``(line, record)`` pairs (what :func:`read_trail` yields)."""
    if isinstance(trail, (str, os.PathLike)):
        return [rec for _, rec in read_trail(trail)]
    if isinstance(trail, AuditTrail):
        trail = trail.records
    out = []
    for item in trail:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int):
            item = item[1]
        if isinstance(item, dict):
            out.append(item)
    return out


def read_trail(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each line of a trail; a malformed line raises
    :class:`~ftstate.core.errors.AuditViolation` naming it."""
    from ftstate.core.errors import AuditViolation

    p = Path(path)
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AuditViolation(str(p), lineno, f"not a JSON object: {exc.msg}") from exc
            if not isinstance(rec, dict) or "event" not in rec:
                raise AuditViolation(str(p), lineno, "not an audit record (no 'event' field)")
            yield lineno, rec
