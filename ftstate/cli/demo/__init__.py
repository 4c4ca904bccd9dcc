"""``ftstate demo``: the main job on the embedded default (see :mod:`ftstate.cli.demo.run`).

``task`` (the toy task and its reward), ``policy`` (a tiny transformer and seeded
sampling), ``reinforce`` (the policy-gradient step, on one trainer or several ranks), ``workers`` (the trainer, its sharded ranks and the rollout
classes), ``live`` (the terminal view) and ``run`` (the job, its faults and its proof);
for the maintenance scenario (``ftstate demo --maintenance``), ``nodes`` (a local multi-node
cluster, each node with environment variables of its own) and ``metadata_server`` (a loopback
GCE metadata server that announces host maintenance).
"""

from __future__ import annotations

from ftstate.cli.demo.run import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
