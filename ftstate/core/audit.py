"""The audit trail: one JSON line for everything that happened, written where it happened (the controller, or
the process whose machine changed). Each line is flushed as written, so a run that dies leaves everything up
to its last event; several runs append to one file, each its own trail (:func:`split_runs`). Strings are
cleaned of terminal escapes, and reading is bounded: nothing in a trail file makes a reader raise but
:class:`~ftstate.core.errors.AuditViolation` (or ``OSError``). The fields are listed in docs/operations.md
("Reading the audit trail"). Imports neither Ray nor torch."""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import orjson

from ftstate.core.errors import InternalError
from ftstate.core.events import KINDS
from ftstate.core.text import clean

#: Events that change a machine's state; everything else is context.
TRANSITION = "transition"
DEADLINE_EXPIRED = "deadline_expired"
BUDGET_SPENT = "budget_spent"
BUDGET_EXHAUSTED = "budget_exhausted"
ERROR = "error"
#: A run's first record (see the module docstring).
RUN_START = "run_start"
#: Fields written as one line (their further lines go to ``detail``).
ONE_LINE_FIELDS = ("reason", "message")
#: The longest line a reader takes (a record is a few hundred bytes; a traceback's, tens of KB).
MAX_LINE_BYTES = 1 << 20
#: The deepest nesting of lists and objects a record may have (the runtime writes at most 3).
MAX_DEPTH = 32
#: Known fields and the JSON types they must have (None is allowed for each: absent).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("event", "machine", "member", "from", "to", "trigger", "role", "run", "ts", "state",
                     "checksum"), (str,)),
    **dict.fromkeys(("group_version", "weights_version", "rank", "pid"), (int,)),
    **dict.fromkeys(("t", "seconds_in_state"), (int, float)),
}


_NO_FIELDS: Mapping[str, Any] = {}


