"""One weight sync, run in the controller: the trainer's ``state_dict()`` to every rollout, in transfer, vote
and commit phases (docs/concepts.md, "One weight sync")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ftstate.controller.calls import name_all
from ftstate.controller.causes import root_cause
from ftstate.controller.membership import GROUP, Member, walk_proven
from ftstate.controller.parts import ControllerParts, Part
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import (
    ChecksumMismatch,
    HeldWeightsMismatch,
    MemberLost,
    NoServingWorkers,
    SyncTimeout,
)
from ftstate.core.plan import COLLECTIVE, Endpoint, Plan, SharedMemoryMode, plan_transfer
from ftstate.core.protocol import Abandon, Commit, Discard, ReceiveWeights, Request, SendWeights, Sent, Staged


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What one ``sync()`` did. ``nbytes`` is bytes sent per receiver; ``stale`` lists rollouts whose held
    checksum differed after loading; ``routes`` says how each got it (``shm``, ``collective``, ``relay``;
    :mod:`ftstate.core.plan`); ``pending`` lists in-flight rollouts that load it at their next safe point."""

    weights_version: int
    checksum: str
    nbytes: int
    seconds: float
    failovers: int
    group_version: int
    rollouts: tuple[str, ...]
    stale: tuple[str, ...] = ()
    routes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    shm_fallback: str | None = None
    pending: tuple[str, ...] = ()
    #: Weight bytes copied to host memory on this sync's path, hashing included (0: stayed on GPUs).
    host_bytes: int = 0
    #: Transport memory beside the rollouts' own weights, in bytes: each rollout's peak during the
    #: sync, the same summed per node (with node copies), and what each keeps after it.
    staging_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    node_staging_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    held_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Device memory each rollout that loads by parts took for its two buckets (absent: loaded whole).
    device_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: ``staging: node``: the node copy this sync committed on each node (empty with private staging).
    node_copies: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)


