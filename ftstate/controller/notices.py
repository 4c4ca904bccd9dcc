"""From maintenance notices to drains, in the controller's runtime (``detect_node_maintenance``):
:class:`NoticeMonitor` runs the driver's watcher and one light watcher actor per node hosting members, records
what it runs, every notice, withdrawal and unreadable source (once per run of failures: a warning, never a
notice), hands notices to ``drain`` and withdrawals to ``withdraw``, and acknowledges an Azure event once its
node is drained."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ftstate.controller.backend import ClusterBackend
from ftstate.controller.maintenance import MaintenanceWatcher, Notice, PollProblem, watchers_for
from ftstate.controller.parts import ControllerParts, Part
from ftstate.core.config import RuntimeConfig


def watcher_call_s(config: RuntimeConfig) -> float:
    """The bound of one call to a node watcher: a metadata request's, plus the call's."""
    from ftstate.controller.maintenance.node_actor import ACTOR_CALL_S

    return config.fault_tolerance.maintenance_request_timeout_s + ACTOR_CALL_S


class NoticeMonitor(Part):
    """Maintenance watching for one runtime. drain(node_id, notice): drains a node (returns
    True when the node was drained); withdraw(node_id): undoes a drain still running;
    backend: the cluster the watchers are started on and ask (the runtime's)."""

    def __init__(self, parts: ControllerParts, *, drain: Callable[[str, Notice], Awaitable[bool]],
                 withdraw: Callable[[str], None], backend: ClusterBackend) -> None:
        super().__init__(parts)
        self.backend = backend
        self._drain = drain
        self._withdraw = withdraw
        self._runner: MaintenanceWatcher | None = None
        self._task: asyncio.Task[None] | None = None
        self._actors: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._draining: set[str] = set()

    async def start(self) -> None:
        ft = self.config.fault_tolerance
        detection, watchers = watchers_for(ft, include=("ray",),  # the rest run on each node
                                           ray_draining=self.backend.draining_nodes)
        self.audit.record("maintenance_sources", place="controller", **detection.fields())
        self._runner = MaintenanceWatcher(watchers, interval=ft.maintenance_check_interval,
                                          on_notice=self._on_notice, on_withdrawn=self._on_withdrawn,
                                          on_problem=self._on_problem, on_recovered=self._on_recovered)
        await self.watch_nodes()
        self._task = asyncio.get_running_loop().create_task(self._runner.run())

    async def watch_nodes(self) -> None:
        """Start a node watcher on every node that hosts members and has none yet."""
        if self._runner is None:
            return
        from ftstate.controller.maintenance.node_actor import NodeWatcherActor, actor_watchers

        ft = self.config.fault_tolerance
        nodes = {m.node_id for m in self.membership if not m.gone and m.node_id} - set(self._actors)
        for node in sorted(nodes):
            handle = self.backend.start_node_watcher(node, NodeWatcherActor.options_from(ft))
            self._actors[node] = handle
            try:
                detection, watchers = await actor_watchers(self.backend, handle, self.config.init_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a node watcher that cannot start is a warning, not a crash
                self.audit.record("maintenance_problem", node=node, reason=f"node watcher did not start: "
                                  f"{type(exc).__name__}: {exc}")
                continue
            self.audit.record("maintenance_sources", place="node", node=node, **detection.fields())
            self._runner.add(watchers)

    def _node_of(self, notice: Notice) -> str | None:
        """The Ray node id a notice concerns, when a member runs there (by id, else address)."""
        members = [m for m in self.membership if not m.gone and m.node_id]
        for m in members:
            if notice.node == m.node_id:
                return m.node_id
        by_address = {m.node for m in members if m.node}
        if notice.node in by_address and len({m.node_id for m in members if m.node == notice.node}) == 1:
            return next(m.node_id for m in members if m.node == notice.node)
        return None

    async def _on_notice(self, notice: Notice) -> None:
        node = self._node_of(notice)
        action = ("none: no member runs on that node" if node is None
                  else "covered by the drain of that node already under way" if node in self._draining
                  else "drain")
        self.audit.record("maintenance_notice", **notice.fields(), node_id=node, action=action)
        if action != "drain":
            return
        self._draining.add(node)
        task = asyncio.get_running_loop().create_task(self._drain_then_ack(node, notice))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain_then_ack(self, node: str, notice: Notice) -> None:
        try:
            drained = await self._drain(node, notice)
        finally:
            self._draining.discard(node)
        if drained and notice.source == "azure" and notice.event_id and node in self._actors:
            problem = await self.backend.call_helper(self._actors[node], "acknowledge", (notice.event_id,),
                                              watcher_call_s(self.config))
            self.audit.record("maintenance_acknowledged", node=node, event_id=notice.event_id,
                              problem=problem.message if isinstance(problem, PollProblem) else None)

    def _on_withdrawn(self, notice: Notice) -> None:
        node = self._node_of(notice)
        self.audit.record("maintenance_withdrawn", **notice.fields(), node_id=node)
        if node is not None:
            self._withdraw(node)

    def _on_problem(self, problem: PollProblem) -> None:
        self.audit.record("maintenance_problem", **problem.fields())

    def _on_recovered(self, label: str, failed_polls: int) -> None:
        self.audit.record("maintenance_recovered", source=label, failed_polls=failed_polls)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            self._runner.close()
        for handle in self._actors.values():
            with contextlib.suppress(Exception):  # already gone with its node
                self.backend.kill(handle, pid=None, node=None)