class AuditTrail:
    """Appends records to a JSON-lines file (or only to memory when ``path`` is None; parents created).
    ``keep``: also keep records in ``self.records`` (True all, False/0 none, N at least the latest N, cut back
    at 2N). ``clock``: monotonic seconds for ``t``; ``wall_clock``: epoch seconds for ``ts`` (a simulation
    passes its virtual one, so a seeded run's trail is byte-identical)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        keep: bool | int = True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.records: list[dict[str, Any]] = []
        self._keep = bool(keep)
        #: Past twice this many records, ``records`` is cut back to the latest this many (None: never).
        self._kept = None if keep is True or not keep else int(keep)
        self._clock = clock
        self._t0 = clock()
        self._file: IO[bytes] | None = None
        #: The run whose records are being written (set by :meth:`begin_run`).
        self.run: str | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # unbuffered: each record is one write() of its whole line, on disk before the next event
            self._file = self.path.open("ab", buffering=0)
        self._wall_clock = wall_clock if wall_clock is not None else time.time
        #: Neither kept nor written (a long simulation's trail): a record is not even built.
        self._silent = self._file is None and not self._keep

    @property
    def silent(self) -> bool:
        """Whether records are neither kept nor written (then a caller need not build one)."""
        return self._silent

    def begin_run(self, run: str, **facts: Any) -> None:
        """Start a run: later records carry ``run``; writes ``run_start`` with ``facts``."""
        self.run = run
        self.record(RUN_START, **facts)

    def record(self, event: str, **fields: Any) -> None:
        """Write one record (``from``/``to`` via ``**{"from": ...}``); a multi-line ``reason`` or ``message``
        keeps its first line, the rest goes to ``detail``; strings are cleaned."""
        # One dict in line order, each value cleaned as it goes in: this is the trail's hot path.
        if self._silent:
            return
        rec = self._head(event)
        for key in _FRONT_FIELDS:
            if key in fields:
                rec[key] = None  # its place in the line; its value comes in below
        _put(rec, fields)
        self._write(rec)

    def record_plain(self, event: str, plain: dict[str, Any], fields: Mapping[str, Any] = _NO_FIELDS,
                     **more: Any) -> None:
        """Write one record whose ``plain`` fields are already line-fit (numbers, None, strings from
        :func:`plain`), then ``fields`` and ``more`` cleaned as :meth:`record` does; what a state machine
        writes at each transition, a third cheaper."""
        if self._silent:
            return
        rec = self._head(event)
        rec.update(plain)
        if fields:
            _put(rec, fields)
        if more:
            _put(rec, more)
        self._write(rec)

    def _head(self, event: str) -> dict[str, Any]:
        if event not in KINDS:  # the vocabulary is declared once (ftstate.core.events), for every reader
            raise InternalError(f"audit record kind {event!r} is not declared in ftstate.core.events")
        return {"ts": _iso(self._wall_clock()), "t": round(self._clock() - self._t0, 6), "event": event}

    def _write(self, rec: dict[str, Any]) -> None:
        if self.run is not None and "run" not in rec:
            rec["run"] = self.run
        for key in ONE_LINE_FIELDS:
            value = rec.get(key)
            if type(value) is str and "\n" in value.strip():
                first, _, rest = value.strip().partition("\n")
                rec[key] = first.strip()
                rec.setdefault("detail", rest.strip())
        if self._keep:
            self.records.append(rec)
            if self._kept is not None and len(self.records) >= 2 * self._kept:
                del self.records[: len(self.records) - self._kept]
        if self._file is not None:
            line = _line(rec)
            written = self._file.write(line) or 0
            while written < len(line):  # a short write (a signal, a disk filling up): the rest, or why not
                more = self._file.write(line[written:])
                if not more:
                    raise OSError(f"audit trail {self.path}: {written} of a record's {len(line)} bytes written")
                written += more

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> AuditTrail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ISO_SECOND: list[Any] = [None, ""]  # the last whole second formatted, and its text


def _iso(epoch: float) -> str:
    """``epoch`` as ISO 8601 UTC with ``Z`` (microseconds omitted when 0); the second's text is cached."""
    second = int(epoch // 1)
    micro = round((epoch - second) * 1e6)
    if micro >= 1_000_000:
        second, micro = second + 1, micro - 1_000_000
    if _ISO_SECOND[0] != second:
        _ISO_SECOND[0] = second
        _ISO_SECOND[1] = datetime.datetime.fromtimestamp(second, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{_ISO_SECOND[1]}.{micro:06d}Z" if micro else f"{_ISO_SECOND[1]}Z"


_PLAIN = frozenset({int, float, bool, type(None)})
_printable = str.isprintable  # printable text has no control character, so no escape either


def _put(rec: dict[str, Any], fields: Mapping[str, Any]) -> None:
    for key, value in fields.items():
        if key != "ts":  # the wall clock's, always
            rec[key] = value if type(value) in _PLAIN or (type(value) is str and _printable(value)) \
                else _cleaned(value)


def plain(value: Any) -> Any:
    """``value`` as a record holds it: strings (also nested) without terminal escapes or controls."""
    return _cleaned(value)


def _cleaned(value: Any, depth: int = 0) -> Any:
    if type(value) in _PLAIN:  # most fields: nothing to clean, and the cheapest test first
        return value
    if isinstance(value, str):
        return clean(value) if "\x1b" in value or not value.isprintable() else value
    if depth < MAX_DEPTH and isinstance(value, (list, tuple)):
        return [_cleaned(v, depth + 1) for v in value]
    if depth < MAX_DEPTH and isinstance(value, dict):
        return {k: _cleaned(v, depth + 1) for k, v in value.items()}
    return value


#: A record's line: compact orjson; what it cannot encode (dataclasses, datetimes, enums) as ``str``.
_ORJSON_OPTIONS = (orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
                   | orjson.OPT_PASSTHROUGH_DATETIME)
#: What orjson refuses goes through the standard library's encoder: a record is never lost to its encoding.
_FALLBACK = json.JSONEncoder(default=str, separators=(",", ":"))


def _line(rec: Mapping[str, Any]) -> bytes:
    try:
        return orjson.dumps(rec, default=str, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:
        return (_FALLBACK.encode(rec) + "\n").encode("utf-8")


#: The fields written after ``ts``, ``t`` and ``event``, so a reader of the raw file sees who first.
_FRONT_FIELDS = ("machine", "member", "from", "to", "trigger")


def as_records(trail: Any) -> list[dict[str, Any]]:
    """Records from a trail file's path, an :class:`AuditTrail`, or records or ``(line, record)`` pairs."""
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
    """Yield ``(line_number, record)`` per line; a malformed line raises
    :class:`~ftstate.core.errors.AuditViolation`."""
    from ftstate.core.errors import AuditViolation

    p = Path(path)
    with p.open("rb") as f:
        for lineno, rec, problem in parse_lines(f):
            if problem is not None:
                raise AuditViolation(str(p), lineno, problem)
            yield lineno, rec  # type: ignore[misc]


def parse_lines(f: IO[bytes]) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """``(line, record, None)`` per record of a binary trail, ``(line, None, problem)`` per line that is not
    one (too long: skipped unread; not UTF-8 or JSON; too deep; no ``event``; a mistyped field)."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            size = len(raw)
            while raw and not raw.endswith(b"\n"):  # the rest of the line, a bounded chunk at a time
                raw = f.readline(MAX_LINE_BYTES)
                size += len(raw)
            yield lineno, None, f"line longer than {MAX_LINE_BYTES} bytes ({size} bytes): not read"
            continue
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield lineno, None, f"not UTF-8 text (byte {exc.start})"
            continue
        try:
            rec = json.loads(text)
        except RecursionError:
            yield lineno, None, f"not an audit record: nested deeper than {MAX_DEPTH} levels"
            continue
        except ValueError as exc:  # JSONDecodeError, and the int-string length limit
            yield lineno, None, f"not a JSON object: {getattr(exc, 'msg', None) or exc}"
            continue
        problem = record_problem(rec)
        if problem is not None:
            yield lineno, None, problem
            continue
        yield lineno, rec, None


def record_problem(rec: Any) -> str | None:
    """Why ``rec`` is not a readable audit record, or None; past it, views may use every known field as its
    type without checking again."""
    if not isinstance(rec, dict) or "event" not in rec:
        return "not an audit record (no 'event' field)"
    if _too_deep(rec):
        return f"not an audit record: nested deeper than {MAX_DEPTH} levels"
    for key, types in FIELD_TYPES.items():
        value = rec.get(key)
        if value is None and key != "event":
            continue
        if not isinstance(value, types) or isinstance(value, bool):
            return f"field {key!r}: expected {_WANT[types]}, got {type(value).__name__}"
    return None


_WANT = {(str,): "a string", (int,): "an integer", (int, float): "a number"}


def _too_deep(value: Any) -> bool:
    # Iterative: a recursive walk is what a hostile record would exploit.
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def split_runs(items: Iterable[Any]) -> list[tuple[str, list[tuple[int, dict[str, Any]]]]]:
    """The runs of a trail in order: ``(run id, its (line, record) pairs)``. Records without ``run`` go to the
    run opened by the last id-less ``run_start``, else to ``""``."""
    runs: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    current = ""
    anonymous = 0
    for i, item in enumerate(items, 1):  # (line, record) pairs, or plain records numbered from 1
        line, rec = item if isinstance(item, tuple) else (i, item)
        run = rec.get("run")
        if not isinstance(run, str):
            if rec.get("event") == RUN_START:
                anonymous += 1
                current = f"#{anonymous}"
            run = current
        runs.setdefault(run, []).append((line, rec))
    return list(runs.items())
