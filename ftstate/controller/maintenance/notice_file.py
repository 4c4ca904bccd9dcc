"""Maintenance watcher for a notice file an operator or scheduler writes (on-prem, or what the clouds do not
cover): one JSON notice or a list; no file or an empty one is no notice."""

from __future__ import annotations

import json
import os
import time

from ftstate.controller.maintenance.base import KINDS, Notice, PollProblem, PollResult, parse_rfc3339

#: The largest notice file read.
MAX_BYTES = 64 * 1024


def parse_notice_file(text: str, *, where: str = "maintenance_file") -> list[Notice] | PollProblem:
    """The file's text as notices (pure)."""
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except ValueError:
        return PollProblem("file", where, "malformed", f"not JSON: {text}")
    entries = data if isinstance(data, list) else [data]
    notices = []
    for i, entry in enumerate(entries):
        at = f"entry {i}: " if isinstance(data, list) else ""
        if not isinstance(entry, dict):
            return PollProblem("file", where, "malformed", f"{at}expected a JSON object, got {entry!r}")
        unknown = sorted(set(entry) - {"kind", "deadline", "node", "event_id"})
        if unknown:
            return PollProblem("file", where, "malformed", f"{at}unknown keys {unknown}; expected kind, deadline, "
                                                            "node, event_id")
        kind = entry.get("kind")
        if kind not in KINDS:
            return PollProblem("file", where, "malformed", f"{at}kind must be one of {', '.join(KINDS)}, got {kind!r}")
        deadline = entry.get("deadline")
        if isinstance(deadline, str):
            try:
                deadline = parse_rfc3339(deadline)
            except ValueError:
                return PollProblem("file", where, "malformed", f"{at}deadline is not an RFC 3339 time: {deadline!r}")
        elif deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
            return PollProblem("file", where, "malformed", f"{at}deadline must be epoch seconds, a time or null, "
                                                            f"got {deadline!r}")
        node, event_id = entry.get("node"), entry.get("event_id")
        for name, value in (("node", node), ("event_id", event_id)):
            if value is not None and (not isinstance(value, str) or not value):
                return PollProblem("file", where, "malformed", f"{at}{name} must be a non-empty string, got {value!r}")
        notices.append(Notice("file", kind, deadline=None if deadline is None else float(deadline), node=node,
                              event_id=event_id, raw=f"file {where}: {json.dumps(entry, sort_keys=True)}"))
    return notices


class NoticeFileWatcher:
    """Reads the notice file at each poll."""

    source = "file"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    @property
    def bound_s(self) -> float:
        return 1.0  # a local read

    def poll(self) -> PollResult:
        t0 = time.monotonic()
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return PollResult("file", (), (), round(time.monotonic() - t0, 3))
        except OSError as exc:
            took = round(time.monotonic() - t0, 3)
            return PollResult("file", (), (PollProblem("file", self.path, "error", f"{type(exc).__name__}: {exc}",
                                                       took),), took)
        took = round(time.monotonic() - t0, 3)
        if len(data) > MAX_BYTES:
            return PollResult("file", (), (PollProblem("file", self.path, "too_large", f"longer than {MAX_BYTES} bytes",
                                                       took),), took)
        parsed = parse_notice_file(data.decode("utf-8", errors="replace"), where=self.path)
        if isinstance(parsed, PollProblem):
            return PollResult("file", (), (parsed.took(took),), took)
        return PollResult("file", tuple(parsed), (), took)
