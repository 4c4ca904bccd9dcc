"""Every error ftstate raises, in one tree; catch :class:`FTError` or the most specific class.

    FTError
    ├── ConfigError              a config value is missing, unknown, mistyped or out of range
    ├── SpecError                a machine spec in machines/ is malformed
    ├── InvalidTransition        an event arrived that the machine's current state does not accept
    ├── DeadlineExceeded         a state's deadline expired (what, after how long, version, missing)
    │   ├── RendezvousTimeout    init_timeout_s: not every member joined / passed the first barrier
    │   ├── SyncTimeout          sync_timeout_s: one weight sync did not finish
    │   ├── FailoverTimeout      failover_timeout_s: a replacement did not serve current weights in time
    │   └── HeartbeatTimeout     heartbeat_timeout_s: a worker stopped making progress
    ├── FailoverBudgetExhausted  max_failovers (or the window's rate) spent; names the failures it went to
    │   └── CrashLoop            one member slot replaced max_slot_failovers times in the window (slot, class)
    ├── MemberLost               a worker died or was declared lost and nothing replaced it
    ├── WorkerInitError          a worker class's constructor raised (member, class, the user's exception and frame)
    ├── UserCodeError            a worker's own method returned what its contract forbids, or is missing (member, method)
    ├── ProtocolError            a worker was asked out of the protocol's order (member, request, what it holds)
    ├── ReplacementFailed        a replacement's own code raised while it was brought up (not retried: not a fault)
    ├── LossyRecoveryRefused     reverse recovery would rebuild a trainer from lossy weights
    ├── RankNotRecoverable       a trainer rank would have to be restored with no committed version
    ├── StaleCheckpointRefused   a replaced trainer's checkpoint holds an older version (rollback off)
    ├── NoServingWorkers         a call needs a serving worker with current weights and none is
    ├── PlacementUnsatisfiable   the cluster can never place a resource pool as configured
    ├── ScaleRefused             add/remove/scale_rollouts asked for what the run cannot do (field, expected)
    ├── IntegrationUnavailable   an integration's framework (verl, vllm) cannot be imported; names the extra
    ├── ExtraUnavailable         a feature needs a package of an extra that is not installed (feature, package, extra)
    ├── NoFreeSlot               a resource pool has no slot for another worker (pool, why)
    ├── InternalError            an invariant of ftstate's own code broke: a bug to report, not a fault to handle
    ├── EngineRefused            an inference engine set up in a mode ftstate cannot keep safe (setting, value, why)
    ├── EngineTorn               a request reached an engine whose last weight load stopped part-way
    ├── EngineProcessDied        a process of a rollout's engine (core, TP worker) died under a live actor (process, pid)
    ├── StateDictError           user code handed weights the transport cannot send (also a TypeError)
    ├── OwnershipError           trainer ranks' state_dicts overlap, leave a gap or disagree (tensor, ranks)
    ├── TransportError           moving weights failed
    │   ├── BackendUnavailable   the chosen backend (e.g. nccl) cannot load here
    │   ├── SharedMemoryUnavailable  /dev/shm is missing, full or too small for the same-host route
    │   ├── StaleGroupVersion    a message or collective from an older group version (fencing)
    │   ├── ChecksumMismatch     a bucket's bytes do not hash to the manifest's checksum
    │   │   └── HeldWeightsMismatch  what a member holds after loading does not hash to the sender's checksum
    │   ├── ManifestError        a message (manifest, seal, offer, signal, store value) is malformed (.field, .peer)
    │   ├── PeerLost             a peer died or vanished mid-collective (.group, .rank, .op, .peer)
    │   └── CommunicatorAborted  a transfer on a communicator that was aborted: form a new version
    ├── AuditViolation           an audit trail breaks an invariant of the machines
    └── AuditFileError           a file given as an audit trail is not one (empty, no records, no such run)

    UsageError                   ftstate used the wrong way (a runtime not started, or started twice;
                                 a member, node or chaos target that does not exist): outside the tree

Messages name what, who, how long and which version; the same facts are attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ftstate.core.text import listed


class FTError(Exception):
    """Base of every error ftstate raises; pickles with its attributes, since subclasses' constructors take
    facts, not the message."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[FTError], args: tuple[object, ...], state: dict[str, object]) -> FTError:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ConfigError(FTError, ValueError):
    """Raised when a config value is missing, unknown, mistyped or out of range (``path``: dotted field)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


class SpecError(FTError, ValueError):
    """Raised when a machine spec is malformed; names the file and the state or transition."""

    def __init__(self, source: str, where: str, problem: str) -> None:
        self.source = source
        self.where = where
        self.problem = problem
        super().__init__(f"{source}: {where}: {problem}" if where else f"{source}: {problem}")


class InvalidTransition(FTError):
    """Raised when a trigger is fired in a state that has no transition for it."""

    def __init__(self, machine: str, member: str, state: str, trigger: str, allowed: Sequence[str]) -> None:
        self.machine = machine
        self.member = member
        self.state = state
        self.trigger = trigger
        self.allowed = tuple(allowed)
        super().__init__(
            f"{machine} machine of {member}: no transition for trigger {trigger!r} from state "
            f"{state}; allowed from {state}: {', '.join(self.allowed) or 'none'}"
        )


class DeadlineExceeded(FTError, TimeoutError):
    """Raised (or recorded) when a state's deadline expires; ``key`` is the config key that set it."""

    def __init__(
        self,
        what: str,
        *,
        key: str,
        seconds: float,
        member: str = "",
        group_version: int | None = None,
        missing: Iterable[str] = (),
        arrived: Iterable[str] = (),
    ) -> None:
        self.what = what
        self.key = key
        self.seconds = seconds
        self.member = member
        self.group_version = group_version
        self.missing = tuple(sorted(missing))
        self.arrived = tuple(sorted(arrived))
        parts = [f"{what} timed out after {seconds:g}s ({key})"]
        if member:
            parts.append(f"member {member}")
        if group_version is not None:
            parts.append(f"group version {group_version}")
        if self.missing:
            parts.append(f"missing: {', '.join(self.missing)}")
        if self.arrived:
            parts.append(f"arrived: {', '.join(self.arrived)}")
        super().__init__("; ".join(parts))


