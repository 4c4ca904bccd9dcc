"""Ray maintenance watcher, run on the driver: the nodes the cluster is draining, asked of the GCS with one
bounded RPC through the backend, each a ``drain`` notice (docs/operations.md, "What each maintenance source
reads")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from ftstate.controller.maintenance.base import Notice, PollProblem, PollResult

DrainingNodes = Callable[[float], Mapping[str, int]]


def parse_draining(draining: object, *, where: str = "gcs.get_draining_nodes") -> list[Notice] | PollProblem:
    """``{node_id_hex: deadline_ms}`` (0 = no deadline) as ``drain`` notices, one per node."""
    if not isinstance(draining, Mapping):
        return PollProblem("ray", where, "malformed", f"expected a mapping of node ids to deadlines, got {draining!r}")
    notices = []
    for node, deadline_ms in sorted(draining.items()):
        if not isinstance(node, str) or not node or isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int):
            return PollProblem("ray", where, "malformed", f"bad entry {node!r}: {deadline_ms!r}")
        deadline = deadline_ms / 1000.0 if deadline_ms > 0 else None
        notices.append(Notice("ray", "drain", deadline=deadline, node=node, raw=f"ray drain deadline_ms={deadline_ms}"))
    return notices


def _no_cluster(timeout: float) -> Mapping[str, int]:
    raise RuntimeError("no cluster to ask for its draining nodes (RayDrainWatcher built without draining=)")


class RayDrainWatcher:
    """Polls the GCS for draining nodes, one RPC bounded by ``timeout``; ``draining``: how to ask (None: every
    poll a problem that says so)."""

    source = "ray"

    def __init__(self, *, timeout: float, draining: DrainingNodes | None = None) -> None:
        self.timeout = timeout
        self.draining = draining if draining is not None else _no_cluster

    @property
    def bound_s(self) -> float:
        return self.timeout

    def poll(self) -> PollResult:
        t0 = time.monotonic()
        try:
            answer = self.draining(self.timeout)
        except Exception as exc:  # noqa: BLE001 - an RPC error, a lost GCS: a warning, never a crash
            return self._result(None, exc, round(time.monotonic() - t0, 3))
        return self._result(answer, None, round(time.monotonic() - t0, 3))

    @staticmethod
    def _result(answer: object, exc: BaseException | None, took: float) -> PollResult:
        where = "gcs.get_draining_nodes"
        if exc is not None:
            kind = "timeout" if "timeout" in type(exc).__name__.lower() or "timed out" in str(exc).lower() else "error"
            return PollResult("ray", (), (PollProblem("ray", where, kind, f"{type(exc).__name__}: {exc}", took),), took)
        parsed = parse_draining(answer, where=where)
        if isinstance(parsed, PollProblem):
            return PollResult("ray", (), (parsed.took(took),), took)
        return PollResult("ray", tuple(parsed), (), took)


class AsyncRayDrainWatcher(RayDrainWatcher):
    """The same, asking with a coroutine (the controller's backend): awaited on the controller's
    loop, timed by the loop's clock (virtual in a simulation), no thread."""

    def __init__(self, *, timeout: float, draining: Callable[[float], Awaitable[Mapping[str, int]]]) -> None:
        super().__init__(timeout=timeout)
        self.adraining = draining

    async def apoll(self) -> PollResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            answer = await self.adraining(self.timeout)
        except Exception as exc:  # noqa: BLE001 - as poll()
            return self._result(None, exc, round(loop.time() - t0, 3))
        return self._result(answer, None, round(loop.time() - t0, 3))
