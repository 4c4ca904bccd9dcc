"""The calls between the controller and a worker process: one frozen request and one frozen reply per call,
declared once here. The worker host and the simulated member answer each with the method the request names
(:attr:`Request.method`); :class:`WorkerAPI` lists them and a test holds both sides to it. Pure data, pickled
across processes, so fields are plain values."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from ftstate.core.liveness import Heartbeat


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """Base of every request; ``method`` names the worker's method that answers it."""

    method: ClassVar[str] = ""


# -- identity and liveness -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Info(Request):
    """Who and where the worker is (raises the constructor's WorkerInitError, if it raised)."""

    method: ClassVar[str] = "info"


@dataclasses.dataclass(frozen=True, slots=True)
class Prewarm(Request):
    """A spare's warm-up: the transport imported now, not on promotion; answers as :class:`Info`."""

    method: ClassVar[str] = "prewarm"


@dataclasses.dataclass(frozen=True, slots=True)
class Located:
    """pid, the node's address and Ray node id (several nodes may share an address);
    holds_weights: a rollout whose engine gives its weights back (``held_weights()``)."""

    pid: int
    node: str
    node_id: str | None
    member: str
    role: str
    holds_weights: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Beat(Request):
    """One heartbeat. prove: hash the held weights afresh (a SUSPECT rollout shows them);
    forged: hand over the forged messages dropped since the last ask."""

    method: ClassVar[str] = "heartbeat"
    prove: bool = False
    forged: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Vigil(Request):
    """Never answered while the process lives: its death surfaces at once on this call."""

    method: ClassVar[str] = "vigil"


# -- group versions and a sync --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Join(Request):
    """Form group version ``version`` of ``group`` as ``rank`` of ``world_size`` on the store at
    ``store_host:store_port``; ``timeout_s`` bounds the transport's own wait."""

    method: ClassVar[str] = "join"
    store_host: str
    store_port: int
    group: str
    version: int
    rank: int
    world_size: int
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class JoinTrainerGroup(Join):
    """A trainer rank forms the ranks' own group version and hands it to the user's ``setup``."""

    method: ClassVar[str] = "setup_trainer_group"


@dataclasses.dataclass(frozen=True, slots=True)
class Joined:
    group_version: int
    rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class Abandon(Request):
    """Give up the transfer in flight on this group version (another participant failed)."""

    method: ClassVar[str] = "abandon_transfer"
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class SendWeights(Request):
    """Trainer: broadcast ``state_dict()`` as ``weights_version``. same_host: the plan's ranks on
    this node, reading shared memory (require_shm: fail rather than fall back); relays:
    ``(relay rank, its node peers)`` of the other nodes; node_copy_owner: the pid of the agent
    owning this node's copy (``staging: node``); node_copy_spare: keep the previous one."""

    method: ClassVar[str] = "send_weights"
    weights_version: int
    timeout_s: float
    same_host: tuple[int, ...] = ()
    require_shm: bool = False
    relays: tuple[tuple[int, tuple[int, ...]], ...] = ()
    node_copy_owner: int | None = None
    node_copy_spare: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class NodeCopySize:
    """A node copy's bytes (read on its node) and whether the writer's spare was rewritten."""

    nbytes: int
    recycled: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """What a trainer's broadcast did: the state checksum, bytes, receivers that rejected it
    (rank → why), each receiver's route, why shared memory fell back (empty: it did not), the
    node copy committed (and the spare kept)."""

    checksum: str
    nbytes: int
    rejected: Mapping[int, str] = dataclasses.field(default_factory=dict)
    routes: Mapping[int, str] = dataclasses.field(default_factory=dict)
    shm_fallback: str = ""
    node_copy: str | None = None
    node_spare: str | None = None
    node_copy_size: NodeCopySize | None = None
    #: weight bytes copied to host memory on the way (hashing included): 0 on a GPU sync
    host_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveWeights(Request):
    """Rollout: receive and verify ``weights_version`` from rank ``src``, staged. planned: the
    sender's same-host route says how it reads; node_copy_owner: its node agent's pid when it
    is its node's relay (``staging: node``)."""

    method: ClassVar[str] = "receive_weights"
    weights_version: int
    src: int
    timeout_s: float
    planned: bool = False
    node_copy_owner: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Staged:
    """A verified version staged: its checksum and bytes; staging_bytes: the most transport
    memory held meanwhile; node_copy: the node copy it is in (``staging: node``)."""

    checksum: str
    nbytes: int
    weights_version: int
    staging_bytes: int = 0
    node_copy: str | None = None
    node_copy_size: NodeCopySize | None = None
    host_bytes: int = 0  # as :attr:`Sent.host_bytes`, on this receiver


@dataclasses.dataclass(frozen=True, slots=True)
class Commit(Request):
    """Rollout: hand the staged ``weights_version`` to ``load_weights``."""

    method: ClassVar[str] = "commit_weights"
    weights_version: int


