"""``FTStateCheckpointEngine``: ftstate's transport inside verl's checkpoint-engine protocol, run in verl's
trainer and rollout workers (``build_topology`` in the driver, which hosts the store). Each update is a fenced
group version with bounded init, streamed in chunks that each are one verified ftstate transfer;
``commit_mode`` and the node-held staged mode are described in docs/integration.md ("verl"). Yielded tensors
are views into the receiver's staging, reused only once nothing references them; the generator must not
overwrite a tensor it already yielded."""

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

#: Final vote values (``_LOST``: a node writer's follower died before the vote, so none applies it).
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
    """The store this driver process hosts for ``host``, started on first use, kept for the process's life."""
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
    """The run id and secret of this driver process (``security.authenticate``), made on the first update and
    handed to workers through verl's own Ray calls; one run's key per process."""
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
    """This process's Ray node id, else the host name (no Ray)."""
    import socket

    import ray

    if ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return socket.gethostname()


def _stages(rollouts: list[Mapping[str, Any]]) -> tuple[list[int], list[dict[str, Any] | None]]:
    """The group rank and node role of each rollout: a ``staged`` rollout first on its node writes the node's
    copy (a group rank), the node's others follow it (rank -1); ``stream`` ones have no role."""
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
    """verl's checkpoint engine over ftstate's transport. ``bucket_size``: bytes per chunk; ``is_master``:
    trainer rank 0; ``**settings``: the ``engine_kwargs.ftstate`` block."""

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
        """What ``build_topology`` needs from this worker (and, on trainer rank 0, the shared settings)."""
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
        """In the driver: start the store, issue the next group version, give each worker its rank (trainer 0
        → 0, other trainers → -1, rollouts → 1..R; ``staged`` followers → -1)."""
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
        """Join group version ``version`` within ``init_timeout_s`` (rank -1 only records it); ``run`` /
        ``secret`` are installed first so every message carries its MAC."""
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
        """Send the generator's tensors to every rollout (rank 0), or walk it (rank -1); returns verl metrics.
        Raises :class:`~ftstate.core.errors.PeerLost`, ``SyncTimeout`` or ``ChecksumMismatch`` only after the
        generator was walked to its end (FSDP ranks produce it together)."""
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
        """Yield ``(name, tensor)`` of verified chunks (``stream``) or of the whole verified update
        (``staged``); a failed chunk is never yielded and raises ``ChecksumMismatch`` at the end."""
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
        """Test hook: flip a byte of the chunk after ``skip_chunks`` in the next update, before its check."""
        self._corrupt_at = skip_chunks

    def stall_after_chunks(self, chunks: int, seconds: float) -> None:
        """Test hook: in the next update, hold the receive after ``chunks`` chunks for up to ``seconds``
        (never past the sync deadline); :meth:`unstall` ends it."""
        self._stall_go = threading.Event()
        self._stall = (chunks, self._stall_go)
        self._stall_s = seconds

    def unstall(self) -> None:
        self._stall_go.set()

    def abandon(self, reason: str) -> None:
        """Give up this update's group version from another call: a blocked transfer ends within the
        transport's poll slice, a waiting node follower within ``nodestage.POLL_S``."""
        self._abandoned = reason
        if self._comm is not None:
            self._comm.abandon(reason)

    def describe(self) -> dict[str, Any]:
        """Where this engine stands: rank, group version, communicator, signing run (None: unsigned)."""
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
            # Every follower mapped the node's copy by now, or the update is over: the names go, the mappings
            # stay
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
