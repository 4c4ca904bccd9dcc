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
``run``                the run's id, on every record written after :meth:`AuditTrail.begin_run`
=====================  ============================================================

**One run, one trail of its own inside the file.** A run's first record is ``run_start``
(its id, what started: config digest, versions, hosts, the workers asked for), and every
record of the run carries its ``run``. A file given as ``audit_log`` to several runs one after
another is appended to, never overwritten (a trail is evidence): ``ftstate audit --check``
and the views take its runs one by one (:func:`split_runs`), so two runs into one file are
two valid trails, not one broken one. Terminal escapes and control characters are removed
from every string a record holds (:func:`ftstate.core.text.clean`): a remote traceback's
colours or a hostile message must not move the cursor of whoever reads the trail.

**Reading is bounded** (:func:`parse_lines`): a line longer than :data:`MAX_LINE_BYTES` is
reported and skipped without being read whole, a record nested deeper than
:data:`MAX_DEPTH` or holding a known field of the wrong type (:func:`record_problem`) is
reported and skipped, and bytes that are not UTF-8 are reported; nothing in a trail file can
make a reader raise anything but :class:`~ftstate.core.errors.AuditViolation` (or ``OSError``
for a file that cannot be opened).

Writing is one compact JSON line per record, encoded by orjson and written with one
``write()`` (~2 µs: it was structlog's JSON renderer, ~60 µs a record with its processor chain,
then the standard library's encoder and a flushed text file, ~5 µs, which a 10,000-member sync
pays 20,000 times; ``benchmarks/controller_scale.py``); this module imports neither Ray nor torch.
"""

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
#: The longest line a reader takes (a record is a few hundred bytes; one with a remote
#: traceback in ``detail`` a few tens of KB).
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
    """Appends records to a JSON-lines file (or only to memory when ``path`` is None).

    path: the file; its parent folders are created. keep: also keep records in ``self.records``
    (the tests and the views read them): True every one, False or 0 none, an int N the latest N
    at least (the list is cut back to N once it holds 2N, so memory stays bounded for a run of
    any length: a 10,000-member sync writes 20,000 records; ``audit_records_kept``). clock: a monotonic
    clock in seconds for the ``t`` field (injected by tests). wall_clock: epoch seconds for
    the ``ts`` field (default: the real wall clock; a simulation passes its virtual one, so a
    seeded run writes the same trail byte for byte).
    """

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
            # unbuffered: each record is one write() of its whole line, as a flushed text file did
            self._file = self.path.open("ab", buffering=0)
        self._wall_clock = wall_clock if wall_clock is not None else time.time
        #: Neither kept nor written (a long simulation's trail): a record is not even built.
        self._silent = self._file is None and not self._keep

    def begin_run(self, run: str, **facts: Any) -> None:
        """Start a run in this trail: every later record carries ``run``, and this writes its
        ``run_start`` record with ``facts`` (what started: config digest, versions, hosts)."""
        self.run = run
        self.record(RUN_START, **facts)

    def record(self, event: str, **fields: Any) -> None:
        """Write one record. ``fields`` may use ``from``/``to`` via ``**{"from": ...}``.
        A multi-line ``reason`` or ``message`` keeps its first line; the rest goes to ``detail``.
        Strings are cleaned of terminal escapes and control characters."""
        # One dict, built in the order the line is written (time, event and who first), with
        # each value cleaned as it goes in: a 10,000-member sync writes 20,000 of these, and
        # every intermediate dict or call per field was a measurable part of its CPU.
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
        """Write one record whose ``plain`` fields are already fit for a line, in the order
        they are written: numbers, None, or strings that :func:`plain` returned (a machine's
        identity, cleaned once when it is bound, and its spec's names). ``fields`` and ``more``
        follow, cleaned as :meth:`record` cleans every field. What a state machine writes at
        each transition: 20,000 records a 10,000-member sync, a third cheaper this way."""
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
    """``epoch`` as ISO 8601 UTC with a ``Z`` (the form structlog's ``TimeStamper`` wrote:
    microseconds, omitted when 0). The whole second's text is kept from the last call (records
    come thousands a second)."""
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
    """``value`` as a record holds it: strings (also inside lists, tuples and dicts) without
    terminal escapes or control characters (:func:`ftstate.core.text.clean`)."""
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


#: A record's line: orjson, what it cannot encode as the standard library would (dataclasses
#: and datetimes through ``str`` as ``default=str`` did; enums by value) passed to ``str``. A
#: 10,000-member sync writes 20,000 records, and a record took ~3.4 µs in ``json``'s C encoder
#: against ~0.5 µs here (``benchmarks/controller_scale.py``). Compact (``{"ts":"...","t":1.5}``).
_ORJSON_OPTIONS = (orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
                   | orjson.OPT_PASSTHROUGH_DATETIME)
#: What orjson refuses (an integer past 64 bits, a lone surrogate, nesting past its limit) goes
#: through the standard library's encoder, in the same compact form: a record is never lost to
#: its encoding.
_FALLBACK = json.JSONEncoder(default=str, separators=(",", ":"))


def _line(rec: Mapping[str, Any]) -> bytes:
    try:
        return orjson.dumps(rec, default=str, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:
        return (_FALLBACK.encode(rec) + "\n").encode("utf-8")


#: The fields written first after ``ts``, ``t`` and ``event``, so a human reading the raw file
#: sees time, event and who first.
_FRONT_FIELDS = ("machine", "member", "from", "to", "trigger")


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
    """Yield ``(line_number, record)`` for each line of a trail; a malformed line (see
    :func:`parse_lines`) raises :class:`~ftstate.core.errors.AuditViolation` naming it."""
    from ftstate.core.errors import AuditViolation

    p = Path(path)
    with p.open("rb") as f:
        for lineno, rec, problem in parse_lines(f):
            if problem is not None:
                raise AuditViolation(str(p), lineno, problem)
            yield lineno, rec  # type: ignore[misc]


def parse_lines(f: IO[bytes]) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """``(line, record, None)`` for each record of a trail opened in binary, ``(line, None,
    problem)`` for each line that is not one: longer than :data:`MAX_LINE_BYTES` (skipped
    without being read whole), not UTF-8, not JSON, nested deeper than :data:`MAX_DEPTH`,
    not an object with an ``event``, or a known field of the wrong type. Blank lines are skipped."""
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
    """Why ``rec`` is not a readable audit record (None when it is): not an object, no
    string ``event``, nested deeper than :data:`MAX_DEPTH`, or a known field
    (:data:`FIELD_TYPES`) of the wrong type. Views and the checker may then use every known
    field as its type without checking again."""
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
    """The runs of a trail, in order of their first record: ``(run id, its (line, record)
    pairs)``. A record's run is its ``run`` field; records without one (a trail written before
    runs were recorded, or records before any ``run_start``) belong to the run opened by the
    last ``run_start`` without an id, else to ``""``."""
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
