"""GCE maintenance watcher: the metadata server's ``maintenance-event``, ``preempted`` and
``upcoming-maintenance`` keys, polled from each node (docs/operations.md, "What each maintenance source
reads")."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

from ftstate.controller.maintenance.base import Notice, PollProblem, PollResult, parse_rfc3339, short
from ftstate.controller.maintenance.fetch import Answer, JsonBody, join, json_body, request

DEFAULT_HOST = "metadata.google.internal"
ENV = "GCE_METADATA_HOST"
HEADERS = {"Metadata-Flavor": "Google"}
PREFIX = "/computeMetadata/v1/instance/"
EVENT_KINDS = {"MIGRATE_ON_HOST_MAINTENANCE": "migrate", "TERMINATE_ON_HOST_MAINTENANCE": "terminate"}


def endpoint(override: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The metadata server's base URL: the override, else ``GCE_METADATA_HOST``, else Google's."""
    if override:
        return override.rstrip("/")
    env = os.environ if environ is None else environ
    host = env.get(ENV) or DEFAULT_HOST
    return host.rstrip("/") if host.startswith(("http://", "https://")) else f"http://{host}"


# -- the answers, parsed (pure) -------------------------------------------------------------


def parse_maintenance_event(status: int, body: str, *, where: str = "maintenance-event") -> list[Notice] | PollProblem:
    """``maintenance-event``: NONE is no notice; MIGRATE/TERMINATE_ON_HOST_MAINTENANCE one."""
    if status != 200:
        return PollProblem("gce", where, "http_status", f"HTTP {status}: {body}")
    value = body.strip()
    if value == "NONE":
        return []
    kind = EVENT_KINDS.get(value)
    if kind is None:
        return PollProblem("gce", where, "malformed", f"unknown maintenance-event value {value!r}")
    return [Notice("gce", kind, raw=f"maintenance-event={value}")]


def parse_preempted(status: int, body: str, *, where: str = "preempted") -> list[Notice] | PollProblem:
    """``preempted``: TRUE is a preempt notice, FALSE none."""
    if status != 200:
        return PollProblem("gce", where, "http_status", f"HTTP {status}: {body}")
    value = body.strip().upper()
    if value == "FALSE":
        return []
    if value == "TRUE":
        return [Notice("gce", "preempt", raw="preempted=TRUE")]
    return PollProblem("gce", where, "malformed", f"expected TRUE or FALSE, got {body.strip()!r}")


def _field(window: Mapping[str, object], snake: str) -> object:
    camel = "".join(w.capitalize() if i else w for i, w in enumerate(snake.split("_")))
    return window.get(snake, window.get(camel))


def parse_upcoming_maintenance(
    status: int, body: str, *, where: str = "upcoming-maintenance"
) -> list[Notice] | PollProblem:
    """``upcoming-maintenance``: 404 (or an empty body) is nothing scheduled; a JSON window
    is a ``maintenance`` notice whose deadline is the window's start."""
    answer = json_body("gce", status, body, where, empty_is_none=True)
    if not isinstance(answer, JsonBody):
        return answer
    window = answer.data
    if not isinstance(window, dict):
        return PollProblem("gce", where, "malformed", f"expected a JSON object, got {body}")
    start = _field(window, "window_start_time") or _field(window, "latest_window_start_time")
    if not isinstance(start, str):
        return PollProblem("gce", where, "malformed", f"no window_start_time in {body}")
    try:
        deadline = parse_rfc3339(start)
    except ValueError:
        return PollProblem("gce", where, "malformed", f"window_start_time is not a time: {start!r}")
    status_text = _field(window, "maintenance_status") or "?"
    kind_text = _field(window, "type") or "?"
    return [Notice("gce", "maintenance", deadline=deadline,
                   raw=f"upcoming-maintenance {kind_text} {status_text} from {start}")]


def combine(event: list[Notice], preempted: list[Notice], upcoming: list[Notice]) -> list[Notice]:
    """One poll's notices: the maintenance-event notice takes the upcoming window's start as
    its deadline when it has none; the window stays a notice of its own."""
    window = next((n.deadline for n in upcoming if n.deadline is not None), None)
    if window is not None:
        event = [n if n.deadline is not None else dataclasses.replace(n, deadline=window) for n in event]
    return [*event, *preempted, *upcoming]


# -- the watcher -------------------------------------------------------------------------------


class GceWatcher:
    """Polls one GCE metadata server: three GETs, stopping at the first that finds the server
    unreachable or silent (each bounded by ``timeout``)."""

    source = "gce"
    KEYS = ("maintenance-event", "preempted", "upcoming-maintenance")
    PARSERS = (parse_maintenance_event, parse_preempted, parse_upcoming_maintenance)

    def __init__(self, base_url: str, *, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    @property
    def bound_s(self) -> float:
        return len(self.KEYS) * self.timeout

    def _get(self, key: str) -> Answer | PollProblem:
        url = join(self.base_url, PREFIX + key)
        answer = request("GET", url, source="gce", timeout=self.timeout, headers=HEADERS)
        if isinstance(answer, Answer) and answer.status != 404 and answer.header("Metadata-Flavor") != "Google":
            return PollProblem("gce", url, "malformed",
                               f"HTTP {answer.status} without Metadata-Flavor: Google (not a GCE metadata server): "
                               f"{short(answer.text(), 80)}", answer.seconds)
        return answer

    def poll(self) -> PollResult:
        t0 = time.monotonic()
        found: list[list[Notice]] = []
        problems: list[PollProblem] = []
        for key, parse in zip(self.KEYS, self.PARSERS, strict=True):
            answer = self._get(key)
            if isinstance(answer, PollProblem):
                problems.append(answer)
                if answer.problem in ("unreachable", "timeout", "bad_url"):
                    break  # the server is down or silent: the other keys would only wait as long
                found.append([])
                continue
            parsed = parse(answer.status, answer.text(), where=join(self.base_url, PREFIX + key))
            if isinstance(parsed, PollProblem):
                problems.append(parsed.took(answer.seconds))
                found.append([])
            else:
                found.append(parsed)
        found += [[]] * (len(self.KEYS) - len(found))
        notices = combine(*found)
        return PollResult("gce", tuple(notices), tuple(problems), round(time.monotonic() - t0, 3))

