"""``FTStateCheckpointEngine``: ftstate's transport inside verl's checkpoint-engine protocol.

verl calls, on **every** ``update_weights`` (``CheckpointEngineManager``): ``prepare()`` on
each worker → :meth:`FTStateCheckpointEngine.build_topology` in the driver → each worker's
``init_process_group(**kwargs)`` → the trainer ranks' ``send_weights(generator)`` while each
rollout worker iterates ``receive_weights()`` → ``finalize()`` everywhere. Here that becomes:

* **the store in the driver.** ``build_topology`` runs in the driver process, which outlives
  every worker: it hosts the run's :class:`~ftstate.transport.store.StoreServer` (one per
  address, started on first use) and issues a new **group version** per update. Forming
  version N fences every older one (:mod:`ftstate.transport.store`): a straggler of an
  abandoned update gets ``StaleGroupVersion`` at once, never a half-formed group.
* **bounded init.** ``init_process_group`` is :func:`~ftstate.transport.create_communicator`
  bounded by ``init_timeout_s`` (env ``FTSTATE_INIT_TIMEOUT_S``): a member that never joins
  makes every member that did raise :class:`~ftstate.core.errors.RendezvousTimeout` naming
  it by verl role, pid and node — verl's silent hang (its issue 6967) becomes an error.
* **ranks.** Trainer rank 0 sends (group rank 0); rollout workers are group ranks 1..R in
  verl's order. Other trainer ranks get rank -1 and stay out of the group, but still walk the
  generator to its end: with FSDP every tensor is produced by a collective across the
  trainer ranks, so a rank that stopped would hang the others. Rank 0 keeps walking it too
  after a failed transfer, then raises.
* **the stream.** The generator is cut into chunks of about ``bucket_size`` bytes. Each chunk
  is one complete ftstate transfer (:class:`~ftstate.transport.Sender` /
  :class:`~ftstate.transport.Receiver`: manifest, buckets, checksums, commit vote), framed by
  a small header broadcast (``[magic, kind, sequence]``) saying "a chunk follows" or "the
  update ended"; while chunk k is on the wire (in a thread: the actor keeps answering) the
  generator produces chunk k+1. After the last chunk every member votes once
  (``allgather``): the sender learns which rollouts rejected anything and raises
  :class:`~ftstate.core.errors.ChecksumMismatch` naming them.
* **commit modes** (``commit_mode``). ``stream`` (default): a rollout yields a chunk's tensors
  once that chunk verified, as verl's engines stream buckets; a chunk that fails its checksum
  is never yielded, and nothing after it is (the rollout keeps draining the stream so the group
  stays aligned, then raises). ``staged``: a rollout yields nothing until the final vote says
  every chunk verified on every rollout, and the update is held **once per node** meanwhile
  (:mod:`ftstate.integrations.verl.nodestage`): ``build_topology`` makes the first rollout of
  each node (by Ray node id) its writer, the only one of the node in the group; it receives each
  chunk straight into a segment in ``/dev/shm``, verifies it there, and publishes the vote's
  outcome; the node's
  other rollouts (rank -1, out of the group) wait for it, bounded by ``sync_timeout_s``, map
  the segments read-only, re-verify them, and yield views of them. A failed update (a chunk
  rejected anywhere, a member dead) leaves every rollout having yielded nothing. A rollout alone
  on its node holds the update in its own staging, as before (one copy, on that node).

The yielded tensors are views into the receiver's staging buffer (``staged`` with followers:
into the node's segments, mapped privately; the mapping outlives the names); a buffer is reused only
once nothing outside the receiver references it, so a server adapter may keep them.
Tensors from the generator are sent from their own memory where a chunk is one tensor
(not copied); the generator must not overwrite a tensor it already yielded during the update
(FSDP's and Megatron's per-tensor generators yield fresh tensors).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ftstate.core.errors import (
    ChecksumMismatch,
    ConfigError,
    FTError,
    ManifestError,
    PeerLost,
    RendezvousTimeout,
    SyncTimeout,
    TransportError,
)
from ftstate.integrations.verl import nodestage
from ftstate.integrations.verl.settings import EngineSettings
from ftstate.transport import Receiver, Sender, StoreServer, create_communicator
from ftstate.transport.base import Communicator
from ftstate.transport.shm import pid_alive

log = logging.getLogger("ftstate.integrations.verl")

#: The registry name (``checkpoint_engine.backend: ftstate``).
BACKEND = "ftstate"

#: First word of a frame header ("ftvf").
FRAME_MAGIC = 0x66747666
FRAME_CHUNK = 1
FRAME_END = 2

#: Final vote values (``_LOST``: a node writer whose follower died before the vote, so the
#: update cannot reach every rollout and none applies it, as when a rollout in the group dies).
_OK = 0
_REJECTED = 1
_LOST = 2

# -- the driver's store -----------------------------------------------------------------------

_STORES: dict[str, StoreServer] = {}
_ISSUED: dict[str, int] = {}
_STORES_LOCK = threading.Lock()


def _ray_node_address() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


def driver_store(host: str | None = None) -> StoreServer:
    """The store hosted by this (driver) process for ``host`` (the driver's Ray address by
    default), started on first use and kept for the life of the process."""
    host = host or _ray_node_address()
    with _STORES_LOCK:
        server = _STORES.get(host)
        if server is None:
            server = _STORES[host] = StoreServer(host)
        return server


def issue_version(server: StoreServer, group: str) -> int:
    """The next group version of ``group``: above every version formed, fenced or issued."""
    with _STORES_LOCK:
        current = server.current_version(group) or 0
        version = max(current, _ISSUED.get(group, 0)) + 1
        _ISSUED[group] = version
        return version


def driver_key() -> tuple[str, bytes]:
    """The run id and secret of this (driver) process (``security.authenticate``): made on the
    first update (:func:`ftstate.transport.auth.new_secret`) and installed here too, since the
    driver reads the store values the workers sign (the current group version), then handed to
    the workers with their topology through verl's own Ray calls, never ftstate's sockets. A
    key already installed in this process is the one used: a process holds one run's key."""
    from ftstate.transport import auth

    with _STORES_LOCK:
        key = auth.current()
        if key is None:
            auth.install(f"verl-{os.getpid()}", auth.new_secret())
            key = auth.current()
        assert key is not None
        return key.run, key.secret


