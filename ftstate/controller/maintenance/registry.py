"""From source names to watchers: one factory per source, and the config's shortcut.

:func:`build_watchers` makes the watchers for a list of sources; :func:`watchers_for` does
detection and building from a ``fault_tolerance`` config block, keeping only the sources a
caller runs where it is (the driver: ``ray``; a node's :class:`NodeWatcherActor`: the
metadata sources and ``file``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ftstate.controller.maintenance import aws, azure, gce
from ftstate.controller.maintenance.base import SOURCES, Watcher
from ftstate.controller.maintenance.detect import DMI_DIR, Detection, detect_sources
from ftstate.controller.maintenance.notice_file import NoticeFileWatcher
from ftstate.controller.maintenance.ray_drain import AsyncRayDrainWatcher, DrainingNodes, RayDrainWatcher
from ftstate.core.config import FaultToleranceConfig

Factory = Callable[..., Watcher]


def _gce(*, endpoints: Mapping[str, str], environ: Mapping[str, str], timeout: float, **_: Any) -> Watcher:
    return gce.GceWatcher(gce.endpoint(endpoints.get("gce"), environ), timeout=timeout)


def _aws(*, endpoints: Mapping[str, str], environ: Mapping[str, str], timeout: float, **_: Any) -> Watcher:
    return aws.AwsWatcher(aws.endpoint(endpoints.get("aws"), environ), timeout=timeout)


def _azure(*, endpoints: Mapping[str, str], environ: Mapping[str, str], timeout: float, **_: Any) -> Watcher:
    return azure.AzureWatcher(azure.endpoint(endpoints.get("azure"), environ), timeout=timeout)


def _ray(*, timeout: float, ray_draining: DrainingNodes | None = None, **_: Any) -> Watcher:
    if inspect.iscoroutinefunction(ray_draining):  # the controller's backend: awaited on its loop
        return AsyncRayDrainWatcher(timeout=timeout, draining=ray_draining)
    return RayDrainWatcher(timeout=timeout, draining=ray_draining)


def _file(*, maintenance_file: str | None, **_: Any) -> Watcher:
    if not maintenance_file:
        raise ValueError("the file maintenance source needs maintenance_file")
    return NoticeFileWatcher(maintenance_file)


#: One factory per source.
REGISTRY: dict[str, Factory] = {"gce": _gce, "aws": _aws, "azure": _azure, "ray": _ray, "file": _file}


def build_watchers(
    sources: Sequence[str],
    *,
    timeout: float,
    endpoints: Mapping[str, str] | None = None,
    maintenance_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    ray_draining: DrainingNodes | None = None,
) -> list[Watcher]:
    """One watcher per source (in ``sources``' order). Endpoints: the override, else the
    provider's variable in ``environ`` (default ``os.environ``), else the provider's address.
    Builds only: nothing is contacted until a watcher is polled."""
    env = os.environ if environ is None else environ
    return [REGISTRY[s](endpoints=endpoints or {}, environ=env, timeout=timeout, maintenance_file=maintenance_file,
                        ray_draining=ray_draining) for s in sources]


def watchers_for(
    ft: FaultToleranceConfig,
    *,
    include: Sequence[str] = SOURCES,
    environ: Mapping[str, str] | None = None,
    dmi: Mapping[str, str] | None = None,
    dmi_dir: str | os.PathLike[str] = DMI_DIR,
    ray_draining: DrainingNodes | None = None,
) -> tuple[Detection, list[Watcher]]:
    """Detection from the config (``maintenance_sources``, endpoints, file) and the watchers of
    the detected sources that are in ``include``. Record ``detection.note`` once."""
    detection = detect_sources(ft.maintenance_sources, endpoints=ft.maintenance_endpoints,
                               maintenance_file=ft.maintenance_file, environ=environ, dmi=dmi, dmi_dir=dmi_dir)
    here = [s for s in detection.sources if s in include]
    watchers = build_watchers(here, timeout=ft.maintenance_request_timeout_s, endpoints=ft.maintenance_endpoints,
                              maintenance_file=ft.maintenance_file, environ=environ, ray_draining=ray_draining)
    return detection, watchers
