"""Read by mypy only (``make typecheck``): the worker host implements every call of the protocol
with the request and reply types it declares, so a renamed, missing or mistyped method fails
the type check before anything runs. (The simulated member answers through handlers of another
shape; tests/unit/test_protocol.py holds it to the same protocol.)"""

from __future__ import annotations

from ftstate.core.protocol import WorkerAPI
from ftstate.worker.host import WorkerHost


def the_worker_host_speaks_the_protocol(host: WorkerHost) -> WorkerAPI:
    return host