def _member_name(role: str, index: int, meta: Mapping[str, Any]) -> str:
    return f"{role} {index} (pid {meta.get('pid', '?')} on {meta.get('host', '?')})"


def _node_id() -> str:
    """This process's node: its Ray node id (several Ray nodes may share an address), else the
    host name (no Ray: the engine built in a plain process)."""
    import socket

    import ray

    if ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return socket.gethostname()


def _stages(rollouts: list[Mapping[str, Any]]) -> tuple[list[int], list[dict[str, Any] | None]]:
    """The group rank and the node role of each rollout. A ``staged`` rollout (its own
    ``commit_mode``: it decides how it yields) that is the first staged one of its node writes
    the node's copy (a group rank); the node's other staged ones follow it (rank -1). A
    ``stream`` rollout has a group rank and no node role."""
    writers: dict[str, tuple[int, str, int]] = {}
    ranks: list[int] = []
    stages: list[dict[str, Any] | None] = []
    followers: dict[str, list[dict[str, Any]]] = {}
    next_rank = 1
    for i, meta in enumerate(rollouts):
        node = str(meta.get("node") or meta.get("host") or "?")
        name = _member_name("rollout worker", i, meta)
        if meta.get("commit_mode") != "staged":
            ranks.append(next_rank)
            stages.append(None)
            next_rank += 1
        elif node not in writers:
            writers[node] = (next_rank, name, int(meta.get("pid", 0)))
            ranks.append(next_rank)
            next_rank += 1
            stages.append({"role": "writer", "name": name, "node": node})
        else:
            followers.setdefault(node, []).append({"name": name, "pid": int(meta.get("pid", 0))})
            _, writer, pid = writers[node]
            ranks.append(-1)
            stages.append({"role": "follower", "name": name, "node": node, "writer": writer, "writer_pid": pid})
    for stage in stages:
        if stage is not None and stage["role"] == "writer":
            stage["followers"] = followers.get(stage["node"], [])
    return ranks, stages


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


