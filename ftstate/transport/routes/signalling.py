"""The per-bucket signals of a slot route: a writer waiting for its readers, a reader following its writer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ftstate.core.errors import ManifestError, PeerLost
from ftstate.transport import auth
from ftstate.transport.base import Pending
from ftstate.transport.manifest import short
from ftstate.transport.offer import MAX_PID
from ftstate.transport.routes.base import POLL_S, check
from ftstate.transport.signals import Channel
from ftstate.transport.stream import Stream


class Waiter:
    """The sender's view of the two slots: which bucket each holds, who has not released it."""

    def __init__(self, stream: Stream, chan: Channel | None, pids: dict[int, int], nslots: int) -> None:
        self.stream = stream
        self.chan = chan
        self.pids = pids
        self.nslots = nslots
        self.busy: list[tuple[int, set[int], list[Pending]] | None] = [None, None]
        self.expected: set[int] = set()

    def hellos(self, readers: Sequence[int], stage: str) -> None:
        assert self.chan is not None
        self.expected = set(readers)
        while not self.expected <= set(self.pids):
            msg = self.chan.recv(POLL_S)
            if msg is None:
                check(self.stream, stage, self.pids)
                continue
            self._handle(msg, stage)

    def free(self, slot: int, stage: str) -> None:
        entry = self.busy[slot]
        if entry is None:
            return
        _, waiting, pending = entry
        while waiting:
            assert self.chan is not None
            msg = self.chan.recv(POLL_S)
            if msg is None:
                check(self.stream, stage, {r: self.pids[r] for r in waiting if r in self.pids})
                continue
            self._handle(msg, stage)
        for p in pending:
            p.wait()
        self.busy[slot] = None

    def _handle(self, msg: dict[str, Any], stage: str) -> None:
        comm = self.stream.comm
        kind, rank = msg["kind"], msg["from"]
        if kind == "hello" and rank not in self.expected:  # a reader outside the plan: never let in
            if auth.enabled():
                auth.record_forged("signal", rank, group=comm.group, version=comm.version,
                                   problem="hello from a rank that is not a reader of this transfer")
                return
            raise ManifestError(f"bucket signal: hello from rank {rank}, which is not a reader of this transfer",
                                field="rank", peer=f"rank {rank}")
        if kind == "hello":
            pid = msg.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or not 1 <= pid <= MAX_PID:
                raise ManifestError(f"malformed bucket signal: hello from rank {rank} without a pid in "
                                    f"[1, {MAX_PID}]: {short(pid)}", field="pid", peer=f"rank {rank}")
            self.pids[rank] = pid
        elif kind == "released":
            index = msg.get("bucket")
            entry = self.busy[index % self.nslots] if isinstance(index, int) else None
            if entry is None or entry[0] != index:
                raise ManifestError(f"bucket signal: rank {rank} released bucket {index}, which it was not reading",
                                    field="bucket")
            entry[1].discard(rank)
        elif kind == "failed":
            raise PeerLost(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: rank {rank} gave the transfer up "
                f"during {stage}: {short(msg.get('reason'))}",
                group=comm.group, group_version=comm.version, rank=comm.rank, op=stage, peer=rank,
            )
        else:
            raise ManifestError(f"bucket signal: unexpected {kind!r} from rank {rank}", field="kind")


class Follower:
    """A reader's view of the slot its writer (the sender, or this node's relay) is filling:
    which slot holds bucket ``index`` and how many of its bytes are in place, from the
    writer's ``ready`` signals (several per bucket: the writer streams, see :data:`STREAM`)."""

    def __init__(self, chan: Channel, stream: Stream, writer: dict[int, int], nslots: int) -> None:
        self.chan = chan
        self.stream = stream
        self.writer = writer
        self.nslots = nslots
        self.index = -1
        self.slot = -1
        self.nbytes = 0
        self.upto = 0
        self.stage = ""

    def start(self, index: int, nbytes: int, stage: str) -> int:
        """The slot that holds (or is being filled with) bucket ``index``, once its writer says so."""
        self.index, self.slot, self.nbytes, self.upto, self.stage = index, -1, nbytes, 0, stage
        self._next()
        return self.slot

    def awaiting(self, n: int) -> None:
        """Return once the first ``n`` bytes of the bucket are in its slot."""
        while self.upto < n:
            self._next()

    def _next(self) -> None:
        comm = self.stream.comm
        while True:
            msg = self.chan.recv(POLL_S)
            if msg is None:
                check(self.stream, self.stage, self.writer)
                continue
            break
        kind = msg["kind"]
        if kind == "failed":
            peer = next(iter(self.writer))
            raise PeerLost(
                f"rank {comm.rank} of group {comm.group!r} v{comm.version}: rank {peer}, whose shared memory it "
                f"reads, gave the transfer up during {self.stage}: {short(msg.get('reason'))}",
                group=comm.group, group_version=comm.version, rank=comm.rank, op=self.stage, peer=peer,
            )
        slot, upto = msg.get("slot"), msg.get("upto")
        if kind != "ready" or msg.get("bucket") != self.index or slot not in (0, 1)[: self.nslots] \
                or (self.slot >= 0 and slot != self.slot):
            where = f"slot {self.slot}" if self.slot >= 0 else "a slot"
            raise ManifestError(f"bucket signal: expected 'ready' for bucket {self.index} in {where}, "
                                f"got {msg!r:.80}", field="bucket")
        if not isinstance(upto, int) or not self.upto < upto <= self.nbytes:
            raise ManifestError(f"bucket signal: bucket {self.index} filled up to {upto!r}, expected more than "
                                f"{self.upto} and at most its {self.nbytes} bytes", field="upto")
        self.slot, self.upto = slot, upto


__all__ = ["Follower", "Waiter"]
