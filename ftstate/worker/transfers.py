"""A worker's end of the weight transport: the group versions it joins, and the transfers it
runs on them (a sync's broadcast, a newcomer's point-to-point resync, a node copy taken or
fetched), each in a thread, marked busy for the watchdog.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from typing import Any

from ftstate.core.errors import TransportError
from ftstate.core.protocol import (
    Abandon,
    AdoptNodeCopy,
    FetchNodeCopy,
    Info,
    Join,
    Joined,
    Loaded,
    Located,
    Prewarm,
    RawBroadcast,
    ReceiveFrom,
    ReceiveWeights,
    ReserveStaging,
    SendTo,
    SendWeights,
    Sent,
    SentTo,
    Staged,
)
from ftstate.worker.part import HostPart
from ftstate.worker.place import device_host, node_copy_size


class Transfers(HostPart):
    """Group versions and transfers of a worker host."""

    group_version: int
    _comm: Any  # the communicator of the group version joined last
    _sender: Any
    _receiver: Any
    _staged: Any
    _corrupt_next: bool

    # A transfer ends in Holdings (commit_weights, _adopt, _held_checksum...), mixed in beside it.

    async def join(self, req: Join) -> Joined:
        """Form group version ``version`` as ``rank`` of ``world_size``. ``timeout_s`` bounds the
        transport's own wait (the controller's state deadline bounds the whole rendezvous)."""
        store_host, version, rank = req.store_host, req.version, req.rank
        from ftstate.transport import create_communicator

        self.leave()
        self._comm = await asyncio.to_thread(
            create_communicator,
            self.backend,
            store_addr=(store_host, req.store_port),
            group=req.group,
            version=version,
            rank=rank,
            world_size=req.world_size,
            timeout_s=req.timeout_s,
            # This member's own node: its gloo device binds and announces the address Ray
            # reports for the node it runs on (loopback on the embedded default), never 0.0.0.0.
            device_host=device_host(store_host),
        )
        self.group_version = version
        from ftstate.transport.shm import sweep_orphans

        sweep_orphans()  # segments a SIGKILLed sender of an older version left named on this host
        self._tick()
        return Joined(group_version=version, rank=rank)

    async def abandon_transfer(self, req: Abandon) -> None:
        """Give up the transfer in flight on this group version (another participant failed): its waits end at
        once with ``CommunicatorAborted`` and the version is not used again. Runs beside the transfer."""
        if self._comm is not None:
            self._comm.abandon(req.reason)

    def leave(self) -> None:
        if "ftstate.transport.samehost" in sys.modules:  # it ever took part in a same-host transfer
            from ftstate.transport import samehost

            if self._sender is not None:
                samehost.drop_slots(self._sender)  # the next version makes its own
            samehost.drop_mappings()  # and a reader maps the next version's
        if self._comm is not None:
            try:
                self._comm.abort("left the group version")
            finally:
                self._comm = None

    async def send_weights(self, req: SendWeights) -> Sent:
        """Trainer: broadcast ``state_dict()`` as ``weights_version`` within ``timeout_s``. ``same_host``: the
        plan's ranks on this node, which read shared memory (``require_shm``: no fallback); ``relays``:
        ``(relay rank, its peers)`` per other node; ``node_copy_owner``: the pid of this node's copy agent
        (``staging: node``), ``node_copy_spare`` rewrites the previous copy. Raises
        :class:`~ftstate.core.errors.StateDictError` before sending a state that cannot travel."""
        weights_version, timeout_s, same_host, relays = req.weights_version, req.timeout_s, req.same_host, req.relays
        from ftstate.transport import Sender
        from ftstate.transport.validate import check_state_dict

        comm = self._require_comm()
        if self._sender is None:
            self._sender = Sender(bucket_size=self.bucket_bytes)
        async with self._lock():
            # If this raises, the controller has the waiting rollouts abandon the transfer.
            state = check_state_dict(
                await self._run(self.user.state_dict),
                device_type=comm.device.type, member=self.member, backend=self.backend,
            )
            self.busy = True
            try:
                if same_host or relays:
                    from ftstate.transport import samehost

                    report = await asyncio.to_thread(
                        samehost.broadcast, self._sender, comm, state, same_host=list(same_host),
                        relays={r: list(p) for r, p in relays}, require_shm=req.require_shm,
                        weights_version=weights_version, timeout_s=timeout_s, progress=self._on_bucket,
                        node_copy_owner=req.node_copy_owner, node_copy_spare=req.node_copy_spare,
                    )
                else:
                    report = await asyncio.to_thread(
                        self._sender.broadcast, comm, state, weights_version=weights_version,
                        timeout_s=timeout_s, progress=self._on_bucket,
                    )
            finally:
                self.busy = False
        if report.ok:
            self.weights_version = weights_version
            self.checksum = report.state_checksum
        self._tick()
        return Sent(checksum=report.state_checksum, nbytes=report.nbytes,
                    rejected={int(k): v for k, v in report.rejected.items()},
                    routes={int(k): v for k, v in report.routes.items()}, shm_fallback=report.shm_fallback or "",
                    node_copy=report.node_copy, node_spare=report.node_spare, host_bytes=report.host_bytes,
                    node_copy_size=node_copy_size(report.node_copy, recycled=report.node_copy_recycled))

    async def receive_weights(self, req: ReceiveWeights) -> Staged:
        """Rollout: receive and verify ``weights_version`` from rank ``src``, staged until
        :meth:`commit_weights`. ``planned``: the sender's same-host route; ``node_copy_owner``: this relay's
        node agent; the result's ``node_copy`` names the copy its staged state is in."""
        weights_version, src, timeout_s = req.weights_version, req.src, req.timeout_s
        from ftstate.core.errors import ManifestError

        self._staged = None
        if req.planned:
            staged = await self._receive("samehost", src, timeout_s=timeout_s, node_copy_owner=req.node_copy_owner)
        else:
            staged = await self._receive("receive_broadcast", root=src, timeout_s=timeout_s)
        if staged.weights_version != weights_version:
            raise ManifestError(
                f"{self.member}: field 'weights_version': expected {weights_version}, the sender sent "
                f"{staged.weights_version}",
                field="weights_version",
            )
        self._staged = staged
        self._tick()
        # staging_bytes: this rollout's peak transport memory during the transfer; node_copy: the node
        # copy its staged state is in (staging: node), else None
        return Staged(checksum=staged.state_checksum, nbytes=staged.nbytes, weights_version=staged.weights_version,
                      staging_bytes=self._receiver.peak_bytes, node_copy=staged.node_copy, host_bytes=staged.host_bytes,
                      node_copy_size=node_copy_size(staged.node_copy, recycled=False))  # a relay never recycles

    async def adopt_node_copy(self, req: AdoptNodeCopy) -> Loaded:
        """Rollout newcomer: take the committed version from its node's copy ``name`` (hashed in place, only
        if it is ``weights_version`` with ``checksum``), then load it as a staged version; no transfer."""
        from ftstate.transport import nodecopy

        return await self._load_node_copy("node_copy", nodecopy.adopt, req.name, group=req.group, owner=req.owner,
                                          weights_version=req.weights_version, checksum=req.checksum)

    async def fetch_node_copy(self, req: FetchNodeCopy) -> Loaded:
        """Rollout newcomer on a node without the committed copy: fetch another node's copy point to point
        from its agent (proven by ``checksum``), then load it as :meth:`adopt_node_copy` does."""
        from ftstate.transport import nodecopy

        return await self._load_node_copy("node_copy_p2p", nodecopy.fetch, dict(req.served), name=req.name,
                                          group=req.group, owner=req.owner, weights_version=req.weights_version,
                                          checksum=req.checksum, timeout_s=req.timeout_s)

    async def _load_node_copy(self, route: str, take: Any, *args: Any, weights_version: int,
                              **kwargs: Any) -> Loaded:
        """``take`` a node copy into this rollout's receiver in a thread, then load it as a staged version."""
        from ftstate.transport import Receiver

        if self._receiver is None:
            self._receiver = Receiver()
        self._staged = None
        self.busy = True
        try:
            staged = await asyncio.to_thread(take, self._receiver, *args, weights_version=weights_version, **kwargs)
        finally:
            self.busy = False
        self._staged = staged
        return dataclasses.replace(await self._commit(weights_version), route=route)

    async def prewarm(self, req: Prewarm) -> Located:
        """A spare's warm-up: import the transport (torch, the backend) now, not on promotion."""
        import ftstate.transport.samehost  # noqa: F401 - the import is the warm-up (sync, torch, zmq)

        return await self.info(Info())

    async def reserve_staging(self, req: ReserveStaging) -> None:
        """A spare: allocate and touch its receiver's staging for the current version's ``nbytes`` now (host
        memory only: a GPU allocation has no page faults to pay in advance)."""
        nbytes = req.nbytes
        if self.backend != "gloo":
            return
        import torch

        from ftstate.transport import Receiver

        if self._receiver is None:
            self._receiver = Receiver()
        await asyncio.to_thread(self._receiver.reserve, nbytes + nbytes // 64 + (1 << 20), torch.device("cpu"))

    async def send_weights_to(self, req: SendTo) -> SentTo:
        """Point to point: send this rollout's committed version to ``peer`` (a newcomer, or a new trainer),
        through shared memory when ``same_host``."""
        peer, timeout_s = req.peer, req.timeout_s
        from ftstate.transport import Sender

        comm = self._require_comm()
        t0 = time.perf_counter()
        state, version = await self._committed_state()
        t_state = time.perf_counter()
        if self._sender is None:
            self._sender = Sender(bucket_size=self.bucket_bytes)
        self.busy = True
        try:
            if req.same_host:
                from ftstate.transport import samehost

                report = await asyncio.to_thread(
                    samehost.send_to, self._sender, comm, peer, state, require_shm=req.require_shm,
                    weights_version=version, timeout_s=timeout_s, progress=self._on_bucket,
                )
            else:
                report = await asyncio.to_thread(
                    self._sender.send_to, comm, peer, state, weights_version=version, timeout_s=timeout_s,
                    progress=self._on_bucket,
                )
        finally:
            self.busy = False
        if not report.ok:
            from ftstate.core.errors import ChecksumMismatch

            raise ChecksumMismatch(f"{self.member}: rank {peer} rejected weights version "
                                   f"{version}: {dict(report.rejected)}")
        # ``stages``: where the sender's time went (the failover record's stage timings).
        return SentTo(checksum=report.state_checksum, nbytes=report.nbytes, weights_version=version,
                      stages={"state": round(t_state - t0, 6), "send": round(time.perf_counter() - t_state, 6)})

    async def receive_weights_from(self, req: ReceiveFrom) -> Loaded:
        """Point to point: receive the current version from ``src``, prove it by ``checksum``, and load it
        (``load_weights``, or a trainer's ``load_state_dict``)."""
        weights_version = req.weights_version
        t0 = time.perf_counter()
        staged = await self._receive_proven(req.src, weights_version, req.checksum, timeout_s=req.timeout_s,
                                            same_host=req.same_host)
        t_received = time.perf_counter()
        device_bytes = None
        async with self._lock():
            t_locked = time.perf_counter()
            if self.role == "trainer":
                await self._run(self.user.load_state_dict, self._hand_over(staged))
                t_loaded = time.perf_counter()
                held = await self._trainer_checksum()
            else:
                device_bytes = await self._load_weights(staged.tensors, weights_version)
                t_loaded = time.perf_counter()
                held, from_engine = await self._held_checksum(staged.tensors, staged.state_checksum)
            t_proven = time.perf_counter()
            self.weights_version = weights_version
            self.checksum = held
            if self.role == "rollout":
                self._adopt(staged, from_engine)
        self._tick()
        # ``checksum``: what this member holds after loading; ``stages``: where the newcomer's time went;
        # ``device_bytes``: a load by parts' device buckets, else absent.
        stages = {"receive": t_received - t0, "lock": t_locked - t_received, "load": t_loaded - t_locked,
                  "prove": t_proven - t_loaded}
        return Loaded(checksum=held, received=staged.state_checksum, nbytes=staged.nbytes,
                      weights_version=weights_version, stages={k: round(v, 6) for k, v in stages.items()},
                      device_bytes=device_bytes)

    async def _receive_proven(self, src: int, weights_version: int, checksum: str, *, timeout_s: float,
                              same_host: bool = False, what: str = "weights") -> Any:
        """Point to point from ``src``, then proof that it is ``what`` of ``weights_version``."""
        from ftstate.core.errors import ChecksumMismatch

        if same_host:
            staged = await self._receive("samehost", src, point_to_point=True, timeout_s=timeout_s)
        else:
            staged = await self._receive("receive_from", src, timeout_s=timeout_s)
        if staged.weights_version != weights_version or staged.state_checksum != checksum:
            raise ChecksumMismatch(
                f"{self.member}: received {what} of weights version {staged.weights_version} "
                f"({staged.state_checksum}) from rank {src}, expected {what} of version {weights_version} ({checksum})")
        return staged

    async def _receive(self, how: str, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """One transfer into this worker's Receiver, in a thread, marked busy, chaos corruption applied."""
        import functools

        from ftstate.transport import Receiver, samehost

        comm = self._require_comm()
        if self._receiver is None:
            self._receiver = Receiver()
        if self._corrupt_next:
            self._corrupt_next = False
            self._receiver.corrupt_next_bucket()
        self.busy = True
        try:
            fn = functools.partial(samehost.receive, self._receiver) if how == "samehost" else getattr(
                self._receiver, how)
            return await asyncio.to_thread(fn, comm, *args, timeout_s=timeout_s, progress=self._on_bucket, **kwargs)
        finally:
            self.busy = False

    def _on_bucket(self, done: int, total: int) -> None:
        self._tick()

    def _require_comm(self) -> Any:
        if self._comm is None:
            # A version the controller did not form: a transport error, so the next attempt forms a new one.
            raise TransportError(f"{self.member}: not a member of any group version (its last join did not "
                                 f"complete); the next transfer forms a new one")
        return self._comm

    async def bench_raw_broadcast(self, req: RawBroadcast) -> float:
        """Benchmarks only: a bare broadcast of ``nbytes`` on the current group version (every member calls
        it), or a bare send from ``root`` to rank ``to``; returns seconds (0 on other ranks)."""
        import time

        import torch

        from ftstate.transport.samehost import NET_CHUNK

        nbytes, root, timeout_s, to = req.nbytes, req.root, req.timeout_s, req.to
        comm = self._require_comm()

        def run() -> float:
            # made here, not on the event loop: filling a large buffer there delays heartbeat answers
            if to is not None and comm.rank not in (root, to):
                return 0.0
            buf = torch.empty(nbytes, dtype=torch.uint8)
            # every rank touches its buffer first, as ftstate's staging is: the baseline pays no page faults
            buf.fill_(7 if comm.rank == root else 0)
            # both sides start the clock together: Ray delivers the calls tens of ms apart
            if to is None:
                comm.barrier(timeout_s=timeout_s)
            else:
                hello = torch.zeros(1, dtype=torch.uint8)  # root -> to, then back (a send waits for its recv)
                for sender in (root, to):
                    if comm.rank == sender:
                        comm.send(hello, root + to - sender, tag=0x7EA0, timeout_s=timeout_s).wait()
                    else:
                        comm.recv(hello, sender, tag=0x7EA0, timeout_s=timeout_s).wait()
            t0 = time.perf_counter()
            if to is None:
                comm.broadcast(buf, root, timeout_s=timeout_s).wait()
            else:
                # in NET_CHUNK messages posted at once, as ftstate's point-to-point route sends
                op = comm.send if comm.rank == root else comm.recv
                peer = to if comm.rank == root else root
                pending = [op(buf[i : i + NET_CHUNK], peer, tag=0x7EB0 + k, timeout_s=timeout_s)
                           for k, i in enumerate(range(0, nbytes, NET_CHUNK))]
                for pend in pending:
                    pend.wait()
            return time.perf_counter() - t0

        return await asyncio.to_thread(run)