class RendezvousTimeout(DeadlineExceeded):
    """``init_timeout_s`` passed before every member joined the group version."""


class SyncTimeout(DeadlineExceeded):
    """``sync_timeout_s`` passed before one weight sync completed."""


class FailoverTimeout(DeadlineExceeded):
    """``failover_timeout_s`` passed before a replacement served the current weights."""


class HeartbeatTimeout(DeadlineExceeded):
    """``heartbeat_timeout_s`` passed without a heartbeat showing progress."""


class FailoverBudgetExhausted(FTError):
    """Raised when a loss needs a failover that ``max_failovers`` (or the window's rate) cannot pay for."""

    def __init__(self, *, limit: int, spent_on: Sequence[str], member: str = "",
                 key: str = "fault_tolerance.max_failovers", window_s: float | None = None) -> None:
        self.limit = limit
        self.spent_on = tuple(spent_on)
        self.member = member
        self.key = key
        self.window_s = window_s
        spent = listed(self.spent_on) or "nothing"
        who = f" by {member}" if member else ""
        within = f" within failover_window_s={window_s:g}" if window_s is not None else ""
        super().__init__(
            f"failover budget exhausted{who}: {key.rpartition('.')[2]}={limit}{within} already spent on: {spent}"
        )


class CrashLoop(FailoverBudgetExhausted):
    """Raised when one member slot was replaced ``max_slot_failovers`` times in the window and is lost."""

    def __init__(self, *, slot: str, cls: str | None, limit: int, spent_on: Sequence[str], window_s: float | None,
                 member: str = "") -> None:
        self.slot = slot
        self.cls = cls
        self.limit, self.spent_on, self.member, self.window_s = limit, tuple(spent_on), member, window_s
        self.key = "fault_tolerance.max_slot_failovers"
        within = f" within {window_s:g} s" if window_s is not None else ""
        of = f" (class {cls})" if cls else ""
        FTError.__init__(
            self,
            f"crash loop: slot {slot}{of} lost {len(self.spent_on)} times{within}, more than "
            f"max_slot_failovers={limit} replacements: every replacement dies; its losses: {listed(self.spent_on)}",
        )


