"""Moving weights between a trainer and its rollout workers, surviving the death of any of them.

Each module's design: docs/concepts.md, "The transport's modules in detail".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "StoreAddress": "ftstate.transport.store",
    "StoreServer": "ftstate.transport.store",
    "Communicator": "ftstate.transport.base",
    "create_communicator": "ftstate.transport.factory",
    "Sender": "ftstate.transport.sync",
    "Receiver": "ftstate.transport.sync",
    "CommittedWeights": "ftstate.transport.sync",
    "TransferReport": "ftstate.transport.sync",
    "DEFAULT_BUCKET_SIZE": "ftstate.transport.sync",
    "state_checksum": "ftstate.transport.checksum",
    "bucket_bytes": "ftstate.transport.buckets",
    "check_state_dict": "ftstate.transport.validate",
}

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "CommittedWeights",
    "Communicator",
    "Receiver",
    "Sender",
    "StoreAddress",
    "StoreServer",
    "TransferReport",
    "bucket_bytes",
    "check_state_dict",
    "create_communicator",
    "state_checksum",
]

if TYPE_CHECKING:
    from ftstate.transport.base import Communicator
    from ftstate.transport.buckets import bucket_bytes
    from ftstate.transport.checksum import state_checksum
    from ftstate.transport.factory import create_communicator
    from ftstate.transport.store import StoreAddress, StoreServer
    from ftstate.transport.sync import DEFAULT_BUCKET_SIZE, CommittedWeights, Receiver, Sender, TransferReport
    from ftstate.transport.validate import check_state_dict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ftstate.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
