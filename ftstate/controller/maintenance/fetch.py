"""One bounded HTTP request to a metadata server, standard library only: ``http.client`` (never a proxy),
bounded end to end by a timer that shuts the socket. :func:`request` never raises for a bad server: it returns
an :class:`Answer` or a ``PollProblem``."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from ftstate.controller.maintenance.base import Notice, PollProblem

#: The largest answer read from a metadata server; a longer one is a problem, not a notice.
MAX_BODY = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Answer:
    """A complete HTTP answer: status, headers (names lower-cased), body, seconds it took."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    seconds: float

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


def join(base: str, path: str) -> str:
    """``base`` (scheme and host, maybe a path prefix) with ``path`` appended."""
    return base.rstrip("/") + "/" + path.lstrip("/")


def request(
    method: str,
    url: str,
    *,
    source: str,
    timeout: float,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    max_bytes: int = MAX_BODY,
) -> Answer | PollProblem:
    """Make one request; an :class:`Answer` whatever its status, or a problem (unreachable,
    timeout, too large, not HTTP, a bad URL), within ``timeout`` seconds."""
    t0 = time.monotonic()

    def problem(kind: str, detail: str) -> PollProblem:
        return PollProblem(source, url, kind, detail, round(time.monotonic() - t0, 3))  # type: ignore[arg-type]

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return problem("bad_url", "expected an http:// or https:// URL with a host")
    try:
        port = parts.port
    except ValueError:
        return problem("bad_url", "the port is not a number")
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_class(parts.hostname, port, timeout=timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.request(method, target, body=body, headers=dict(headers or {}))
        resp = conn.getresponse()
        data = resp.read(max_bytes + 1)
        status = resp.status
        got_headers = {k.lower(): v for k, v in resp.getheaders()}
    except TimeoutError:
        return problem("timeout", f"no complete answer within {timeout:g}s")
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            return problem("timeout", f"no complete answer within {timeout:g}s")
        if isinstance(exc, http.client.HTTPException):
            return problem("malformed", f"not an HTTP answer: {type(exc).__name__}: {exc}")
        return problem("unreachable", f"{type(exc).__name__}: {exc}")
    except ValueError as exc:  # a header value http.client will not send (e.g. a token that is not ASCII)
        return problem("error", f"{type(exc).__name__}: {exc}")
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        return problem("timeout", f"no complete answer within {timeout:g}s")
    if len(data) > max_bytes:
        return problem("too_large", f"answer longer than {max_bytes} bytes")
    return Answer(status, got_headers, data, round(time.monotonic() - t0, 3))


@dataclasses.dataclass(frozen=True)
class JsonBody:
    """The JSON a metadata endpoint answered, for its parser to read."""

    data: Any


def json_body(source: str, status: int, body: str, where: str, *, absent_is_none: bool = True,
              empty_is_none: bool = False) -> JsonBody | list[Notice] | PollProblem:
    """What ``where`` answered: its JSON; ``[]`` when it announces nothing (a 404 where ``absent_is_none``,
    an empty body where ``empty_is_none``); a :class:`PollProblem` for any other status or non-JSON."""
    if (absent_is_none and status == 404) or (empty_is_none and status == 200 and not body.strip()):
        return []
    if status != 200:
        return PollProblem(source, where, "http_status", f"HTTP {status}: {body}")
    try:
        return JsonBody(json.loads(body))
    except ValueError:
        return PollProblem(source, where, "malformed", f"not JSON: {body}")
