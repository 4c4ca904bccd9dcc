"""A loopback GCE metadata server (standard library only, 127.0.0.1, a daemon thread) that the demo's
``--maintenance`` scenario announces through: it speaks the keys ftstate's GCE watcher reads and, like the
real one, refuses requests without ``Metadata-Flavor: Google``. The tests' servers for other providers build
on :class:`MetadataServer`."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = tuple[int, dict[str, str], bytes]

#: The path prefix of every key a GCE VM reads about itself.
GCE_PREFIX = "/computeMetadata/v1/instance/"


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        owner = self.server.owner
        owner._log((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        status, headers, payload = owner.reply(self.command, self.path, self.headers, body)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: MetadataServer


class MetadataServer:
    """A threaded HTTP server on 127.0.0.1:0 answering through :meth:`reply`; ``requests`` keeps the last
    ``keep_requests`` received (all when None)."""

    def __init__(self, *, keep_requests: int | None = None) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self._keep = keep_requests
        self._lock = threading.Lock()
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name=f"{type(self).__name__}-{self.port}")
        self._thread.start()

    def _log(self, request: tuple[str, str, dict[str, str], bytes]) -> None:
        with self._lock:
            self.requests.append(request)
            if self._keep is not None and len(self.requests) > self._keep:
                del self.requests[: len(self.requests) - self._keep]

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``, the form ``GCE_METADATA_HOST`` takes."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def reply(self, method: str, path: str, headers: Any, body: bytes) -> Reply:  # pragma: no cover - overridden
        return 404, {}, b""

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _, _ in list(self.requests) if method is None or m == method]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GceServer(MetadataServer):
    """A GCE metadata server for one VM: ``state`` holds each key's value (None: 404); ``first_answer`` when
    each announcement was first read."""

    PREFIX = GCE_PREFIX

    def __init__(self, *, keep_requests: int | None = None) -> None:
        self.state: dict[str, Any] = {"maintenance-event": "NONE", "preempted": "FALSE", "upcoming-maintenance": None}
        self.first_answer: dict[tuple[str, str], float] = {}
        super().__init__(keep_requests=keep_requests)

    def reply(self, method: str, path: str, headers: Any, body: bytes) -> Reply:
        flavor = {"Metadata-Flavor": "Google", "Content-Type": "application/text"}
        if headers.get("Metadata-Flavor") != "Google":
            return 403, {"Content-Type": "text/html"}, b"Missing Metadata-Flavor:Google header."
        key = path.split("?")[0].removeprefix(self.PREFIX)
        if method != "GET" or not path.startswith(self.PREFIX) or key not in self.state:
            return 404, flavor, b"Not Found"
        value = self.state[key]
        if value is None:
            return 404, flavor, b"Not Found"
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        self.first_answer.setdefault((key, text), time.monotonic())
        return 200, flavor, text.encode()

    def announce(self, event: str = "TERMINATE_ON_HOST_MAINTENANCE", *, seconds: float | None = 60.0) -> float | None:
        """Announce host maintenance: with ``seconds``, first a window starting then (its start is the
        notice's deadline), then the ``maintenance-event`` value. Returns the window's start, or None."""
        start = None
        if seconds is not None:
            start = time.time() + seconds
            when = dt.datetime.fromtimestamp(start, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            self.state["upcoming-maintenance"] = {
                "type": "SCHEDULED", "maintenance_status": "PENDING", "can_reschedule": False,
                "window_start_time": when, "latest_window_start_time": when,
            }
        self.state["maintenance-event"] = event
        return start

    def withdraw(self) -> None:
        """The maintenance is over (or cancelled): every key back to its quiet value."""
        self.state["maintenance-event"] = "NONE"
        self.state["upcoming-maintenance"] = None
        self.state["preempted"] = "FALSE"


__all__ = ["GCE_PREFIX", "GceServer", "MetadataServer", "Reply"]