@dataclasses.dataclass(frozen=True, slots=True)
class Discard(Request):
    """Rollout: drop a staged version; the committed one stays."""

    method: ClassVar[str] = "discard_weights"


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    """A version loaded: ``checksum`` what the worker holds now (hashed when proven), received:
    what it was received with, held_bytes: the transport's memory kept beside the user's,
    device_bytes: the device buckets a load by parts used (None: a whole load); route and
    stages: how a newcomer got it and where its time went (seconds by stage)."""

    checksum: str
    received: str
    weights_version: int
    held_bytes: int = 0
    device_bytes: int | None = None
    nbytes: int = 0
    route: str = ""
    stages: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: ``rollout_updates: in_flight``: a user call was running, so the version waits for its
    #: next safe point (``checksum`` is then what it was received with, not yet what it holds)
    deferred: bool = False


# -- a newcomer's resync, a spare ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveStaging(Request):
    """A spare: allocate and touch its staging buffer for ``nbytes`` of weights now."""

    method: ClassVar[str] = "reserve_staging"
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class SendTo(Request):
    """Send the committed version this worker holds to rank ``peer`` only, through shared
    memory when ``same_host`` (require_shm: fail rather than fall back)."""

    method: ClassVar[str] = "send_weights_to"
    peer: int
    timeout_s: float
    same_host: bool = False
    require_shm: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class SentTo:
    checksum: str
    nbytes: int
    weights_version: int
    stages: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveFrom(Request):
    """Receive ``weights_version`` from rank ``src``, prove it is ``checksum``, and load it."""

    method: ClassVar[str] = "receive_weights_from"
    src: int
    weights_version: int
    checksum: str
    timeout_s: float
    same_host: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class AdoptNodeCopy(Request):
    """Rollout newcomer: take the committed version from its node's copy ``name`` (owned by pid
    ``owner``), proven to be ``weights_version`` with ``checksum``, and load it."""

    method: ClassVar[str] = "adopt_node_copy"
    name: str
    owner: int
    group: str
    weights_version: int
    checksum: str


@dataclasses.dataclass(frozen=True, slots=True)
class FetchNodeCopy(Request):
    """Rollout newcomer: receive another node's copy ``name`` from the agent serving it
    (``served``: where it listens) point to point, proven by ``checksum``, and load it."""

    method: ClassVar[str] = "fetch_node_copy"
    served: Mapping[str, Any]
    name: str
    owner: int
    group: str
    weights_version: int
    checksum: str
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class TrainerChecksum(Request):
    """Trainer: the checksum of what its ``state_dict()`` returns now."""

    method: ClassVar[str] = "trainer_checksum"


@dataclasses.dataclass(frozen=True, slots=True)
class Checksum:
    checksum: str


