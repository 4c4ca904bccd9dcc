"""Maintenance and preemption notices: one watcher per source (gce, aws, azure, ray_drain, notice_file), a
detector, a registry and a runner. Every poll is bounded and raises nothing for a bad server: what could not
be read is a :class:`PollProblem`, never a notice."""

from __future__ import annotations

from ftstate.controller.maintenance.base import KINDS, SOURCES, Notice, PollProblem, PollResult, Watcher
from ftstate.controller.maintenance.detect import Detection, detect_sources, identify_cloud, read_dmi
from ftstate.controller.maintenance.registry import build_watchers, watchers_for
from ftstate.controller.maintenance.runner import MaintenanceWatcher

__all__ = [
    "KINDS",
    "SOURCES",
    "Detection",
    "MaintenanceWatcher",
    "Notice",
    "PollProblem",
    "PollResult",
    "Watcher",
    "build_watchers",
    "detect_sources",
    "identify_cloud",
    "read_dmi",
    "watchers_for",
]