@CheckpointEngineRegistry.register(BACKEND)
class FTStateCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over ftstate's transport (see the module docstring).

    ``bucket_size``: bytes per chunk (verl passes ``update_weights_bucket_megabytes << 20``);
    ``is_master``: trainer rank 0 (verl's trainer side sets it); ``**settings``: the
    ``engine_kwargs.ftstate`` block (:class:`~ftstate.integrations.verl.settings.EngineSettings`).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **settings: Any) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise TransportError(f"FTStateCheckpointEngine: field 'bucket_size': {bucket_size!r}, expected bytes > 0")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.settings = EngineSettings.from_kwargs(settings)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.group_version: int | None = None
        self.members: list[str] = []
        self.updates = 0
        self.last_report: dict[str, Any] = {}
        self._comm: Communicator | None = None
        self._sender = Sender(bucket_size=bucket_size) if is_master else None
        self._receiver = Receiver()
        self._corrupt_at: int | None = None
        self._stall: tuple[int, threading.Event] | None = None
        self._stall_go = threading.Event()
        self._stall_s = 0.0
        self._stalled = False
        self._chunks_in = 0
        #: staged mode: this rollout's role on its node (build_topology's), and the writer's copy
        self._stage: dict[str, Any] | None = None
        self._writer: nodestage.StageWriter | None = None
        self._abandoned: str | None = None

    # -- verl's protocol ----------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """What ``build_topology`` needs from this worker: who it is, and (trainer rank 0)
        the settings every worker shares."""
        self._close("prepare of a new update")
        return {
            "pid": os.getpid(),
            "host": self.settings.device_host or _ray_node_address(),
            "node": _node_id(),
            "commit_mode": self.settings.commit_mode,
            "is_master": self.is_master,
            "settings": self.settings.to_kwargs() if self.is_master else None,
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Run in the driver: start its store if needed, issue the next group version, and
        give each worker its rank (trainer 0 → 0, other trainer ranks → -1, rollouts → 1..R;
        ``staged``: each node's first rollout → 1..N, its other rollouts → -1 with their
        writer named in ``stage``)."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise TransportError(
                f"build_topology: field 'metadata': {len(metadata)} entries, expected "
                f"{actor_wg_world_size} trainer + {rollout_world_size} rollout"
            )
        master = metadata[0]
        if not master.get("is_master"):
            raise TransportError(
                "build_topology: trainer rank 0 is not the engine's master (is_master=False): the trainer "
                "worker must build the engine with is_master=(rank == 0)"
            )
        settings = EngineSettings.from_kwargs(master["settings"])
        key = driver_key() if settings.runtime.security.authenticate else None
        store = driver_store(settings.store_host)
        version = issue_version(store, settings.group)
        rollouts = metadata[actor_wg_world_size:]
        ranks, stages = _stages(rollouts)
        in_group = [i for i, r in enumerate(ranks) if r > 0]
        world_size = 1 + len(in_group)
        members = [_member_name("trainer rank", 0, master)] + [
            _member_name("rollout worker", i, rollouts[i]) for i in in_group
        ]
        common: dict[str, Any] = {"store": str(store.address), "group": settings.group, "version": version,
                                  "members": members}
        if key is not None:
            common["run"], common["secret"] = key

        def each(n: int) -> dict[str, list[Any]]:
            return {k: [v] * n for k, v in {"world_size": world_size, **common}.items()}

        actor_kwargs = {"rank": [0] + [-1] * (actor_wg_world_size - 1), **each(actor_wg_world_size)}
        rollout_kwargs = {"rank": ranks, **each(rollout_world_size), "stage": stages}
        log.info("verl topology", extra={"group": settings.group, "group_version": version,
                                         "world_size": world_size, "trainer_ranks": actor_wg_world_size,
                                         "node_followers": rollout_world_size - len(in_group)})
        return actor_kwargs, rollout_kwargs

    def init_process_group(
        self, *, rank: int, world_size: int, store: str, group: str, version: int, members: list[str],
        run: str = "", secret: bytes | None = None, stage: dict[str, Any] | None = None,
    ) -> None:
        """Join group version ``version`` (bounded by ``init_timeout_s``); rank -1 only records it.
        ``run`` / ``secret``: the driver's key (``security.authenticate``), installed before
        anything is sent, so every store value, manifest, seal and vote carries its MAC.
        ``stage``: ``staged`` mode, this rollout's role on its node (writer or follower)."""
        from ftstate.transport import auth, checksum

        self._close("a new group version")
        security = self.settings.runtime.security
        if security.authenticate:
            if secret is None:
                who = members[rank] if 0 <= rank < len(members) else f"rank {rank}"
                raise TransportError(f"{who}: security.authenticate is on but build_topology handed no secret")
            auth.install(run, secret)
        checksum.use_integrity(security.integrity)  # keyed: derived from the secret just installed
        self.rank, self.world_size, self.group_version, self.members = rank, world_size, version, list(members)
        self._stage, self._abandoned = stage, None
        if stage is not None:
            if self.settings.commit_mode != "staged":
                raise ConfigError(f"{self.settings.group}.commit_mode", f"{stage['name']} was given a node role by "
                                  f"build_topology but its commit_mode is {self.settings.commit_mode!r}")
            nodestage.sweep(self.settings.group)  # a SIGKILLed writer's segments of an earlier update
        if rank < 0:
            return
        timeout_s = self.settings.runtime.init_timeout_s
        try:
            self._comm = create_communicator(
                self.settings.runtime.backend,
                store_addr=store,
                group=group,
                version=version,
                rank=rank,
                world_size=world_size,
                timeout_s=timeout_s,
                device_host=self.settings.device_host or _ray_node_address(),
            )
        except RendezvousTimeout as exc:
            raise RendezvousTimeout(
                f"verl weight update {exc.what}",
                key=exc.key,
                seconds=exc.seconds,
                member=self.members[rank],
                group_version=version,
                missing=[self._name(m) for m in exc.missing],
                arrived=[self._name(m) for m in exc.arrived],
            ) from exc

    def finalize(self) -> None:
        """Release this update's communicator (the group is rebuilt on the next update)."""
        self._close("update finished")

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Send the generator's tensors to every rollout (rank 0), or walk it (rank -1).

        Returns the per-update metrics verl merges into its own (``ftstate/...``). Raises
        :class:`~ftstate.core.errors.PeerLost`, :class:`~ftstate.core.errors.SyncTimeout`,
        :class:`~ftstate.core.errors.ChecksumMismatch` (a rollout rejected a chunk), after the
        generator was walked to its end.
        """
        if self.rank is None:
            raise TransportError("send_weights called before init_process_group")
        if self.rank < 0:
            async for _ in _aiter(weights):
                pass
            return {}
        if self.rank != 0:
            raise TransportError(f"send_weights on rollout rank {self.rank}: only trainer rank 0 sends")
        comm = self._require_comm("send_weights")
        sender = self._sender
        assert sender is not None
        self.updates += 1
        wv = int(global_steps) if global_steps is not None else self.updates
        timeout_s = self.settings.runtime.sync_timeout_s
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        failure: BaseException | None = None
        rejected: dict[int, str] = {}
        lost: list[int] = []
        in_flight: asyncio.Future[Any] | None = None
        chunks = tensors = nbytes = 0
        chunk: dict[str, torch.Tensor] = {}
        size = 0

        def left(stage: str) -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                comm.abort(f"sync deadline passed during {stage}")
                raise SyncTimeout(f"verl weight update {wv} ({stage})", key="sync_timeout_s", seconds=timeout_s,
                                  member=self.members[0], group_version=self.group_version)
            return remaining

        def send_chunk(seq: int, part: dict[str, torch.Tensor]) -> None:
            self._frame(comm, FRAME_CHUNK, seq, left(f"chunk {seq + 1}"))
            report = sender.broadcast(comm, part, weights_version=wv, timeout_s=left(f"chunk {seq + 1}"))
            for r, why in report.rejected.items():
                rejected.setdefault(r, f"{why} in chunk {seq + 1}")

        async def settle() -> BaseException | None:
            nonlocal in_flight
            if in_flight is None:
                return None
            try:
                await in_flight
            except BaseException as exc:  # noqa: BLE001 - raised once the generator is drained
                return exc
            finally:
                in_flight = None
            return None

        async def flush() -> None:
            nonlocal failure, chunk, size, chunks, in_flight
            failure = failure or await settle()
            if failure is None and chunk:
                in_flight = asyncio.ensure_future(asyncio.to_thread(send_chunk, chunks, chunk))
                chunks += 1
            chunk, size = {}, 0

        try:
            async for name, tensor in _aiter(weights):
                if failure is not None:
                    continue  # keep walking: the other trainer ranks produce it with us
                t = tensor.detach()
                if t.device != comm.device:
                    t = t.to(comm.device)
                t = t.contiguous()
                if chunk and size + t.nbytes > self.bucket_size:
                    await flush()
                    if failure is not None:
                        continue
                chunk[name] = t
                size += t.nbytes
                tensors += 1
                nbytes += t.nbytes
            await flush()
            failure = failure or await settle()
            if failure is None:
                votes = await asyncio.to_thread(self._close_update, comm, chunks, _OK, left)
                lost = sorted(r for r, v in votes.items() if v == _LOST)
                rejected.update({r: rejected.get(r, "rejected the update") for r, v in votes.items()
                                 if v == _REJECTED})
        except BaseException as exc:  # noqa: BLE001 - the group is aborted below, then it is raised
            failure = failure or exc
        if failure is not None:
            await settle()
            comm.abort(f"weight update {wv} failed")
            if isinstance(failure, FTError):
                raise failure
            raise TransportError(f"verl weight update {wv} on {self.members[0]} failed: {failure}") from failure
        seconds = time.monotonic() - started
        self.last_report = {"weights_version": wv, "chunks": chunks, "tensors": tensors, "bytes": nbytes,
                            "seconds": seconds, "group_version": self.group_version}
        if lost:
            raise PeerLost(
                f"verl weight update {wv} (group version {self.group_version}): "
                f"{', '.join(self.members[r] for r in lost)} lost a node follower before the vote; no rollout "
                "applied the update", group=self.settings.group, group_version=self.group_version, rank=0,
                op="final vote")
        if rejected:
            names = "; ".join(f"{self.members[r]}: {why}" for r, why in sorted(rejected.items()))
            raise ChecksumMismatch(
                f"verl weight update {wv} (group version {self.group_version}): rejected by {names}; "
                "those rollouts never yielded the corrupted chunk"
            )
        log.info("verl weights sent", extra=self.last_report)
        return {"ftstate/update_s": seconds, "ftstate/bytes": nbytes, "ftstate/chunks": chunks}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` of verified chunks (``stream``) or of the whole verified
        update (``staged``); see the module docstring. A chunk whose checksum failed is never
        yielded: this raises :class:`~ftstate.core.errors.ChecksumMismatch` at the end."""
        timeout_s = self.settings.runtime.sync_timeout_s
        deadline = time.monotonic() + timeout_s
        stage = self._stage
        if stage is not None and stage["role"] == "follower":
            chunks = await asyncio.to_thread(
                nodestage.wait_and_map, self.settings.group, self._version(), writer_pid=int(stage["writer_pid"]),
                writer=stage["writer"], me=stage["name"], deadline=deadline, timeout_s=timeout_s,
                abandoned=lambda: self._abandoned)
            self._chunks_in = len(chunks)
            for tensors in chunks:
                for name, tensor in tensors.items():
                    yield name, tensor
            return
        comm = self._require_comm("receive_weights")
        staged = self.settings.commit_mode == "staged"
        me = self.members[comm.rank]
        # staged with followers on this node: the update goes into the node's copy, once
        writer = nodestage.StageWriter(self.settings.group, self._version()) \
            if stage is not None and stage.get("followers") else None
        self._writer = writer
        self._chunks_in = 0
        # the writer's chunks land in the node's copy, not in this engine's own staging
        receiver = nodestage.NodeReceiver(writer) if writer is not None else self._receiver

        def left(stage: str) -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                comm.abort(f"sync deadline passed during {stage}")
                raise SyncTimeout(f"verl weight update ({stage})", key="sync_timeout_s", seconds=timeout_s,
                                  member=me, group_version=self.group_version)
            return remaining

        def next_chunk(seq: int) -> Any:
            """The next chunk's committed weights, None at the end, or the ChecksumMismatch."""
            kind, got = self._read_frame(comm, left(f"frame {seq + 1}"))
            if got != seq:
                comm.abort("frame out of order")
                raise ManifestError(f"{me}: frame field 'sequence': {got}, expected {seq}", field="sequence")
            if kind == FRAME_END:
                return None
            if self._corrupt_at == seq:
                self._corrupt_at = None
                receiver.corrupt_next_bucket()
            try:
                got = receiver.receive_broadcast(comm, root=0, timeout_s=left(f"chunk {seq + 1}"))
            except ChecksumMismatch as exc:
                return exc
            self._chunks_in = seq + 1
            self._hold(seq + 1, left)
            if writer is not None:
                writer.add(got)  # the chunk stays in the node's copy, where it landed
                return True
            return got

        held: list[Mapping[str, torch.Tensor]] = []
        problem: ChecksumMismatch | None = None
        seq = 0
        try:
            while True:
                got = await asyncio.to_thread(next_chunk, seq)
                if got is None:
                    break
                seq += 1
                if isinstance(got, ChecksumMismatch):
                    problem = problem or got
                    continue
                if problem is not None:
                    continue  # drained, never yielded: the update is already torn for this rollout
                if got is True:
                    continue  # in the node's copy
                if staged:
                    held.append(got.tensors)
                    continue
                for name, tensor in got.tensors.items():
                    yield name, tensor
            status = _OK if problem is None else _REJECTED
            dead = [f["name"] for f in (stage or {}).get("followers", []) if not pid_alive(int(f["pid"]))] \
                if writer is not None and status == _OK else []
            if dead:
                status = _LOST  # a staged update reaches every rollout or none
            votes = await asyncio.to_thread(self._close_update, comm, seq, status, left)
        except BaseException as exc:
            comm.abort("receive failed")
            if writer is not None:
                # the followers stop waiting at once, never yielding anything
                with contextlib.suppress(OSError, FTError):
                    writer.publish(nodestage.FAILED, f"{type(exc).__name__}: {exc}")
            raise
        if dead:
            if writer is not None:
                writer.publish(nodestage.FAILED, f"{', '.join(dead)} died before the vote")
            raise PeerLost(f"{me}: node follower {', '.join(dead)} died before the vote; nothing was yielded",
                           group=self.settings.group, group_version=self.group_version, rank=comm.rank,
                           op="final vote")
        if problem is not None:
            if writer is not None:
                writer.publish(nodestage.REJECTED, f"{me} rejected a chunk: {problem}")
            raise ChecksumMismatch(f"{me}: {problem}; this chunk and every later one were not yielded") from problem
        others = sorted(r for r, v in votes.items() if v != _OK)
        if staged and others:
            why = "; ".join(f"{self.members[r]} " + ("lost a node follower" if votes[r] == _LOST else "rejected a chunk")
                            for r in others)
            rejected_any = any(votes[r] == _REJECTED for r in others)
            if writer is not None:
                writer.publish(nodestage.REJECTED if rejected_any else nodestage.FAILED, why)
            if not rejected_any:
                raise PeerLost(f"{me}: staged update not applied: {why}; nothing was yielded",
                               group=self.settings.group, group_version=self.group_version, rank=comm.rank,
                               op="final vote")
            raise ChecksumMismatch(f"{me}: staged update not applied: {why}; nothing was yielded")
        if writer is not None:
            writer.publish(nodestage.OK)
            held = writer.tensors()
        for tensors in held:
            for name, tensor in tensors.items():
                yield name, tensor

    # -- chaos and inspection -------------------------------------------------------------

    def corrupt_next_bucket(self, skip_chunks: int = 0) -> None:
        """Test hook: flip one byte of the first bucket of the chunk after ``skip_chunks``
        chunks of the next update (after it arrived, before it is checked), so that chunk
        fails its checksum."""
        self._corrupt_at = skip_chunks

    def stall_after_chunks(self, chunks: int, seconds: float) -> None:
        """Test hook: in the next update, after receiving ``chunks`` chunks, hold the receive
        for up to ``seconds`` (never past the sync deadline) with :meth:`describe` saying
        ``stalled``, so a test can act on a member mid-update; :meth:`unstall` ends it."""
        self._stall_go = threading.Event()
        self._stall = (chunks, self._stall_go)
        self._stall_s = seconds

    def unstall(self) -> None:
        self._stall_go.set()

    def abandon(self, reason: str) -> None:
        """Give up this update's group version from another call while a transfer may be
        blocked in it (the manager, once a member died): the transfer ends within the
        transport's poll slice with :class:`~ftstate.core.errors.CommunicatorAborted`; a
        node follower waiting for its writer's outcome ends within a poll
        (:data:`~ftstate.integrations.verl.nodestage.POLL_S`)."""
        self._abandoned = reason
        if self._comm is not None:
            self._comm.abandon(reason)

    def describe(self) -> dict[str, Any]:
        """Where this engine stands (tests and operators): rank, group version, whether a
        communicator is held, and the run whose key signs its messages (None: unauthenticated)."""
        from ftstate.transport import auth

        key = auth.current()
        stage = self._stage
        return {"rank": self.rank, "group_version": self.group_version, "communicator": self._comm is not None,
                "updates": self.updates, "commit_mode": self.settings.commit_mode, "pid": os.getpid(),
                "authenticated_run": key.run if key is not None else None,
                "node_role": stage["role"] if stage is not None else None, "chunks_in": self._chunks_in,
                "stalled": self._stalled,
                "staged_bytes": self._writer.nbytes if self._writer is not None else 0}

    # -- internals ----------------------------------------------------------------------

    def _name(self, who: str) -> str:
        head, _, number = who.partition(" ")
        if head == "rank" and number.isdigit() and int(number) < len(self.members):
            return self.members[int(number)]
        return who

    def _require_comm(self, op: str) -> Communicator:
        if self._comm is None:
            raise TransportError(
                f"{op}: no group version formed on this worker (rank {self.rank}); verl must call "
                "init_process_group first"
            )
        return self._comm

    def _close(self, reason: str) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort(reason)
        writer, self._writer = self._writer, None
        if writer is not None:
            # every follower mapped the node's copy by now (verl finalizes once every rollout's
            # update_weights returned), or the update is over: the names go, the mappings stay
            writer.close()

    def _version(self) -> int:
        if self.group_version is None:
            raise TransportError("receive_weights called before init_process_group")
        return self.group_version

    def _hold(self, chunks: int, left: Any) -> None:
        """The test hook of :meth:`stall_after_chunks`, bounded by the sync deadline."""
        stall = self._stall
        if stall is None or stall[0] != chunks:
            return
        self._stall, self._stalled = None, True
        try:
            stall[1].wait(min(self._stall_s, left(f"test stall after chunk {chunks}")))
        finally:
            self._stalled = False

    @staticmethod
    def _frame(comm: Communicator, kind: int, seq: int, timeout_s: float) -> None:
        header = torch.tensor([FRAME_MAGIC, kind, seq], dtype=torch.int64).to(comm.device)
        comm.broadcast(header, 0, timeout_s=timeout_s).wait()

    def _read_frame(self, comm: Communicator, timeout_s: float) -> tuple[int, int]:
        header = torch.zeros(3, dtype=torch.int64, device=comm.device)
        comm.broadcast(header, 0, timeout_s=timeout_s).wait()
        magic, kind, seq = (int(v) for v in header.cpu().tolist())
        if magic != FRAME_MAGIC or kind not in (FRAME_CHUNK, FRAME_END):
            comm.abort("malformed frame")
            raise ManifestError(
                f"{self.members[comm.rank]}: malformed frame header: field 'magic'/'kind': {magic:#x}/{kind}, "
                f"expected {FRAME_MAGIC:#x}/{FRAME_CHUNK} or {FRAME_END}",
                field="magic" if magic != FRAME_MAGIC else "kind",
            )
        return kind, seq

    def _close_update(self, comm: Communicator, chunks: int, status: int, left: Any) -> dict[int, int]:
        """The end frame (sender) and the one vote every member casts after the last chunk."""
        if comm.rank == 0:
            self._frame(comm, FRAME_END, chunks, left("end of update"))
        mine = torch.tensor([status], dtype=torch.int64).to(comm.device)
        votes = comm.allgather(mine, timeout_s=left("final vote"))
        return {r: int(v.item()) for r, v in enumerate(votes) if r != 0}


__all__ = ["BACKEND", "FTStateCheckpointEngine", "driver_store", "issue_version"]
