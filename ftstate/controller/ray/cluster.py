"""The Ray cluster a runtime runs on: join the one the config names, reuse the one this
process already started, or start a local one (the embedded default).

A local cluster binds loopback only: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` must be in the
environment before Ray is imported (Ray reads it at import), otherwise Ray binds the
machine's network address even when told 127.0.0.1 (DESIGN.md, measured). This module sets
it before it imports Ray; on a real cluster (``address`` given) it changes nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ftstate.core.errors import ConfigError, UsageError

_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _import_ray(local: bool) -> Any:
    if local and "ray" not in sys.modules:
        os.environ.setdefault(_LOOPBACK_ENV, "0")
    import ray

    return ray


def connect(address: str | None, *, num_cpus: int | None = None, log_to_driver: bool = True) -> bool:
    """Make sure this process is connected to a Ray cluster. Returns True when this call
    started a local cluster (its owner shuts it down), False when it joined or reused one.
    log_to_driver: forward the workers' output here (the demo turns it off: the raylet's
    notice for every worker it sees killed would bury the live view)."""
    ray = _import_ray(local=address is None)
    if ray.is_initialized():
        return False
    if address is None:
        if os.environ.get(_LOOPBACK_ENV) != "0":
            raise UsageError(
                f"a local Ray cluster must bind loopback: set {_LOOPBACK_ENV}=0 before Ray is imported "
                "(import ftstate.controller.ray.cluster first, or set it in the environment)"
            )
        ray.init(
            # "local": always a new cluster of its own. Without it Ray would join whatever
            # cluster `ray start` left running on this machine; joining one is `address: auto`.
            address="local",
            num_cpus=num_cpus if num_cpus is not None else max(2, os.cpu_count() or 2),
            include_dashboard=False,
            logging_level="ERROR",
            configure_logging=True,
            log_to_driver=log_to_driver,
        )
        return True
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=log_to_driver)
    except ConnectionError as exc:
        raise ConfigError("address", f"cannot connect to the Ray cluster at {address!r}: {exc}"
                          f"{_join_hint()}") from exc
    return False


def _join_hint() -> str:
    """What commonly keeps a driver out of a running cluster, where it applies (measured with
    Ray 2.60): a head started while ``~/.ray/auth_token`` exists uses token authentication,
    and a driver without ``RAY_AUTH_MODE=token`` is refused; a loopback head (started with
    the loopback variable) is unreachable for a driver without it, which turns 127.0.0.1
    into the machine's network address."""
    hints = []
    if os.environ.get("RAY_AUTH_MODE") is None and os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        hints.append("if the cluster uses token authentication (Ray turns it on when ~/.ray/auth_token exists "
                     "where the head started), set RAY_AUTH_MODE=token here")
    if os.environ.get(_LOOPBACK_ENV) != "0":
        hints.append(f"if the head runs on this machine's loopback, set {_LOOPBACK_ENV}=0 here too")
    return "" if not hints else " (" + "; ".join(hints) + ")"


def mute_worker_death_notices() -> None:
    """Stop this driver printing Ray's "(raylet) A worker died or was killed…" notice, which
    comes through the raylet's error channel even with ``log_to_driver`` off, one per dead
    worker. For the demo, which kills workers on purpose and records every death (pid, node,
    trigger) in its audit trail: the notices would only bury its live view. It flips the
    switch Ray's own debugger uses for the same purpose (``ray.util.rpdb``); on a Ray
    without it the notices simply keep printing."""
    ray = _import_ray(local=False)
    worker_module = ray._private.worker
    if hasattr(worker_module, "_worker_logs_enabled"):
        worker_module._worker_logs_enabled = False


def node_address() -> str:
    """The address Ray reports for this node (127.0.0.1 on the embedded default)."""
    ray = _import_ray(local=False)
    return ray.util.get_node_ip_address()


def node_id() -> str:
    """Ray's id of this process's node (nodes may share an address; the id tells them apart)."""
    ray = _import_ray(local=False)
    return ray.get_runtime_context().get_node_id()


def shutdown() -> None:
    ray = _import_ray(local=False)
    if ray.is_initialized():
        ray.shutdown()
