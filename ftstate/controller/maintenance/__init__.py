"""Maintenance and preemption notices: one watcher per source, a detector and a runner.

Sources (one module each, each with its provider's answers parsed by pure functions):
``gce`` (metadata server: maintenance-event, preempted, upcoming-maintenance), ``aws``
(IMDSv2: spot instance-action, rebalance recommendation, scheduled events), ``azure``
(Scheduled Events, with acknowledgement), ``ray_drain`` (the nodes Ray's GCS is draining),
``notice_file`` (a file an operator writes). ``detect`` picks the sources for
``maintenance_sources: [auto]`` without a network request; ``registry`` builds watchers;
``runner`` polls them and reports new notices, withdrawals and problems; ``node_actor``
runs the node-local sources on each node as a light Ray actor (Ray imported lazily).

Every poll is bounded (``maintenance_request_timeout_s`` per request) and raises nothing for
a bad server: what could not be read is a :class:`PollProblem`, never a notice.
"""

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
