"""``ftstate demo``: the main job on the embedded default (see :mod:`ftstate.cli.demo.run`).

``task`` (the toy task and its reward), ``policy`` (a tiny transformer and seeded
sampling), ``reinforce`` (the policy-gradient step, on one trainer or several ranks), ``workers`` (the trainer, its sharded ranks and the rollout
classes), ``live`` (the terminal view), ``options`` (its flags), ``run`` (the job, its faults and its
proof) and ``report`` (report.json and the verdict);
for ``ftstate demo --engine vllm``, ``llm`` (a tiny Qwen2, its task and its transformers
trainer), ``engine_rollout`` (a vLLM engine answering the task) and ``engine_run`` (that job,
its faults and its proof, read back from the engines);
for the maintenance scenario (``ftstate demo --maintenance``), ``nodes`` (a local multi-node
cluster, each node with environment variables of its own) and ``metadata_server`` (a loopback
GCE metadata server that announces host maintenance).
"""

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