def memory_fields(rollouts: Sequence[Member], staging: Mapping[str, int], held: Mapping[str, int],
                  device: Mapping[str, int] | None = None,
                  node_copies: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The memory fields of a :class:`SyncReport` (and of ``sync_done``) from what each rollout reported."""
    nodes: dict[str, int] = dict(node_copies or {})
    for m in rollouts:
        if m.name in staging:
            key = m.node_id or m.node or "?"
            nodes[key] = nodes.get(key, 0) + staging[m.name]
    loaded = {m.name for m in rollouts}
    return {"staging_bytes": dict(staging), "node_staging_bytes": nodes, "held_bytes": dict(held),
            "device_bytes": {n: b for n, b in (device or {}).items() if n in loaded}}


def memory_record(memory: Mapping[str, Any]) -> dict[str, Any]:
    """The memory fields of the group's ``sync_done`` record, from :func:`memory_fields`'s."""
    device = memory["device_bytes"]
    return {"peak_staging_bytes": max(memory["staging_bytes"].values(), default=0),
            "node_staging_bytes": memory["node_staging_bytes"],
            **({"peak_device_bytes": max(device.values()), "device_bytes": dict(device)} if device else {})}


def device_field(nbytes: int | None) -> dict[str, int]:
    """The ``device_bytes`` field of a record of a load by parts (None for a load whole)."""
    return {} if nbytes is None else {"device_bytes": int(nbytes)}


def plan_for(config: RuntimeConfig, sender: Member, receivers: Sequence[Member],
             shared_memory: SharedMemoryMode | None = None) -> Plan:
    """The route plan from ``sender`` to ``receivers`` under ``shared_memory`` (default: the config's)."""
    return plan_transfer(Endpoint(sender.name, sender.rank, sender.node_id),
                         [Endpoint(m.name, m.rank, m.node_id) for m in receivers],
                         shared_memory or config.shared_memory)


class WeightSync(Part):
    """Runs sync attempts for one runtime. routing_open: cleared while rollouts commit (no
    call reaches half-loaded weights). raise_if_failed: raises the run's failure, if any."""

    def __init__(self, parts: ControllerParts, *, routing_open: asyncio.Event,
                 raise_if_failed: Callable[[], None]) -> None:
        super().__init__(parts)
        self.routing_open = routing_open
        self.raise_if_failed = raise_if_failed
        # Members whose calls of the current transfer failed, in the order they failed.
        self._arrival: list[str] = []
        #: The last attempt's failures by member, cause first (the retry policy reads it).
        self.failures: dict[str, BaseException] = {}
        #: Bytes each rollout's transport keeps after the last commit (SyncReport.held_bytes).
        self.held_bytes: dict[str, int] = {}
        #: Device bytes of each rollout's last load by parts (SyncReport.device_bytes).
        self.device_bytes: dict[str, int] = {}
        #: rollouts that committed the version being synced but load it at their next safe point
        self.pending: list[str] = []

    async def attempt(self) -> SyncReport:
        """One try at the next weights version; see the module docstring."""
        ms = self.membership
        group = ms.group
        t0, previous, previous_checksum = self._opening()
        target = previous + 1
        trainer = ms.trainer()
        rollouts = await self._begin([trainer], target, lambda rs: plan_for(self.config, trainer, rs).record())
        plan = plan_for(self.config, trainer, rollouts)  # pure: the plan sync_start recorded
        timeout = self.config.sync_timeout_s
        copies = self.node_copies
        owner: int | None = None
        relaying: dict[str, int] = {}  # relay name -> its node agent's pid (staging: node)
        staging: dict[str, int] = {}
        node_copies: dict[str, dict[str, Any]] = {}
        had_copy = set(copies.committed) if copies is not None else set()  # nodes that keep one meanwhile
        try:
            async with group.deadline_scope():
                if copies is not None:  # staging: node, on the trainer's node and every relay's
                    owner, relaying = await self._node_copy_owners(trainer, rollouts, plan)
                # the same-host route only where the plan has a rollout read shared memory
                send = SendWeights(target, timeout, same_host=tuple(plan.same_host_ranks),
                                   require_shm=plan.require_shm,
                                   relays=tuple((r, tuple(p)) for r, p in plan.relay_ranks),
                                   node_copy_owner=owner, node_copy_spare=self.config.node_copy_spare,
                                   ) if plan.uses_shm else SendWeights(target, timeout)
                results = await self._transfer(
                    [trainer, *rollouts],
                    [send, *(ReceiveWeights(target, 0, timeout, planned=plan.uses_shm,
                                            node_copy_owner=relaying.get(m.name)) for m in rollouts)])
                failures = self._failures([trainer, *rollouts], results)
                sent: dict[str, Any] = {}
                if not failures:
                    sent = results[0]
                    staged = {m.name: r for m, r in zip(rollouts, results[1:], strict=True)}
                    staging = {n: r.staging_bytes for n, r in staged.items()}
                    torn = [n for n, r in staged.items() if r.checksum != sent.checksum]
                    if torn:
                        failures = {n: ChecksumMismatch(
                            f"{n} staged weights version {target} with checksum {staged[n].checksum}, "
                            f"the trainer sent {sent.checksum}") for n in torn}
                if failures:
                    # nobody loaded it: its node copies go, the committed ones stay
                    await self._node_copies_failed(trainer, rollouts, owner, relaying)
                    await self._abort(trainer, rollouts, previous, failures)
                    raise next(iter(failures.values()))
                ms.current(target, sent.checksum)  # the vote: current from here on
                if owner is not None:
                    await self._keep_node_copy(trainer.node_id, sent, target, sent.checksum, node_copies)
                elif copies is not None:
                    await copies.forget(trainer.node_id)  # staged privately this time: an older copy there goes
                for m in rollouts:
                    if m.name in relaying:
                        await self._keep_node_copy(m.node_id, staged[m.name], target, sent.checksum, node_copies)
                not_loaded = await self._commit(trainer, rollouts, target, sent.checksum)
                self.raise_if_failed()  # a death during the commit with fault tolerance off
        except SyncTimeout:
            ms.current(previous, previous_checksum)
            await self._node_copies_failed(trainer, rollouts, owner, relaying)
            raise
        routes = {m.name: sent.routes.get(m.rank, COLLECTIVE) for m in rollouts}
        if sent.shm_fallback:
            self.audit.record("shm_fallback", reason=sent.shm_fallback,
                              members=[n for n in plan.routes if routes[n] != plan.routes[n]])
        ms.committed(target, sent.checksum)
        memory = memory_fields([m for m in rollouts if m.name not in not_loaded], staging, self.held_bytes,
                               self.device_bytes,
                               {n: c["nbytes"] * (2 if n in had_copy else 1) for n, c in node_copies.items()})
        await group.fire("sync_done", checksum=sent.checksum, nbytes=sent.nbytes, **memory_record(memory),
                         host_bytes=sent.host_bytes + sum(r.host_bytes for r in staged.values()),
                         **({"pending": list(self.pending)} if self.pending else {}),
                         **({"node_copy_bytes": {n[:8]: c["nbytes"] for n, c in node_copies.items()}}
                            if node_copies else {}))
        # A held-weights mismatch is that rollout's engine's fault: STALE, reported in ``stale``.
        user_errors = {n: e for n, e in not_loaded.items() if not isinstance(e, (MemberLost, HeldWeightsMismatch))}
        if user_errors:
            # Committed on the others; the caller still hears of every rollout whose own load_weights raised.
            raise name_all(list(user_errors.values()), list(user_errors))
        return SyncReport(
            weights_version=target,
            checksum=sent.checksum,
            nbytes=sent.nbytes,
            seconds=asyncio.get_running_loop().time() - t0,
            failovers=0,
            group_version=group.group_version,
            rollouts=tuple(m.name for m in rollouts if m.name not in not_loaded),
            stale=tuple(n for n, e in not_loaded.items() if isinstance(e, HeldWeightsMismatch)),
            routes={n: how for n, how in routes.items() if n not in not_loaded},
            shm_fallback=sent.shm_fallback or None,
            pending=tuple(n for n in self.pending if n not in not_loaded),
            host_bytes=sent.host_bytes + sum(r.host_bytes for r in staged.values()),
            node_copies=node_copies,
            **memory,
        )

    async def _node_copy_owners(self, trainer: Member, rollouts: Sequence[Member],
                                plan: Plan) -> tuple[int | None, dict[str, int]]:
        """``staging: node``: the pid of the agent owning the trainer's node's copy and each relay's (None
        where no copy is wanted: a lone rollout whose engine holds its weights stages privately)."""
        copies = self.node_copies
        assert copies is not None
        lone_holder = len(plan.same_host_ranks) == 1 and all(
            m.holds_weights for m in rollouts if m.rank in plan.same_host_ranks)
        owner = await copies.owner(trainer.node_id) if plan.same_host_ranks and not lone_holder else None
        relaying: dict[str, int] = {}
        for m in rollouts:
            if m.name in plan.relays:
                pid = await copies.owner(m.node_id)
                if pid is not None:
                    relaying[m.name] = pid
        return owner, relaying

    async def _node_copies_failed(self, trainer: Member, rollouts: Sequence[Member], owner: int | None,
                                  relaying: Mapping[str, int]) -> None:
        """A sync attempt failed: on each node that had a node copy made, only the committed one stays."""
        if self.node_copies is None:
            return
        nodes = [trainer.node_id] if owner is not None else []
        nodes += [m.node_id for m in rollouts if m.name in relaying]
        for node in dict.fromkeys(nodes):
            await self.node_copies.failed_on(node)

    async def _keep_node_copy(self, node: str | None, result: Sent | Staged, target: int, checksum: str,
                              kept: dict[str, dict[str, Any]]) -> None:
        """The vote passed: the node copy on ``node`` becomes that node's source for newcomers and goes into
        ``kept``; other copies there go, but the writer's spare."""
        copies = self.node_copies
        assert copies is not None and node is not None
        name = result.node_copy
        spare = result.node_spare if isinstance(result, Sent) else None
        if name:
            await copies.committed_on(node, name, group=GROUP, weights_version=target, checksum=checksum,
                                      spare=spare)
            size = result.node_copy_size
            kept[node] = {"segment": name, "nbytes": size.nbytes if size else 0,
                          "recycled": bool(size and size.recycled)}
            self.audit.record("node_copy_committed", node=node[:8], segment=name, weights_version=target,
                              nbytes=result.nbytes, spare=spare,
                              copy_bytes=kept[node]["nbytes"], recycled=kept[node]["recycled"])
        else:
            await copies.forget(node)

    def _opening(self) -> tuple[float, int, str | None]:
        """An attempt's start (the loop's clock: virtual in a simulation), the version and checksum it
        replaces; the last attempt's failures are forgotten."""
        self.failures = {}
        return asyncio.get_running_loop().time(), self.membership.group.weights_version, self.membership.checksum

    async def _begin(self, senders: Sequence[Member], target: int,
                     plan: Callable[[list[Member]], dict[str, object]]) -> list[Member]:
        """Open the attempt at ``target``: senders must be READY and some rollout able to receive; fires
        ``sync_start`` and the members' edges. Returns the receiving rollouts."""
        ms = self.membership
        group = ms.group
        # Never a transfer under a version that was abandoned or never completed.
        await self.formation.ensure_formed()
        for s in senders:
            if s.machine.state != "READY":
                raise MemberLost(s.name, f"cannot send weights from state {s.machine.state}",
                                 group_version=group.group_version)
        rollouts = [m for m in ms.role("rollout") if m.machine.state in ("READY", "STALE")]
        if not rollouts:
            raise NoServingWorkers(f"no rollout can receive weights version {target}: {ms.states_text()}")
        # Until committed, the group's (and routing's) current version stays the previous one.
        await group.fire("sync_start", for_version=target, rollouts=[m.name for m in rollouts], plan=plan(rollouts))
        for s in senders:
            await s.machine.fire("sync")
        for m in rollouts:
            await m.machine.fire("sync" if m.machine.state == "READY" else "resync")
        group.describe_wait(f"weight sync to version {target}", missing=[m.name for m in [*senders, *rollouts]])
        return rollouts

    async def _transfer(self, members: Sequence[Member], requests: Sequence[Request]) -> list[Any]:
        """Run one transfer's calls (``requests[i]`` to ``members[i]``); results or exceptions in order. On
        the first failure (other than a checksum mismatch) the others are told to abandon, since a collective
        with a dead member does not reliably fail on the rest; the caller replaces the group version. Ends are
        taken as they come, so n trickling answers cost O(n), not O(n²)."""
        loop = asyncio.get_running_loop()
        ended = [False] * len(members)
        first_failure: asyncio.Future[tuple[int, BaseException]] = loop.create_future()
        self._arrival = []

        def on_end(i: int, outcome: Any) -> None:
            ended[i] = True
            if not isinstance(outcome, BaseException):
                return
            self._arrival.append(members[i].name)
            if not isinstance(outcome, ChecksumMismatch) and not first_failure.done():
                first_failure.set_result((i, outcome))

        fanned = self._fan_out(members, requests, on_end)
        every: asyncio.Future[list[Any]] = asyncio.ensure_future(fanned)
        try:
            await asyncio.wait([every, first_failure], return_when=asyncio.FIRST_COMPLETED)
            if first_failure.done() and not every.done():
                failed, exc = first_failure.result()
                reason = f"{members[failed].name} failed: {type(exc).__name__}"
                others = [m for m, e in zip(members, ended, strict=True) if not e]
                self.audit.record("transfer_abandoned", reason=reason, members=[m.name for m in others])
                await self._to_each(others, Abandon(reason))
            return await every
        except asyncio.CancelledError:  # the state's deadline: the calls go with it
            every.cancel()
            raise
        finally:
            if not first_failure.done():
                first_failure.cancel()

    def _fan_out(self, members: Sequence[Member], requests: Sequence[Request],
                 on_end: Callable[[int, Any], None] | None = None) -> Any:
        """:meth:`~ftstate.controller.calls.ActorCalls.fan_out` to ``members``: outcomes in order."""
        return self.calls.fan_out(members, requests, on_end)

    def _to_each(self, members: Sequence[Member], req: Request,
                 on_end: Callable[[int, Any], None] | None = None) -> Any:
        """The same request to each of ``members``, at once (:meth:`_fan_out`)."""
        return self._fan_out(members, [req] * len(members), on_end)

    def _failures(self, members: Sequence[Member], results: Sequence[Any]) -> dict[str, BaseException]:
        out: dict[str, BaseException] = {}
        for m, r in zip(members, results, strict=True):
            if isinstance(r, BaseException):
                if isinstance(r, asyncio.CancelledError):
                    raise r
                out[m.name] = r
        self.failures = root_cause(out, self._arrival)
        return self.failures

    async def _abort(
        self, trainer: Member, rollouts: Sequence[Member], previous: int, failures: Mapping[str, BaseException],
        *, senders: Sequence[Member] = (),
    ) -> None:
        """Nobody committed: survivors keep ``previous`` as current (``senders``: other trainer ranks)."""
        group = self.membership.group
        for m in [trainer, *rollouts]:
            if m.gone:
                continue
            if m.role == "rollout":
                with contextlib.suppress(MemberLost):  # died meanwhile: nothing to discard
                    await self.calls.call(m.name, m.handle, Discard())
            err = failures.get(m.name)
            if m.machine.state == "SYNCING":
                await m.machine.fire("sync_aborted", reason=str(err) if err else "sync aborted")
            elif m.machine.state == "RESYNCING":
                await m.machine.fire("resync_failed", reason=str(err) if err else "sync aborted")
        group.now_holds(previous)
        first = next(iter(failures.items()))
        if group.state == "SYNCING":
            await group.fire("sync_failed", reason=f"{first[0]}: {type(first[1]).__name__}: {first[1]}")
        if any(not isinstance(e, ChecksumMismatch) for e in failures.values()):
            # The abandoned version cannot carry another transfer; whoever goes next forms the next one,
            # since an unreachable member's verdict is the watchdog's (a checksum mismatch leaves it usable).
            first_name, first_err = next(iter(failures.items()))
            self.formation.spoil(f"transfer of weights version {previous + 1} abandoned: "
                                 f"{first_name}: {type(first_err).__name__}")

    async def _commit(
        self, trainer: Member, rollouts: Sequence[Member], version: int, checksum: str
    ) -> dict[str, BaseException]:
        """Hand the staged version to every rollout's ``load_weights``; returns those whose commit failed
        (STALE or LOST) while the others serve ``version``."""
        self.routing_open.clear()
        self._arrival = []
        try:
            results = await self._to_each(rollouts, Commit(version))
        finally:
            self.routing_open.set()
        failed = self._failures(rollouts, results)
        held: dict[str, str] = {}
        self.held_bytes, self.device_bytes = {}, {}
        self.pending = []
        for m, r in zip(rollouts, results, strict=True):
            if m.name in failed:
                continue
            if r.deferred:
                # busy in a call: it loads the version at its next safe point (the watchdog sees it)
                m.pending_version, m.pending_since = version, asyncio.get_running_loop().time()
                self.pending.append(m.name)
                continue
            held[m.name] = r.checksum
            self.held_bytes[m.name] = r.held_bytes
            if r.device_bytes is not None:  # loaded by parts through device buckets
                self.device_bytes[m.name] = r.device_bytes
            if r.checksum != checksum:
                # What it holds after load_weights is not what was verified: never serve it.
                failed[m.name] = HeldWeightsMismatch(m.name, weights_version=version, held=r.checksum,
                                                     expected=checksum, what="at commit")
        for m in rollouts:
            if m.name in failed:
                if m.gone:
                    continue
                trigger = "sync_failed" if m.machine.state == "SYNCING" else "resync_failed"
                err = failed[m.name]
                extra = ({"checksum": err.held, "expected_checksum": err.expected, "error": err}
                         if isinstance(err, HeldWeightsMismatch) else {})
                await m.machine.fire(trigger, reason=f"commit of weights version {version} failed: {err}", **extra)
                continue
            if m.name in self.pending:
                await self._defer(m, version)
                continue
            m.machine.now_holds(version)
            m.pending_version = None
            # Each member's own checksum, and a load by parts' device bytes, go on its record.
            device = device_field(self.device_bytes.get(m.name))
            if m.machine.state == "SYNCING":
                await m.machine.fire("committed", checksum=held[m.name], **device)
            elif m.machine.serving:
                # Re-admitted by the watchdog on its earlier version during the sync: record what it holds
                # now.
                m.machine.record("weights_loaded", checksum=held[m.name], **device)
            else:
                # Brought up to date, or moved by the watchdog meanwhile: its load is proven, walk it to
                # READY.
                await walk_proven(m.machine, "READY", checksum=held[m.name], **device)
        trainer.machine.now_holds(version)
        if trainer.machine.state == "SYNCING":
            await trainer.machine.fire("committed", checksum=checksum)
        elif not trainer.gone:
            # Suspect, or re-admitted after waiting on a hung peer: the watchdog settles it (no edge here).
            trainer.machine.record("weights_sent", checksum=checksum)
        return failed

    async def _defer(self, m: Member, version: int) -> None:
        """``m`` committed ``version`` while busy in a call: it loads it at the call's next safe point."""
        if m.machine.state == "SYNCING":
            await m.machine.fire("committed", swap_pending=version)
        else:
            m.machine.record("swap_pending", swap_pending=version)
