"""Loopback metadata servers speaking each provider's protocol, for the maintenance watchers.

Every server binds 127.0.0.1 on a free port and runs in a daemon thread; ``url`` is its base
URL, ``requests`` what it received (method, path, headers, body), and its ``state`` what it
announces, changed by the test while it runs. They check what the real servers check:

- :class:`GceServer` (with :class:`MetadataServer`, the base of them all, in the package:
  ftstate/cli/demo/metadata_server.py, which the demo's maintenance scenario serves): refuses
  (403) a request without ``Metadata-Flavor: Google`` and sends that header back;
  ``maintenance-event``, ``preempted``, ``upcoming-maintenance`` (404 when none).
- :class:`AwsServer`: IMDSv2: ``PUT /latest/api/token`` needs the TTL header (400 without);
  each GET needs a token it issued and has not revoked (401 without); spot instance-action
  and rebalance are 404 until set; scheduled events a JSON list.
- :class:`AzureServer`: refuses (400) a request without ``Metadata: true``; Scheduled Events
  and the VM's name; records each acknowledgement POST's JSON body.
- :class:`FixedServer`: the same answer to everything (404, 500, garbage, a slow one).
- :class:`SilentServer`: accepts connections and never answers; :class:`DripServer` sends its
  headers, then one byte of body every ``every`` seconds, forever.
- :func:`closed_port`: a port nothing listens on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

# The base server and the GCE one live in the package: the demo's maintenance scenario serves them.
from ftstate.cli.demo.metadata_server import GceServer, MetadataServer, Reply

__all__ = ["AwsServer", "AzureServer", "DripServer", "FixedServer", "GceServer", "MetadataServer", "Reply",
           "SilentServer", "closed_port"]


class AwsServer(MetadataServer):
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"spot": None, "rebalance": None, "scheduled": []}
        self.tokens: set[str] = set()
        self.token_ttls: list[str] = []
        super().__init__()

    def revoke_tokens(self) -> None:
        self.tokens.clear()

    def reply(self, method: str, path: str, headers: Any, body: bytes) -> Reply:
        if path == "/latest/api/token":
            if method != "PUT":
                return 405, {}, b""
            ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if not ttl or not ttl.isdigit():
                return 400, {}, b"Missing or invalid TTL header"
            token = uuid.uuid4().hex
            self.tokens.add(token)
            self.token_ttls.append(ttl)
            return 200, {"X-aws-ec2-metadata-token-ttl-seconds": ttl}, token.encode()
        if headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return 401, {}, b"Unauthorized"
        routes = {
            "/latest/meta-data/spot/instance-action": "spot",
            "/latest/meta-data/events/recommendations/rebalance": "rebalance",
            "/latest/meta-data/events/maintenance/scheduled": "scheduled",
        }
        key = routes.get(path)
        if method != "GET" or key is None or self.state[key] is None:
            return 404, {}, b"Not Found"
        return 200, {"Content-Type": "text/plain"}, json.dumps(self.state[key]).encode()


class AzureServer(MetadataServer):
    EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"

    def __init__(self, vm_name: str = "vm-a") -> None:
        self.state: dict[str, Any] = {"DocumentIncarnation": 1, "Events": []}
        self.vm_name = vm_name
        self.acknowledged: list[Any] = []
        super().__init__()

    def reply(self, method: str, path: str, headers: Any, body: bytes) -> Reply:
        if headers.get("Metadata") != "true":
            return 400, {"Content-Type": "application/json"}, b'{"error": "Bad request. Required metadata header not specified"}'
        if path.startswith("/metadata/instance/compute/name"):
            return 200, {"Content-Type": "text/plain"}, self.vm_name.encode()
        if path != self.EVENTS:
            return 404, {}, b""
        if method == "GET":
            return 200, {"Content-Type": "application/json"}, json.dumps(self.state).encode()
        if method == "POST":
            try:
                self.acknowledged.append(json.loads(body))
            except ValueError:
                return 400, {}, b""
            return 200, {}, b""
        return 405, {}, b""


class FixedServer(MetadataServer):
    """Answers every request with ``status`` and ``body`` (after ``delay`` seconds), with the
    given headers (e.g. ``Metadata-Flavor: Google``, so a GCE watcher reads the body)."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None, delay: float = 0.0) -> None:
        self.status, self.body, self.headers, self.delay = status, body, dict(headers or {}), delay
        super().__init__()

    def reply(self, method: str, path: str, headers: Any, body: bytes) -> Reply:
        if self.delay:
            time.sleep(self.delay)
        return self.status, self.headers, self.body


class _RawServer:
    """A listening socket on 127.0.0.1 served by ``serve(conn)`` in a thread per connection."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    @property
    def accepted(self) -> list[socket.socket]:
        """Every connection accepted so far (a request of urllib's is one)."""
        return list(self._conns)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for c in [self._sock, *self._conns]:
            with contextlib.suppress(OSError):
                c.close()

    def __enter__(self) -> _RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SilentServer(_RawServer):
    """Accepts, reads the request, never answers."""

    def __init__(self) -> None:
        def serve(conn: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while conn.recv(4096) and not self._stop.is_set():
                    pass

        super().__init__(serve)


class DripServer(_RawServer):
    """Answers 200 with a long Content-Length, then one body byte every ``every`` seconds."""

    def __init__(self, every: float = 0.05) -> None:
        def serve(conn: socket.socket) -> None:
            with contextlib.suppress(OSError):
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Length: 100000\r\n\r\n")
                while not self._stop.is_set():
                    conn.sendall(b"N")
                    time.sleep(every)

        super().__init__(serve)


def closed_port() -> str:
    """The URL of a loopback port nothing listens on (bound, then closed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
