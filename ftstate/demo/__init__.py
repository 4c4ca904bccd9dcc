"""``ftstate demo``: the main job on the embedded default (see :mod:`ftstate.demo.run`).

``run`` drives real RL on a local Ray cluster with injected faults; ``scripted`` drives
the machines alone through a scripted run (no Ray, no torch), for a first look.
"""

from __future__ import annotations

from ftstate.demo.run import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