class MemberLost(FTError):
    """Raised when a worker died or was declared lost and the run cannot replace it."""

    def __init__(self, member: str, reason: str, *, group_version: int | None = None) -> None:
        self.member = member
        self.reason = reason
        self.group_version = group_version
        version = f" (group version {group_version})" if group_version is not None else ""
        super().__init__(f"{member} lost{version}: {reason}")


class WorkerInitError(FTError):
    """Raised when the user's worker class raised in its constructor (``where``: the user's frame)."""

    def __init__(
        self, *, member: str, role: str, cls: str, exc_type: str, message: str, where: str = "", traceback: str = "",
    ) -> None:
        self.member = member
        self.role = role
        self.cls = cls
        self.exc_type = exc_type
        self.message = message
        self.where = where
        self.traceback = traceback
        at = f" (at {where})" if where else ""
        super().__init__(f"{member}: {cls}.__init__() raised {exc_type}: {message}{at}")


class UserCodeError(FTError):
    """Raised when a user worker's method returned what its contract forbids, or is missing."""

    def __init__(self, member: str, method: str, problem: str) -> None:
        self.member = member
        self.method = method
        self.problem = problem
        super().__init__(f"{member}: {method} {problem}")


class ProtocolError(FTError):
    """Raised in a worker asked out of protocol order: a bug in ftstate, never the user's doing."""

    def __init__(self, member: str, request: str, problem: str) -> None:
        self.member = member
        self.request = request
        self.problem = problem
        super().__init__(f"{member}: {request}: {problem}")


class ReplacementFailed(FTError):
    """Raised when a replacement's own code raised before it served; not retried (it would fail again)."""

    def __init__(self, *, member: str, replaces: str, method: str, exc_type: str, message: str,
                 where: str = "") -> None:
        self.member = member
        self.replaces = replaces
        self.method = method
        self.exc_type = exc_type
        self.message = message
        self.where = where
        at = f" (at {where})" if where else ""
        super().__init__(f"{member}, replacing {replaces}: {method} raised {exc_type}: {message}{at}; a replacement's "
                         "own code failing before it served is not a fault to fail over from, so the run ends here")


class LossyRecoveryRefused(FTError):
    """Raised when a trainer would be rebuilt from lossy weights and ``allow_lossy_recovery`` is off."""


class RankNotRecoverable(FTError):
    """Raised when a lost trainer rank's recovery needs a committed version and none exists yet."""

    def __init__(self, members: Sequence[str]) -> None:
        self.members = tuple(members)
        super().__init__(
            f"{', '.join(self.members)}: would have to be taken back to the last committed weights version to "
            "replay the trainer calls with the replaced rank, but none was committed yet (sync once before the "
            "first trainer call, or declare the trainer class's rank_local_calls)")


class StaleCheckpointRefused(FTError):
    """Raised when a replaced trainer's checkpoint holds an older version and rollback is off."""

    def __init__(
        self, *, member: str, checkpoint: str, held: str, expected: str, current_version: int,
        matches_version: int | None,
    ) -> None:
        self.member = member
        self.checkpoint = checkpoint
        self.held = held
        self.expected = expected
        self.current_version = current_version
        self.matches_version = matches_version
        what = (f"weights version {matches_version}" if matches_version is not None
                else "no weights version committed in this run")
        super().__init__(
            f"{member}: checkpoint {checkpoint!r} holds {what} (checksum {held}), not the current weights "
            f"version {current_version} ({expected}); refusing to roll the run back. Save checkpoints right "
            "after a sync, or set fault_tolerance.allow_checkpoint_rollback to accept the rollback"
        )


class NoServingWorkers(FTError):
    """Raised when a call needs a worker that serves the current weights and none does."""


class PlacementUnsatisfiable(FTError):
    """Raised by ``start()`` when no placement of a resource pool can exist on the cluster as it is."""

    def __init__(self, *, pool: str, asked: str, cluster: str, problem: str) -> None:
        self.pool = pool
        self.asked = asked
        self.cluster = cluster
        self.problem = problem
        super().__init__(f"cannot place resource pool {pool!r}: {problem}; asked {asked}; the cluster has {cluster}")


class ScaleRefused(FTError, ValueError):
    """Raised by add/remove/scale_rollouts, before anything changed, when the request cannot be met."""

    def __init__(self, *, field: str, expected: str, got: str) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {got}")


