"""The ``ftstate`` block of verl's ``checkpoint_engine.engine_kwargs``, read and checked once in each verl
worker and the manager. ``init_timeout_s``, ``sync_timeout_s``, ``backend``, ``fault_tolerance.max_failovers``
and ``audit_log`` mean what they mean in RuntimeConfig; the integration adds ``commit_mode`` (``stream``,
default: yield each verified bucket; ``staged``: yield nothing until the whole update verified on every
rollout, held once per node), ``group`` (the store's weight group, default ``verl-weights``), ``device_host``
(the gloo bind address) and ``store_host`` (the driver store's address), both defaulting to the Ray address.
Anything else is a :class:`~ftstate.core.errors.ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError

#: Where the block lives in verl's config, used in error paths.
PREFIX = "checkpoint_engine.engine_kwargs.ftstate"

COMMIT_MODES = ("stream", "staged")

#: RuntimeConfig fields the verl integration uses; other RuntimeConfig keys mean nothing here.
RUNTIME_KEYS = ("init_timeout_s", "sync_timeout_s", "backend", "fault_tolerance", "audit_log", "security")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The checked ``ftstate`` block. ``runtime`` carries the RuntimeConfig-named settings."""

    runtime: RuntimeConfig
    commit_mode: Literal["stream", "staged"] = "stream"
    group: str = "verl-weights"
    device_host: str | None = None
    store_host: str | None = None

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> EngineSettings:
        data = dict(kwargs or {})
        commit_mode = data.pop("commit_mode", "stream")
        if commit_mode not in COMMIT_MODES:
            raise ConfigError(f"{PREFIX}.commit_mode", f"must be one of {', '.join(COMMIT_MODES)}, got {commit_mode!r}")
        group = data.pop("group", "verl-weights")
        if not isinstance(group, str) or not group or "/" in group:
            raise ConfigError(f"{PREFIX}.group", f"must be a non-empty string without '/', got {group!r}")
        hosts = {}
        for key in ("device_host", "store_host"):
            value = data.pop(key, None)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{PREFIX}.{key}", f"must be an address string, got {value!r}")
            hosts[key] = value
        unknown = sorted(k for k in data if k not in RUNTIME_KEYS)
        if unknown:
            known = ", ".join(sorted((*RUNTIME_KEYS, "commit_mode", "group", "device_host", "store_host")))
            raise ConfigError(f"{PREFIX}.{unknown[0]}", f"unknown key; known keys: {known}")
        try:
            runtime = RuntimeConfig.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{PREFIX}.{exc.path}" if exc.path else PREFIX, exc.problem) from exc
        return cls(runtime=runtime, commit_mode=commit_mode, group=group, **hosts)

    def to_kwargs(self) -> dict[str, Any]:
        """The block again (what a worker's engine is built from)."""
        return {
            "init_timeout_s": self.runtime.init_timeout_s,
            "sync_timeout_s": self.runtime.sync_timeout_s,
            "backend": self.runtime.backend,
            "security": {"authenticate": self.runtime.security.authenticate,
                         "integrity": self.runtime.security.integrity},
            "commit_mode": self.commit_mode,
            "group": self.group,
            **({"device_host": self.device_host} if self.device_host else {}),
            **({"store_host": self.store_host} if self.store_host else {}),
        }


__all__ = ["COMMIT_MODES", "EngineSettings"]
