"""ftstate: fault-tolerant weight synchronisation for disaggregated RL post-training.

The public API is re-exported here; everything else is an implementation module.
Importing ``ftstate`` loads the pure core only (no Ray, no torch): the runtime and the
transport are imported when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftstate.core.audit import AuditTrail, read_trail
from ftstate.core.budget import Budget
from ftstate.core.config import FaultToleranceConfig, RuntimeConfig
from ftstate.core.deadline import Deadline, LoopClock, ManualClock
from ftstate.core.errors import (
    AuditFileError,
    AuditViolation,
    BackendUnavailable,
    ChecksumMismatch,
    CommunicatorAborted,
    ConfigError,
    CrashLoop,
    DeadlineExceeded,
    EngineProcessDied,
    EngineRefused,
    EngineTorn,
    ExtraUnavailable,
    FailoverBudgetExhausted,
    FailoverTimeout,
    FTError,
    HeartbeatTimeout,
    HeldWeightsMismatch,
    IntegrationUnavailable,
    InternalError,
    InvalidTransition,
    LossyRecoveryRefused,
    ManifestError,
    MemberLost,
    NoFreeSlot,
    NoServingWorkers,
    OwnershipError,
    PeerLost,
    PlacementUnsatisfiable,
    ProtocolError,
    RankNotRecoverable,
    RendezvousTimeout,
    ReplacementFailed,
    ScaleRefused,
    SharedMemoryUnavailable,
    SpecError,
    StaleCheckpointRefused,
    StaleGroupVersion,
    StateDictError,
    SyncTimeout,
    TransportError,
    UsageError,
    UserCodeError,
    WorkerInitError,
)
from ftstate.core.machine import StateMachine
from ftstate.core.ownership import Shard
from ftstate.core.spec import MachineSpec, get_spec, load_machines, load_spec
from ftstate.core.worker import RolloutWorker, TrainerWorker

__version__ = "0.1.0"

# Names served lazily: they pull in Ray and torch, which the core must not import.
_LAZY: dict[str, str] = {
    "MemberInfo": "ftstate.controller.runtime",
    "Runtime": "ftstate.controller.runtime",
    "SyncReport": "ftstate.controller.sync",
}

if TYPE_CHECKING:
    from ftstate.controller.runtime import MemberInfo, Runtime
    from ftstate.controller.sync import SyncReport


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ftstate' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AuditFileError",
    "AuditTrail",
    "AuditViolation",
    "BackendUnavailable",
    "Budget",
    "ChecksumMismatch",
    "CommunicatorAborted",
    "ConfigError",
    "CrashLoop",
    "Deadline",
    "DeadlineExceeded",
    "EngineProcessDied",
    "EngineRefused",
    "EngineTorn",
    "ExtraUnavailable",
    "FTError",
    "FailoverBudgetExhausted",
    "FailoverTimeout",
    "FaultToleranceConfig",
    "HeartbeatTimeout",
    "HeldWeightsMismatch",
    "IntegrationUnavailable",
    "InternalError",
    "InvalidTransition",
    "LoopClock",
    "LossyRecoveryRefused",
    "MachineSpec",
    "ManifestError",
    "ManualClock",
    "MemberInfo",
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
    "RolloutWorker",
    "Runtime",
    "RuntimeConfig",
    "ScaleRefused",
    "Shard",
    "SharedMemoryUnavailable",
    "SpecError",
    "StaleCheckpointRefused",
    "StaleGroupVersion",
    "StateDictError",
    "StateMachine",
    "SyncReport",
    "SyncTimeout",
    "TrainerWorker",
    "TransportError",
    "UsageError",
    "UserCodeError",
    "WorkerInitError",
    "get_spec",
    "load_machines",
    "load_spec",
    "read_trail",
]
