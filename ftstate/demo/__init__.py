"""``ftstate demo``: the main job on the embedded default (see :func:`run_demo`)."""

from __future__ import annotations

from ftstate.demo.scripted import run_demo

__all__ = ["run_demo"]
