"""Real member processes for the transport tests: a worker per rank, driven over a pipe.

Each worker is a 'spawn' process that imports torch once (~2.5 s here) and then executes
commands (form a group version, broadcast, receive, send to a peer, …) until it is told
to stop or killed, so one set of processes serves many scenarios. :class:`Pool` keeps a
prewarmed spare so that "a fresh process takes the dead member's rank" costs no import
time inside a test, and kills every process it started when the module's tests end,
whatever happened.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

GROUP = "weights"
BUCKET = 64 * 1024  # small buckets: the test states span a dozen of them


def make_state(seed: int) -> dict[str, Any]:
    """A deterministic state of mixed dtypes: float32, bfloat16, int64, bool, a 0-dim and an
    empty tensor, and two tensors larger than a 64 KiB bucket (chunked)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 128, generator=g),  # 150 KiB float32: 3 chunks
        "layers.0.attn.bf16": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.randn(64, generator=g),
        "layers.1.big.bf16": torch.randn(100_000, generator=g).to(torch.bfloat16),  # 195 KiB: 4 chunks
        "token_ids": torch.randint(-(2**40), 2**40, (1000,), generator=g, dtype=torch.int64),
        "mask": torch.rand(333, generator=g) > 0.5,
        "step": torch.tensor(seed, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


def describe_error(exc: BaseException) -> dict[str, Any]:
    info: dict[str, Any] = {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
    }
    for attr in ("missing", "arrived", "group_version", "seconds", "key", "got", "current", "what",
                 "group", "rank", "op", "peer", "field", "reason"):
        if hasattr(exc, attr):
            value = getattr(exc, attr)
            info[attr] = list(value) if isinstance(value, tuple) else value
    return info


class _Member:
    """What runs inside a worker process; each public method is a command."""

    def __init__(self, store_addr: str) -> None:
        from ftstate.transport import Receiver, Sender

        self.store_addr = store_addr
        self.comms: dict[int, Any] = {}
        self.version: int | None = None
        self.sender = Sender(bucket_size=BUCKET)
        self.receiver = Receiver()
        self.weights: dict[str, Any] | None = None
        self.weights_version: int | None = None

    @property
    def comm(self) -> Any:
        assert self.version is not None, "no group version formed yet"
        return self.comms[self.version]

    def _progress(self, kill_at: int | None) -> Callable[[int, int], None] | None:
        if kill_at is None:
            return None

        def progress(done: int, total: int) -> None:
            if done == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        return progress

    # -- commands ---------------------------------------------------------------------

    def form(self, version: int, rank: int, world_size: int, timeout_s: float, group: str = GROUP) -> float:
        from ftstate.transport import create_communicator

        t0 = time.monotonic()
        self.comms[version] = create_communicator(
            "gloo", store_addr=self.store_addr, group=group, version=version, rank=rank,
            world_size=world_size, timeout_s=timeout_s,
        )
        self.version = version
        return time.monotonic() - t0

    def use(self, version: int) -> None:
        self.version = version

    def load(self, seed: int, weights_version: int) -> str:
        from ftstate.transport import state_checksum

        self.weights = make_state(seed)
        self.weights_version = weights_version
        return state_checksum(self.weights)

    def broadcast(self, timeout_s: float, kill_at: int | None = None, version: int | None = None) -> dict[str, Any]:
        comm = self.comms[version] if version is not None else self.comm
        report = self.sender.broadcast(
            comm, self.weights, weights_version=self.weights_version, timeout_s=timeout_s,
            progress=self._progress(kill_at),
        )
        return {"committed": list(report.committed), "rejected": dict(report.rejected),
                "checksum": report.state_checksum, "buckets": report.num_buckets, "group_version": report.group_version}

    def receive(self, timeout_s: float, root: int = 0, kill_at: int | None = None, version: int | None = None) -> dict[str, Any]:
        comm = self.comms[version] if version is not None else self.comm
        got = self.receiver.receive_broadcast(comm, root=root, timeout_s=timeout_s, progress=self._progress(kill_at))
        return {"weights_version": got.weights_version, "checksum": got.state_checksum, "group_version": got.group_version}

    def broadcast_planned(self, timeout_s: float, same_host: list[int], require_shm: bool = False,
                          kill_at: int | None = None, relays: dict[int, list[int]] | None = None,
                          node_copy_owner: int | None = None, node_copy_spare: bool = False) -> dict[str, Any]:
        from ftstate.transport import samehost

        report = samehost.broadcast(
            self.sender, self.comm, self.weights, same_host=same_host, relays=relays, require_shm=require_shm,
            weights_version=self.weights_version, timeout_s=timeout_s, progress=self._progress(kill_at),
            node_copy_owner=node_copy_owner, node_copy_spare=node_copy_spare,
        )
        return {"committed": list(report.committed), "rejected": dict(report.rejected),
                "checksum": report.state_checksum, "buckets": report.num_buckets,
                "routes": {int(k): v for k, v in report.routes.items()}, "shm_fallback": report.shm_fallback,
                "node_copy": report.node_copy, "node_spare": report.node_spare, "host_bytes": report.host_bytes}

    def adopt(self, name: str, owner: int, weights_version: int, checksum: str) -> dict[str, Any]:
        """A newcomer on the node takes the committed node copy ``name`` (ftstate.transport.nodecopy)."""
        from ftstate.transport import nodecopy

        got = nodecopy.adopt(self.receiver, name, group=GROUP, owner=owner, weights_version=weights_version,
                             checksum=checksum)
        return {"weights_version": got.weights_version, "checksum": got.state_checksum, "node": got._node}

    def fetch(self, served: dict[str, Any], name: str, owner: int, weights_version: int, checksum: str,
              timeout_s: float) -> dict[str, Any]:
        """A newcomer on another node receives node copy ``name`` point to point from its agent."""
        from ftstate.transport import nodecopy

        got = nodecopy.fetch(self.receiver, served, name=name, group=GROUP, owner=owner,
                             weights_version=weights_version, checksum=checksum, timeout_s=timeout_s)
        return {"weights_version": got.weights_version, "checksum": got.state_checksum, "node": got._node}


    def receive_planned(self, timeout_s: float, src: int = 0, point_to_point: bool = False,
                        kill_at: int | None = None, node_copy_owner: int | None = None) -> dict[str, Any]:
        from ftstate.transport import samehost

        got = samehost.receive(self.receiver, self.comm, src, point_to_point=point_to_point, timeout_s=timeout_s,
                               progress=self._progress(kill_at), node_copy_owner=node_copy_owner)
        return {"weights_version": got.weights_version, "checksum": got.state_checksum,
                "group_version": got.group_version, "node": got._node, "host_bytes": got.host_bytes}

    def send_to_planned(self, peer: int, timeout_s: float, source: str = "weights") -> dict[str, Any]:
        from ftstate.transport import samehost

        weights = self.weights if source == "weights" else self.receiver.committed
        report = samehost.send_to(
            self.sender, self.comm, peer, weights, weights_version=self.weights_version if source == "weights" else None,
            timeout_s=timeout_s,
        )
        return {"committed": list(report.committed), "rejected": dict(report.rejected),
                "checksum": report.state_checksum, "routes": {int(k): v for k, v in report.routes.items()}}

    def offer_stale_segments(self, stale_version: int, timeout_s: float) -> list[str]:
        """Send the current version's manifest, then an offer that names segments made for
        ``stale_version`` (kept named, as a SIGKILLed sender of that version would leave them)."""
        from ftstate.transport import samehost, shm
        from ftstate.transport.buckets import plan_layout
        from ftstate.transport.checksum import dtype_name
        from ftstate.transport.manifest import Manifest, encode_manifest
        from ftstate.transport.signals import Channel
        from ftstate.transport.stream import BroadcastStream

        comm = self.comm
        entries, windows, total = plan_layout(
            ((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.weights.items()), BUCKET
        )
        names = [shm.segment_name(comm.group, stale_version, os.getpid(), 999, slot) for slot in (0, 1)]
        self.stale = [shm.Segment.create(n, group_version=stale_version, slot=i, capacity=BUCKET)
                      for i, n in enumerate(names)]
        for seg in self.stale:  # what an old sender left in its slots: a plausible bucket 0
            seg.data.fill_(0x5A)
            seg.mark(0, self.weights_version, windows[0][1] - windows[0][0])
        chan = Channel.bind()
        self.stale_chan = chan
        route = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=comm.rank, sending=True)
        route.send_message(encode_manifest(
            Manifest(comm.group, comm.version, self.weights_version, BUCKET, total, entries, windows)), "manifest")
        offer = samehost.Offer(comm.group, comm.version, os.getpid(), chan.endpoint, tuple(names), True,
                               tuple(r for r in range(comm.world_size) if r != comm.rank), ())
        route.send_message(samehost.encode_offer(offer), "offer")
        return names

    def drop_stale_segments(self) -> None:
        for seg in getattr(self, "stale", []):
            seg.unlink()
            seg.close()
        self.stale_chan.close()

    def set_net_chunk(self, nbytes: int | None) -> None:
        """This process, as a sender, sends collective ranks ``nbytes``-byte chunks (None: the default)."""
        from ftstate.transport import samehost

        samehost.NET_CHUNK = nbytes or 8 * 1024 * 1024

    def install_device_memory(self, device_type: str, factory: str | None) -> None:
        """Install ``factory`` (``"module:Class"``, built once per process) as this process's
        device memory for ``device_type`` (None: back to the default)."""
        import importlib

        from ftstate.transport import cudaipc

        if factory is None:
            cudaipc.uninstall(device_type)
            self.device_memory = None
            return
        module, _, cls = factory.partition(":")
        current = getattr(self, "device_memory", None)
        if type(current).__name__ != cls:
            self.device_memory = getattr(importlib.import_module(module), cls)()
        cudaipc.install(device_type, self.device_memory)

    def use_device_digest(self, on: bool) -> None:
        """Treat this process's ``cpu`` buffers as device memory for the checksum's choice of
        function (nh64, hashed where the bytes are, every host copy counted): the stand-in's
        device is the CPU."""
        from ftstate.transport import checksum

        (checksum.DIGEST_DEVICES.add if on else checksum.DIGEST_DEVICES.discard)("cpu")

    def force_checksum_function(self, function: str | None) -> None:
        """This process, as a sender, hashes with ``function`` whatever its weights' device (None:
        chosen by the device again), by replacing the routes' choice."""
        from ftstate.transport import checksum
        from ftstate.transport.routes import base

        chosen = checksum.function_for if function is None else (lambda sources: function)
        base.function_for = chosen  # the plan of every route's transfer

    def device_memory_stats(self) -> dict[str, int]:
        return self.device_memory.stats()

    def secure(self, secret: bytes | None, run: str = "test-run", integrity: str = "xxh3") -> None:
        """Install (or, None, forget) the run's secret in this process, as a WorkerHost does."""
        from ftstate.transport import auth, checksum

        if secret is None:
            auth.uninstall()
        else:
            auth.install(run, secret)
        checksum.use_integrity(integrity)

    def forged(self) -> list[dict[str, Any]]:
        """What this process dropped as forged since the last call."""
        from ftstate.transport import auth

        return auth.drain_forged()

    def attack_signals_at_first_copy(self, script: str) -> None:
        """As a writer: when it copies its first piece into a slot (every reader has said hello),
        run ``script`` in a separate process against this transfer's signal endpoint (argv[1])."""
        import subprocess
        import sys

        from ftstate.transport.routes import copying
        from ftstate.transport.signals import Channel

        bound: list[str] = []
        original = Channel.__dict__["bind"]  # the classmethod itself, to put back

        def bind(**kwargs: Any) -> Any:
            chan = original.__func__(Channel, **kwargs)
            bound.append(chan.endpoint)
            return chan

        def attack(piece: Any) -> None:
            copying.after_slot_copy = None
            Channel.bind = original
            subprocess.run([sys.executable, "-c", script, bound[-1]], check=True, timeout=20)

        Channel.bind = staticmethod(bind)
        copying.after_slot_copy = attack

    def tamper_slot_after_copy(self) -> None:
        """As a writer, flip the first byte of the next piece it copies into a shared-memory slot,
        right after the copy (the window a same-uid process writing into the slot would use)."""
        from ftstate.transport.routes import copying

        def tamper(piece: Any) -> None:
            copying.after_slot_copy = None  # once
            piece[:1].bitwise_xor_(0xFF)

        copying.after_slot_copy = tamper

    def tamper_device_slot(self) -> None:
        """The installed stand-in damages the slots it allocated at its next synchronize."""
        self.device_memory.tamper_next = True

    def set_shm_dir(self, path: str) -> None:
        """Point this process's segments at ``path`` (a missing directory: shared memory unavailable)."""
        from pathlib import Path

        from ftstate.transport import shm

        shm.SHM_DIR = Path(path)

    def segment_names(self) -> list[str]:
        """The names of this process's sender slots (empty once unlinked or never made)."""
        from ftstate.transport import shm

        return [n for n in shm.list_segments() if f"-p{os.getpid()}-" in n]

    def send_to(self, peer: int, timeout_s: float, source: str = "weights") -> dict[str, Any]:
        if source == "weights":
            report = self.sender.send_to(
                self.comm, peer, self.weights, weights_version=self.weights_version, timeout_s=timeout_s
            )
        else:  # the committed weights this member received
            report = self.sender.send_to(self.comm, peer, self.receiver.committed, timeout_s=timeout_s)
        return {"committed": list(report.committed), "rejected": dict(report.rejected), "checksum": report.state_checksum}

    def receive_from(self, peer: int, timeout_s: float) -> dict[str, Any]:
        got = self.receiver.receive_from(self.comm, peer, timeout_s=timeout_s)
        return {"weights_version": got.weights_version, "checksum": got.state_checksum}

    def corrupt_next_bucket(self) -> None:
        self.receiver.corrupt_next_bucket()

    def replay_seal_next(self) -> None:
        """As a recording attacker in the stream would: the next same-host transfer this process
        sends closes with the seal of the transfer it sent before (the same bytes and tag, as
        recorded), not its own. The transfer before must be of the same weights and layout, so
        only the transfer id tells the two seals apart."""
        import dataclasses

        from ftstate.transport import manifest, sync

        recorded: list[Any] = []

        def encode(seal: Any) -> bytes:
            if not recorded:
                recorded.append(seal)
                return manifest.encode_seal(seal)
            sync.encode_seal = manifest.encode_seal  # once
            assert dataclasses.replace(recorded[0], transfer=seal.transfer) == seal, "not the same weights"
            return manifest.encode_seal(recorded[0])

        sync.encode_seal = encode

    def forget_slot_mappings(self) -> None:
        """Unmap every writer's slots this process mapped (as one that lost them would: the
        writer's next offer then names slots it never mapped)."""
        from ftstate.transport.routes import slots

        slots.unmap(None)

    def reset_receiver(self) -> None:
        """Forget the committed weights, as a newcomer holds none."""
        from ftstate.transport import Receiver

        self.receiver = Receiver()

    def committed(self) -> dict[str, Any] | None:
        """The committed weights: version, the checksum recorded at commit and one
        recomputed now from the bytes held (with the function the recorded one names)."""
        from ftstate.transport.checksum import state_checksum_like

        c = self.receiver.committed
        if c is None:
            return None
        return {"weights_version": c.weights_version, "checksum": c.state_checksum,
                "recomputed": state_checksum_like(c.tensors, c.state_checksum), "node": c._node,
                "spare": self.receiver._spare is not None}

    def committed_bytes(self) -> dict[str, tuple[str, list[int], bytes]]:
        """Every committed tensor as (dtype, shape, raw bytes), for bit-exact comparison."""
        from ftstate.transport.checksum import byte_view, dtype_name

        c = self.receiver.committed
        assert c is not None
        return {n: (dtype_name(t.dtype), list(t.shape), bytes(byte_view(t).numpy())) for n, t in c.tensors.items()}

    def send_stale_manifest(self, stamped_version: int, timeout_s: float) -> None:
        """Broadcast a manifest stamped with an older group version on the current one."""
        from ftstate.transport.buckets import plan_layout
        from ftstate.transport.checksum import dtype_name
        from ftstate.transport.manifest import Manifest, encode_manifest
        from ftstate.transport.stream import BroadcastStream

        comm = self.comm
        entries, windows, total = plan_layout(
            ((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.weights.items()), BUCKET
        )
        manifest = Manifest(comm.group, stamped_version, self.weights_version, BUCKET, total, entries, windows)
        route = BroadcastStream(comm, time.monotonic() + timeout_s, timeout_s, root=comm.rank, sending=True)
        route.send_message(encode_manifest(manifest), "stale manifest", group_version=stamped_version)

    def abandon(self, version: int) -> None:
        comm = self.comms.pop(version, None)
        if comm is not None:
            comm.abort("abandoned by the test")


def serve(conn: Any, store_addr: str) -> None:
    """Entry point of a worker process."""
    member = _Member(store_addr)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        cmd, kwargs = msg
        try:
            result = getattr(member, cmd)(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure is the command's answer
            conn.send(("err", describe_error(exc)))
        else:
            conn.send(("ok", result))


class RemoteError(Exception):
    """An exception raised by a command inside a worker; ``info`` describes it."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        super().__init__(f"{info['type']}: {info['message']}")

    def isinstance(self, name: str) -> bool:
        return name in self.info["mro"]


class Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, ctx: Any, store_addr: str, name: str) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, store_addr), name=name, daemon=True)
        self.proc.start()
        child.close()
        self._ready = False
        self.pid: int | None = None
        self._busy = False

    def wait_ready(self, timeout: float = 60) -> Worker:
        if not self._ready:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"{self.name} did not start within {timeout}s")
            tag, self.pid = self.conn.recv()
            assert tag == "ready"
            self._ready = True
        return self

    def start(self, cmd: str, **kwargs: Any) -> None:
        """Send a command without waiting for its result (collect it with :meth:`result`)."""
        self.wait_ready()
        assert not self._busy, f"{self.name} is still running a command"
        self.conn.send((cmd, kwargs))
        self._busy = True

    def result(self, timeout: float = 30) -> Any:
        """The result of the command started last; raises RemoteError for its exception,
        EOFError if the process died."""
        assert self._busy
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout}s")
        self._busy = False
        tag, value = self.conn.recv()
        if tag == "err":
            raise RemoteError(value)
        return value

    def outcome(self, timeout: float = 30) -> tuple[str, Any]:
        """``("ok", result)``, ``("err", RemoteError)`` or ``("died", exitcode)``."""
        try:
            return "ok", self.result(timeout)
        except RemoteError as exc:
            return "err", exc
        except (EOFError, ConnectionResetError):
            self._busy = False
            self.proc.join(5)
            return "died", self.proc.exitcode

    def call(self, cmd: str, timeout: float = 30, **kwargs: Any) -> Any:
        self.start(cmd, **kwargs)
        return self.result(timeout)

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()


class Pool:
    """The controller's side: the store, the live members by rank and a prewarmed spare."""

    def __init__(self, size: int) -> None:
        from ftstate.transport import StoreServer

        self.server = StoreServer("127.0.0.1")
        self.ctx = mp.get_context("spawn")
        self.started: list[Worker] = []
        self.members: list[Worker] = [self._spawn() for _ in range(size)]
        self.spare: Worker = self._spawn()
        self.version = 0
        for w in self.members:
            w.wait_ready()

    def _spawn(self) -> Worker:
        w = Worker(self.ctx, str(self.server.address), f"worker-{len(self.started)}")
        self.started.append(w)
        return w

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def replace(self, rank: int) -> Worker:
        """A fresh process (the prewarmed spare) takes ``rank``; the old one is killed if alive."""
        old = self.members[rank]
        old.kill()
        new, self.spare = self.spare.wait_ready(), self._spawn()
        self.members[rank] = new
        return new

    def heal(self, busy_s: float = 30.0) -> None:
        """Dead workers replaced; a live one still running a command an earlier test started and
        never collected (it failed first) has that outcome collected and dropped, or is replaced
        if none comes within ``busy_s``: one failed test must not fail the next ones' setup."""
        for rank, w in enumerate(self.members):
            if w.alive and w._busy:
                with contextlib.suppress(Exception):  # an earlier test's outcome, not this one's
                    w.result(busy_s)
                if w._busy:
                    w.kill()
            if not w.alive:
                self.replace(rank)

    def form(self, members: list[Worker] | None = None, timeout_s: float = 10.0) -> int:
        """Form the next version with ``members`` (default all) as ranks 0..n-1."""
        members = self.members if members is None else members
        version = self.next_version()
        for rank, w in enumerate(members):
            w.start("form", version=version, rank=rank, world_size=len(members), timeout_s=timeout_s)
        for w in members:
            w.result(timeout_s + 10)
        return version

    def close(self) -> None:
        from ftstate.transport.shm import sweep_orphans

        for w in self.started:
            w.kill()
        self.server.close()
        sweep_orphans()  # what the killed members' last sends left named, as the controller does