class IntegrationUnavailable(FTError):
    """Raised when an integration's framework cannot be imported; not an ImportError (no "plugin absent")."""

    def __init__(self, *, framework: str, extra: str, cause: str) -> None:
        self.framework = framework
        self.extra = extra
        self.cause = cause
        super().__init__(
            f"the {framework} integration cannot load: {cause.strip().splitlines()[0] if cause.strip() else 'import failed'}; "
            f"install it with: pip install 'ftstate[{extra}]'"
        )


class ExtraUnavailable(FTError):
    """Raised when a feature needs a package of an ftstate extra that is not installed."""

    def __init__(self, *, feature: str, package: str, extra: str, cause: str) -> None:
        self.feature = feature
        self.package = package
        self.extra = extra
        self.cause = cause
        super().__init__(f"{feature} needs {package} ({cause}): pip install 'ftstate[{extra}]'")


class NoFreeSlot(FTError):
    """Raised when a resource pool has no slot for another worker (``why``: all in use, or all avoided)."""

    def __init__(self, pool: str, why: str) -> None:
        self.pool = pool
        self.why = why
        super().__init__(f"resource pool {pool!r} has no free slot ({why})")


class InternalError(FTError):
    """Raised when an invariant of ftstate's own code broke: a bug to report, with the audit trail."""


class UsageError(RuntimeError):
    """Raised when ftstate is used the wrong way; deliberately no :class:`FTError`: a bug, not a fault."""


class EngineRefused(FTError, ValueError):
    """Raised when an engine is asked for in a mode whose failures ftstate cannot detect or clean up."""

    def __init__(self, *, setting: str, value: object, why: str) -> None:
        self.setting = setting
        self.value = value
        self.why = why
        super().__init__(f"{setting}={value!r} is refused: {why}")


class EngineTorn(FTError):
    """Raised when a request reaches an engine whose last weight load stopped part-way."""

    def __init__(self, *, weights_version: int, cause: str) -> None:
        self.weights_version = weights_version
        self.cause = cause
        super().__init__(f"the engine's load of weights version {weights_version} stopped part-way ({cause}); "
                         "it serves nothing until a complete load")


class EngineProcessDied(FTError):
    """Raised when a process of a rollout's engine (e.g. a vLLM TP worker) dies while the actor lives."""

    def __init__(self, *, process: str, pid: int, how: str, member: str = "") -> None:
        self.process, self.pid, self.how, self.member = process, pid, how, member
        who = f"{member}: " if member else ""
        super().__init__(f"{who}engine process {process} (pid {pid}) {how}; the engine is stopped, its other "
                         "processes killed, and the member is lost (a spare takes its place)")

    def for_member(self, member: str) -> EngineProcessDied:
        """The same death, naming the member (an engine does not know which member it serves)."""
        return EngineProcessDied(process=self.process, pid=self.pid, how=self.how, member=member)


class StateDictError(FTError, TypeError):
    """Raised, before anything is sent, when user code hands weights that cannot travel; never retried."""

    def __init__(
        self, member: str, tensor: str | None, got: str, expected: str, *, what: str = "state_dict()"
    ) -> None:
        self.member = member
        self.tensor = tensor
        self.got = got
        self.expected = expected
        self.what = what
        where = what if tensor is None else f"{what}[{tensor!r}]"
        who = f"{member}: " if member else ""
        super().__init__(f"{who}{where}: got {got}, expected {expected}")


class OwnershipError(FTError, ValueError):
    """Raised when the trainer ranks' state_dicts overlap, leave a gap or disagree
    (:mod:`ftstate.core.ownership`)."""

    def __init__(self, tensor: str, ranks: Iterable[int], problem: str) -> None:
        self.tensor = tensor
        self.ranks = tuple(ranks)
        self.problem = problem
        who = ", ".join(str(r) for r in self.ranks)
        super().__init__(f"tensor {tensor!r} (trainer ranks {who}): {problem}" if tensor
                         else f"trainer ranks {who}: {problem}")


class TransportError(FTError):
    """Base of the errors raised while moving weights."""


class BackendUnavailable(TransportError):
    """Raised when the chosen transport backend cannot be loaded on this machine."""


