"""The demo's options (``ftstate demo``'s flags) and the constants its scenarios share.

Read by the job (:mod:`ftstate.cli.demo.run`, :mod:`ftstate.cli.demo.engine_run`) and its
report (:mod:`ftstate.cli.demo.report`); runs in the driver process.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """out: output folder; steps: RL steps; faults: inject the three kills; seed: the run's
    seed; batch_size: prompts per step; pad_mb: extra synced megabytes (a ballast tensor) to
    make syncs move more; rollouts: rollout workers; max_failovers: the failover budget
    (0 makes the first fault fatal); live: draw the live view; address: a running Ray
    cluster to join (``auto``, ``host:port``), none starts a local one; maintenance: the
    maintenance scenario (a local 3-node cluster, a GCE notice, a drain); trainers: trainer
    ranks (``trainer_workers``; more than 1 shards the policy over them); engine: the policy and
    its rollouts, ``policy`` (a dict of tensors) or ``vllm`` (a tiny Qwen2 served by vLLM
    engines: :mod:`ftstate.cli.demo.engine_run`); in_flight: ``--async``, the asynchronous loop
    (:func:`~ftstate.cli.demo.run.stamp_steps`); grow_to: grow the fleet to this many rollouts a third of the way in
    and shrink it back two thirds in (0: a fixed fleet); answer_tokens: ``--engine vllm``'s answer length (0: 4,
    or 96 with ``--async``)."""

    out: str = "ftstate-demo"
    steps: int = 24
    faults: bool = True
    seed: int = 1
    batch_size: int = 64
    pad_mb: float = 32.0
    rollouts: int = 2
    max_failovers: int = 5
    live: bool = True
    address: str | None = None
    maintenance: bool = False
    trainers: int = 1
    engine: str = "policy"
    in_flight: bool = False
    grow_to: int = 0
    answer_tokens: int = 0


#: The demo's engines (``--engine``): the dict-of-tensors policy, or a causal LM served by vLLM.
ENGINES = ("policy", "vllm")
#: The maintenance scenario's nodes (the first is the head, the driver's).
NODES = ("a", "b", "c")
#: Seconds from the announcement to the start of the maintenance window (the notice's deadline).
NOTICE_DEADLINE_S = 120.0
