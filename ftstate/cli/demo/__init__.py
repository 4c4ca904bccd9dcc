"""``ftstate demo``: the main job, run from the driver (:mod:`ftstate.cli.demo.run`; its options in
``options``, its report and verdict in ``report``; the vLLM engine demo in ``engine_run``; the
maintenance scenario's cluster in ``nodes``)."""

from __future__ import annotations

from typing import Any

from ftstate.cli.demo import run
from ftstate.cli.demo.run import DemoOptions


def run_demo(out: str = "ftstate-demo", steps: int = 0, faults: bool | None = None, **options: Any) -> int:
    """Run the demo with the engine ``options["engine"]`` names (``policy``, the default, or
    ``vllm``); returns the exit code (0: it survived and every proof held)."""
    if options.get("engine", "policy") == "vllm":
        from ftstate.cli.demo.engine_run import run_engine_demo

        return run_engine_demo(out, steps, faults, **options)
    return run.run_demo(out, steps, faults, **options)


__all__ = ["DemoOptions", "run_demo"]
