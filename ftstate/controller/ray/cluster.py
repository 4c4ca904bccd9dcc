"""The Ray cluster a runtime runs on, from the driver: join the one the config names, reuse this process's, or
start a local one bound to loopback only (which needs ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` set before Ray
is imported, as this module does)."""

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
    """Make sure this process is connected to a Ray cluster; True when this call started a local one (its
    owner shuts it down). ``log_to_driver``: forward the workers' output here."""
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
            # "local": always a new cluster; else Ray would join one `ray start` left running (that is
            # `address: auto`).
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
    """What commonly keeps a driver out of a running cluster (Ray 2.60): a head with token auth refuses a
    driver without ``RAY_AUTH_MODE=token``; a loopback head is unreachable without the loopback variable."""
    hints = []
    if os.environ.get("RAY_AUTH_MODE") is None and os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        hints.append("if the cluster uses token authentication (Ray turns it on when ~/.ray/auth_token exists "
                     "where the head started), set RAY_AUTH_MODE=token here")
    if os.environ.get(_LOOPBACK_ENV) != "0":
        hints.append(f"if the head runs on this machine's loopback, set {_LOOPBACK_ENV}=0 here too")
    return "" if not hints else " (" + "; ".join(hints) + ")"


def mute_worker_death_notices() -> None:
    """Stop Ray's per-death "(raylet) A worker died" notices in this driver (the demo records every death
    itself), with the switch Ray's debugger uses; a Ray without it keeps printing them."""
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