# -- several trainer ranks -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PrepareShards(Request):
    """Trainer rank: call ``state_dict()`` and keep this rank's part for :class:`SendShards`."""

    method: ClassVar[str] = "prepare_shards"
    trainer_rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """The pieces a rank owns (records of name, dtype, shape, slice) and their bytes."""

    pieces: tuple[Sequence[Any], ...]
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class SendShards(Request):
    """Trainer rank: send the prepared part to every rank in ``peers`` at once."""

    method: ClassVar[str] = "send_shards"
    weights_version: int
    peers: tuple[int, ...]
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class PartSent:
    """A part sent: its checksum (None: it owned nothing), bytes, and receivers that rejected it."""

    checksum: str | None
    nbytes: int
    rejected: Mapping[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveShards(Request):
    """Rollout: receive every owning rank's part at once, assemble and stage the full state."""

    method: ClassVar[str] = "receive_shards"
    weights_version: int
    ownership: Mapping[str, Any]
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class NoteWeights(Request):
    """Trainer rank: its part went into committed ``weights_version`` with ``checksum``."""

    method: ClassVar[str] = "note_weights"
    weights_version: int
    checksum: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallsSinceCommit(Request):
    """Trainer rank: user calls started and completed since its part was last committed."""

    method: ClassVar[str] = "calls_since_commit"


@dataclasses.dataclass(frozen=True, slots=True)
class CallCounts:
    started: int
    done: int


@dataclasses.dataclass(frozen=True, slots=True)
class SendPart(Request):
    """Rollout: send what trainer rank ``trainer_rank`` owned of the committed version to ``peer``."""

    method: ClassVar[str] = "send_part_to"
    peer: int
    ownership: Mapping[str, Any]
    trainer_rank: int
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivePart(Request):
    """Trainer rank: receive its part of ``weights_version`` from rollout rank ``src``, proven to
    be what it sent then (``checksum``; None: it owned nothing), into ``load_state_dict``."""

    method: ClassVar[str] = "receive_part_from"
    src: int
    weights_version: int
    ownership: Mapping[str, Any]
    trainer_rank: int
    checksum: str | None
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class PartLoaded:
    received: str | None
    tensors: int


@dataclasses.dataclass(frozen=True, slots=True)
class PartChecksum(Request):
    """Trainer rank: the checksum of what it owns now (None: nothing) and how many pieces."""

    method: ClassVar[str] = "part_checksum"
    trainer_rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class PartHeld:
    checksum: str | None
    pieces: int


@dataclasses.dataclass(frozen=True, slots=True)
class DiscardShards(Request):
    """Trainer rank: drop a prepared part (the sync was refused or abandoned)."""

    method: ClassVar[str] = "discard_shards"


# -- the user's calls, benchmarks and chaos --------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class UserCall(Request):
    """A public method of the user's worker. logged: a trainer call kept in the replay log."""

    method: ClassVar[str] = "call"
    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    logged: bool = False
    #: answer with the weights versions the call ran under (:class:`Versioned`)
    versions: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Versioned:
    """A user call's result and the weights versions it ran under, in order: one, or more when
    it swapped at a safe point (``rollout_updates: in_flight``)."""

    value: Any
    versions: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RawBroadcast(Request):
    """Benchmarks: a bare broadcast of ``nbytes`` from ``root`` (every member calls it), or a bare
    point-to-point send to rank ``to``; seconds."""

    method: ClassVar[str] = "bench_raw_broadcast"
    nbytes: int
    root: int
    timeout_s: float
    to: int | None = None  # a bare point-to-point send from root to this rank instead


@dataclasses.dataclass(frozen=True, slots=True)
class ChaosKill(Request):
    """SIGKILL the process: at once, or once ``after_progress`` more units of progress are made."""

    method: ClassVar[str] = "chaos_kill"
    after_progress: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ChaosHang(Request):
    """SIGSTOP the process: at once, or once ``after_progress`` more units of progress are made."""

    method: ClassVar[str] = "chaos_hang"
    after_progress: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ChaosCorrupt(Request):
    """Corrupt the next bucket this worker receives."""

    method: ClassVar[str] = "chaos_corrupt_next_bucket"


class WorkerAPI(Protocol):
    """What a worker answers: one method per request class, named by its ``method``."""

    async def info(self, req: Info) -> Located: ...
    async def prewarm(self, req: Prewarm) -> Located: ...
    async def heartbeat(self, req: Beat) -> Heartbeat: ...
    async def vigil(self, req: Vigil) -> None: ...
    async def join(self, req: Join) -> Joined: ...
    async def setup_trainer_group(self, req: JoinTrainerGroup) -> Joined: ...
    async def abandon_transfer(self, req: Abandon) -> None: ...
    async def send_weights(self, req: SendWeights) -> Sent: ...
    async def receive_weights(self, req: ReceiveWeights) -> Staged: ...
    async def commit_weights(self, req: Commit) -> Loaded: ...
    async def discard_weights(self, req: Discard) -> None: ...
    async def reserve_staging(self, req: ReserveStaging) -> None: ...
    async def send_weights_to(self, req: SendTo) -> SentTo: ...
    async def receive_weights_from(self, req: ReceiveFrom) -> Loaded: ...
    async def adopt_node_copy(self, req: AdoptNodeCopy) -> Loaded: ...
    async def fetch_node_copy(self, req: FetchNodeCopy) -> Loaded: ...
    async def trainer_checksum(self, req: TrainerChecksum) -> Checksum: ...
    async def prepare_shards(self, req: PrepareShards) -> Prepared: ...
    async def send_shards(self, req: SendShards) -> PartSent: ...
    async def receive_shards(self, req: ReceiveShards) -> Staged: ...
    async def note_weights(self, req: NoteWeights) -> None: ...
    async def calls_since_commit(self, req: CallsSinceCommit) -> CallCounts: ...
    async def send_part_to(self, req: SendPart) -> PartSent: ...
    async def receive_part_from(self, req: ReceivePart) -> PartLoaded: ...
    async def part_checksum(self, req: PartChecksum) -> PartHeld: ...
    async def discard_shards(self, req: DiscardShards) -> None: ...
    async def call(self, req: UserCall) -> Any: ...
    async def bench_raw_broadcast(self, req: RawBroadcast) -> float: ...
    async def chaos_kill(self, req: ChaosKill) -> None: ...
    async def chaos_hang(self, req: ChaosHang) -> None: ...
    async def chaos_corrupt_next_bucket(self, req: ChaosCorrupt) -> None: ...


def requests() -> list[type[Request]]:
    """Every request class (each names one :class:`WorkerAPI` method)."""
    return sorted((v for v in globals().values() if isinstance(v, type) and issubclass(v, Request) and v is not Request),
                  key=lambda c: c.method)


__all__ = [name for name, value in globals().items()
           if isinstance(value, type) and value.__module__ == __name__ and not name.startswith("_")]
