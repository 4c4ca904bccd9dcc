"""Moving weights between a trainer and its rollout workers, surviving the death of any of them.

The public surface, re-exported here and loaded lazily (importing this package imports
neither torch nor any backend; the first use of a name below does):

* :class:`StoreServer` — the controller's store (TCPStore on one address), which outlives
  every member; :class:`StoreAddress` — where members reach it.
* :func:`create_communicator` — join version N of a named group with the ``gloo`` or
  ``nccl`` backend; :class:`Communicator` — the formed group version (abandon it with
  :meth:`~Communicator.abort` and form N+1 to change membership).
* :class:`Sender` / :class:`Receiver` — bucketed, pipelined, checksummed transfers of a
  whole state: broadcast to every member or point-to-point to one; the receiver commits
  atomically and keeps its previous :class:`CommittedWeights` on any failure.
  :class:`SyncReport` — what the sender learns.
* :func:`state_checksum` — the whole-state checksum (names, dtypes, shapes, bytes).
* :func:`bucket_bytes` — the config's ``bucket_size_mb`` in bytes.
* :func:`check_state_dict` — the check of a user's state before it is sent: a typed
  :class:`~ftstate.core.errors.StateDictError` naming the tensor for one that cannot travel.

Modules: ``store`` (store, versioned rendezvous, fencing), ``base`` (the communicator
interface), ``factory`` (a backend by name), ``gloo`` and ``nccl`` (backends), ``buckets`` (layout and bucket
planning), ``manifest`` (wire messages), ``checksum`` (hashing), ``validate`` (what a user's
state must be to travel), ``sync`` (Sender and Receiver: the one transfer loop, broadcast and
point-to-point), ``stream`` (a transfer's ordered messages and votes), ``hashing`` (one side's
hashing and the seal's check), ``weights`` (committed weights, the sender's report),
``routes`` (how the buckets' bytes travel: one interface, one module per route), ``offer``
(what a same-host sender offers its receivers), ``samehost`` (the same protocol with the
buckets through shared memory for receivers on the sender's host: ``samehost.broadcast`` /
``send_to`` / ``receive``), ``shm`` (its segments),
``cudaipc`` (its slots in device memory, CUDA IPC), ``nodecopy`` (``staging: node``: one
full-size copy per node, verified in place, the source of newcomers there and, served by its
agent, of newcomers on other nodes), ``devicebuckets`` (a device engine's load from the host
copy through two buckets of device memory) and ``signals`` (its pyzmq bucket-ready / released
signals).
Nothing here imports Ray.
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
    "SyncReport": "ftstate.transport.sync",
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
    "SyncReport",
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
    from ftstate.transport.sync import DEFAULT_BUCKET_SIZE, CommittedWeights, Receiver, Sender, SyncReport
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
