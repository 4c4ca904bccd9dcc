"""AWS EC2 maintenance watcher: spot interruptions, rebalance recommendations and scheduled events over
IMDSv2, polled from each node (docs/operations.md, "What each maintenance source reads")."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

from ftstate.controller.maintenance.base import (
    Notice,
    PollProblem,
    PollResult,
    parse_http_date,
    parse_rfc3339,
)
from ftstate.controller.maintenance.fetch import Answer, JsonBody, join, json_body, request

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
#: The token lifetime asked for (IMDS allows 1 s to 6 h) and how long before its end it is renewed.
TOKEN_TTL_S = 21600
TOKEN_MARGIN_S = 60
SPOT_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED_PATH = "/latest/meta-data/events/maintenance/scheduled"
SCHEDULED_KINDS = {
    "instance-reboot": "reboot",
    "system-reboot": "reboot",
    "system-maintenance": "maintenance",
    "instance-retirement": "terminate",
    "instance-stop": "stop",
}


def endpoint(override: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """IMDS's base URL: the override, else ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else AWS's."""
    env = os.environ if environ is None else environ
    return (override or env.get(ENV) or DEFAULT_ENDPOINT).rstrip("/")


# -- the answers, parsed (pure) -------------------------------------------------------------


def parse_spot_action(status: int, body: str, *, where: str = SPOT_PATH) -> list[Notice] | PollProblem:
    """``spot/instance-action``: 404 is none; the JSON action is a ``preempt`` notice."""
    answer = json_body("aws", status, body, where)
    if not isinstance(answer, JsonBody):
        return answer
    data = answer.data
    if not isinstance(data, dict) or data.get("action") not in ("terminate", "stop", "hibernate"):
        return PollProblem("aws", where, "malformed", f"expected {{action: terminate|stop|hibernate, time}}, got {body}")
    try:
        deadline = parse_rfc3339(data.get("time"))  # type: ignore[arg-type]
    except ValueError:
        return PollProblem("aws", where, "malformed", f"time is not a time: {data.get('time')!r}")
    return [Notice("aws", "preempt", deadline=deadline, raw=f"spot instance-action {data['action']} at {data['time']}")]


def parse_rebalance(status: int, body: str, *, where: str = REBALANCE_PATH) -> list[Notice] | PollProblem:
    """``events/recommendations/rebalance``: 404 is none; ``{noticeTime}`` a ``rebalance`` notice."""
    answer = json_body("aws", status, body, where)
    if not isinstance(answer, JsonBody):
        return answer
    data = answer.data
    if not isinstance(data, dict) or not isinstance(data.get("noticeTime"), str):
        return PollProblem("aws", where, "malformed", f"expected {{noticeTime}}, got {body}")
    try:
        parse_rfc3339(data["noticeTime"])
    except ValueError:
        return PollProblem("aws", where, "malformed", f"noticeTime is not a time: {data['noticeTime']!r}")
    return [Notice("aws", "rebalance", raw=f"rebalance recommendation noticed {data['noticeTime']}")]


def parse_scheduled(status: int, body: str, *, where: str = SCHEDULED_PATH) -> list[Notice] | PollProblem:
    """``events/maintenance/scheduled``: a JSON list (404 or empty: none); each event not
    completed or canceled is a notice whose deadline is its NotBefore."""
    answer = json_body("aws", status, body, where, empty_is_none=True)
    if not isinstance(answer, JsonBody):
        return answer
    data = answer.data
    if not isinstance(data, list):
        return PollProblem("aws", where, "malformed", f"expected a JSON list of events, got {body}")
    notices = []
    for i, event in enumerate(data):
        if not isinstance(event, dict) or not isinstance(event.get("Code"), str):
            return PollProblem("aws", where, "malformed", f"event {i} has no Code: {event!r}")
        state = str(event.get("State", "active")).lower()
        description = str(event.get("Description", ""))
        if state in ("completed", "canceled", "cancelled") or description.startswith(("[Completed]", "[Canceled]")):
            continue
        code = event["Code"]
        try:
            deadline = parse_http_date(event["NotBefore"]) if event.get("NotBefore") else None
        except ValueError:
            return PollProblem("aws", where, "malformed", f"event {i} NotBefore is not a date: {event['NotBefore']!r}")
        event_id = event.get("EventId")
        notices.append(Notice("aws", SCHEDULED_KINDS.get(code, "maintenance"), deadline=deadline,
                              event_id=event_id if isinstance(event_id, str) else None,
                              raw=f"scheduled {code} {state} NotBefore {event.get('NotBefore')}"))
    return notices


# -- the watcher -------------------------------------------------------------------------------


class AwsWatcher:
    """Polls one IMDS endpoint: a token when needed, then three GETs, stopping at the first
    request that finds the server unreachable or silent (each bounded by ``timeout``)."""

    source = "aws"
    PATHS = (SPOT_PATH, REBALANCE_PATH, SCHEDULED_PATH)
    PARSERS = (parse_spot_action, parse_rebalance, parse_scheduled)

    def __init__(self, base_url: str, *, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.clock = clock
        self._token: str | None = None
        self._token_until = 0.0
        self._lock = threading.Lock()

    @property
    def bound_s(self) -> float:
        # a token, three GETs, and one renewal with its retried GET
        return (2 + len(self.PATHS) + 1) * self.timeout

    def _new_token(self) -> str | PollProblem:
        url = join(self.base_url, TOKEN_PATH)
        answer = request("PUT", url, source="aws", timeout=self.timeout, headers={TTL_HEADER: str(TOKEN_TTL_S)})
        if isinstance(answer, PollProblem):
            return answer
        token = answer.text().strip()
        if answer.status != 200 or not token or not token.isascii() or not token.isprintable() or len(token) > 1024:
            return PollProblem("aws", url, "http_status" if answer.status != 200 else "malformed",
                               f"IMDSv2 token: HTTP {answer.status}: {answer.text()}", answer.seconds)
        try:
            ttl = float(answer.header(TTL_HEADER) or TOKEN_TTL_S)
        except ValueError:
            ttl = TOKEN_TTL_S
        self._token = token
        self._token_until = self.clock() + max(ttl - TOKEN_MARGIN_S, ttl / 2)
        return token

    def _token_now(self) -> str | PollProblem:
        if self._token is not None and self.clock() < self._token_until:
            return self._token
        return self._new_token()

    def poll(self) -> PollResult:
        with self._lock:  # the token is shared; a poll abandoned by the runner may still run
            return self._poll()

    def _poll(self) -> PollResult:
        t0 = time.monotonic()
        notices: list[Notice] = []
        problems: list[PollProblem] = []
        token = self._token_now()
        if isinstance(token, PollProblem):
            return PollResult("aws", (), (token,), round(time.monotonic() - t0, 3))
        renewed = False
        for path, parse in zip(self.PATHS, self.PARSERS, strict=True):
            url = join(self.base_url, path)
            answer = request("GET", url, source="aws", timeout=self.timeout, headers={TOKEN_HEADER: token})
            if isinstance(answer, Answer) and answer.status == 401 and not renewed:
                renewed = True
                self._token = None
                token = self._new_token()
                if isinstance(token, PollProblem):
                    problems.append(token)
                    break
                answer = request("GET", url, source="aws", timeout=self.timeout, headers={TOKEN_HEADER: token})
            if isinstance(answer, PollProblem):
                problems.append(answer)
                if answer.problem in ("unreachable", "timeout", "bad_url"):
                    break
                continue
            parsed = parse(answer.status, answer.text(), where=url)
            if isinstance(parsed, PollProblem):
                problems.append(parsed.took(answer.seconds))
            else:
                notices += parsed
        return PollResult("aws", tuple(notices), tuple(problems), round(time.monotonic() - t0, 3))
