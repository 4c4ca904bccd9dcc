"""Azure maintenance watcher: Scheduled Events from the Instance Metadata Service, polled from each node and
acknowledged once drained (docs/operations.md, "What each maintenance source reads")."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from ftstate.controller.maintenance.base import Notice, PollProblem, PollResult, parse_http_date
from ftstate.controller.maintenance.fetch import JsonBody, join, json_body, request

DEFAULT_ENDPOINT = "http://169.254.169.254"
API_VERSION = "2020-07-01"
EVENTS_PATH = f"/metadata/scheduledevents?api-version={API_VERSION}"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS = {"Metadata": "true"}
EVENT_KINDS = {"Freeze": "freeze", "Reboot": "reboot", "Redeploy": "redeploy", "Preempt": "preempt",
               "Terminate": "terminate"}


def endpoint(override: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """IMDS's base URL: the override, else Azure's."""
    del environ  # no conventional variable for Azure
    return (override or DEFAULT_ENDPOINT).rstrip("/")


# -- the answer, parsed (pure) --------------------------------------------------------------


def parse_events(
    status: int, body: str, *, vm_name: str | None = None, where: str = EVENTS_PATH
) -> list[Notice] | PollProblem:
    """The Scheduled Events document: one notice per event concerning ``vm_name`` (every
    event when it is None). NotBefore is the deadline; empty (a started event) is none."""
    answer = json_body("azure", status, body, where, absent_is_none=False)
    if not isinstance(answer, JsonBody):
        return answer
    doc = answer.data
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return PollProblem("azure", where, "malformed", f"expected {{Events: [...]}}, got {body}")
    notices = []
    for i, event in enumerate(events):
        if not isinstance(event, dict) or not isinstance(event.get("EventId"), str) or not event["EventId"]:
            return PollProblem("azure", where, "malformed", f"event {i} has no EventId: {event!r}")
        kind_text = event.get("EventType")
        if not isinstance(kind_text, str) or not kind_text:
            return PollProblem("azure", where, "malformed", f"event {event['EventId']} has no EventType")
        resources = event.get("Resources") or []
        if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
            return PollProblem("azure", where, "malformed", f"event {event['EventId']} Resources is not a list of names")
        if vm_name is not None and resources and vm_name.lower() not in (r.lower() for r in resources):
            continue
        not_before = event.get("NotBefore") or ""
        try:
            deadline = parse_http_date(not_before) if not_before else None
        except ValueError:
            return PollProblem("azure", where, "malformed",
                               f"event {event['EventId']} NotBefore is not an RFC 1123 date: {not_before!r}")
        notices.append(Notice(
            "azure", EVENT_KINDS.get(kind_text, "maintenance"), deadline=deadline,
            node=None if vm_name is not None else (",".join(resources) or None),
            event_id=event["EventId"],
            raw=f"{kind_text} {event.get('EventStatus', '?')} NotBefore {not_before or '-'} "
                f"resources {','.join(resources) or '-'}",
        ))
    return notices


def acknowledgement(event_id: str) -> bytes:
    """The body that starts (acknowledges) one event."""
    return json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()


# -- the watcher -------------------------------------------------------------------------------


class AzureWatcher:
    """Polls one IMDS endpoint's Scheduled Events (one GET, plus the VM's name until known),
    each request bounded by ``timeout``."""

    source = "azure"

    def __init__(self, base_url: str, *, timeout: float, vm_name: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.vm_name = vm_name

    @property
    def bound_s(self) -> float:
        return 2 * self.timeout

    def _learn_name(self) -> PollProblem | None:
        url = join(self.base_url, NAME_PATH)
        answer = request("GET", url, source="azure", timeout=self.timeout, headers=HEADERS)
        if isinstance(answer, PollProblem):
            return answer
        name = answer.text().strip()
        if answer.status != 200 or not name or len(name) > 128 or not name.isprintable() or " " in name:
            return PollProblem("azure", url, "http_status" if answer.status != 200 else "malformed",
                               f"VM name: HTTP {answer.status}: {answer.text()}", answer.seconds)
        self.vm_name = name
        return None

    def poll(self) -> PollResult:
        t0 = time.monotonic()
        problems: list[PollProblem] = []
        if self.vm_name is None:
            problem = self._learn_name()
            if problem is not None:
                problems.append(problem)
                if problem.problem in ("unreachable", "timeout", "bad_url"):
                    return PollResult("azure", (), tuple(problems), round(time.monotonic() - t0, 3))
        url = join(self.base_url, EVENTS_PATH)
        answer = request("GET", url, source="azure", timeout=self.timeout, headers=HEADERS)
        notices: list[Notice] = []
        if isinstance(answer, PollProblem):
            problems.append(answer)
        else:
            parsed = parse_events(answer.status, answer.text(), vm_name=self.vm_name, where=url)
            if isinstance(parsed, PollProblem):
                problems.append(parsed.took(answer.seconds))
            else:
                notices = parsed
        return PollResult("azure", tuple(notices), tuple(problems), round(time.monotonic() - t0, 3))

    def acknowledge(self, event_id: str) -> PollProblem | None:
        """Start event ``event_id`` now (the node is drained): None when IMDS took it, else
        the problem (never raises)."""
        url = join(self.base_url, EVENTS_PATH)
        answer = request("POST", url, source="azure", timeout=self.timeout,
                         headers={**HEADERS, "Content-Type": "application/json"}, body=acknowledgement(event_id))
        if isinstance(answer, PollProblem):
            return answer
        if not 200 <= answer.status < 300:
            return PollProblem("azure", url, "http_status", f"acknowledging {event_id}: HTTP {answer.status}: "
                                                           f"{answer.text()}", answer.seconds)
        return None