class SharedMemoryUnavailable(TransportError):
    """Raised (with ``shared_memory: require``) when a same-host shared-memory segment cannot be created."""

    def __init__(self, *, path: str, nbytes: int, problem: str) -> None:
        self.path = path
        self.nbytes = nbytes
        self.problem = problem
        super().__init__(f"shared memory unavailable: cannot create {path} of {nbytes} bytes: {problem}")


class StaleGroupVersion(TransportError):
    """Raised when a message or collective belongs to an older group version than the current one."""

    def __init__(self, group: str, got: int, current: int, peer: str = "") -> None:
        self.group = group
        self.got = got
        self.current = current
        self.peer = peer
        src = f" from {peer}" if peer else ""
        super().__init__(
            f"group {group!r}: rejected message{src} for version {got}; current version is {current}"
        )


class ChecksumMismatch(TransportError):
    """Raised when received bytes do not hash to the checksum the manifest promised."""


class HeldWeightsMismatch(ChecksumMismatch):
    """Raised (and recorded) when what a member holds after loading does not hash to the sender's checksum."""

    def __init__(self, member: str, *, weights_version: int, held: str, expected: str, what: str = "") -> None:
        self.member = member
        self.weights_version = weights_version
        self.held = held
        self.expected = expected
        source = f" ({what})" if what else ""
        super().__init__(
            f"{member}: holds weights that hash to {held} after loading weights version {weights_version}"
            f"{source}, the sender's checksum is {expected}"
        )


class ManifestError(TransportError):
    """Raised when a received message or store value is malformed (``field``, ``peer`` when known)."""

    def __init__(self, message: str, *, field: str | None = None, peer: str | None = None) -> None:
        self.field = field
        self.peer = peer
        super().__init__(message)


class PeerLost(TransportError):
    """Raised when a peer dies or vanishes mid-collective; ``peer`` is None where no rank can be named."""

    def __init__(
        self,
        message: str,
        *,
        group: str | None = None,
        group_version: int | None = None,
        rank: int | None = None,
        op: str | None = None,
        peer: int | None = None,
    ) -> None:
        self.group = group
        self.group_version = group_version
        self.rank = rank
        self.op = op
        self.peer = peer
        super().__init__(message)


class CommunicatorAborted(TransportError):
    """Raised when a transfer starts on an aborted communicator: form the next group version."""

    def __init__(self, group: str, group_version: int, rank: int, reason: str) -> None:
        self.group = group
        self.group_version = group_version
        self.rank = rank
        self.reason = reason
        super().__init__(
            f"rank {rank} of group {group!r} v{group_version}: communicator was aborted ({reason}); "
            "form a new group version"
        )


class AuditViolation(FTError):
    """Raised when an audit trail breaks an invariant of the machines."""

    def __init__(self, source: str, line: int, problem: str) -> None:
        self.source = source
        self.line = line
        self.problem = problem
        super().__init__(f"{source}:{line}: {problem}")


class AuditFileError(FTError, ValueError):
    """Raised when a file given as an audit trail is not one: ``path`` and ``problem``."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


__all__ = [
    "AuditFileError",
    "AuditViolation",
    "BackendUnavailable",
    "ChecksumMismatch",
    "CommunicatorAborted",
    "ConfigError",
    "CrashLoop",
    "DeadlineExceeded",
    "EngineProcessDied",
    "EngineRefused",
    "EngineTorn",
    "ExtraUnavailable",
    "FTError",
    "FailoverBudgetExhausted",
    "FailoverTimeout",
    "HeartbeatTimeout",
    "HeldWeightsMismatch",
    "IntegrationUnavailable",
    "InternalError",
    "InvalidTransition",
    "LossyRecoveryRefused",
    "ManifestError",
    "MemberLost",
    "NoFreeSlot",
    "NoServingWorkers",
    "OwnershipError",
    "PeerLost",
    "PlacementUnsatisfiable",
    "ProtocolError",
    "RankNotRecoverable",
    "RendezvousTimeout",
    "ReplacementFailed",
    "ScaleRefused",
    "SharedMemoryUnavailable",
    "SpecError",
    "StaleCheckpointRefused",
    "StaleGroupVersion",
    "StateDictError",
    "SyncTimeout",
    "TransportError",
    "UsageError",
    "UserCodeError",
    "WorkerInitError",
]
