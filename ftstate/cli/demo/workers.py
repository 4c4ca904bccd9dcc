"""The demo's workers: a REINFORCE trainer and rollouts that sample the toy task.

Both hold the same :class:`~ftstate.cli.demo.policy.Policy`; the trainer's ``state_dict`` is
what every sync moves. ``generate`` samples one shard of a step's prompts, seeded per
(run seed, step, prompt id) and scored by the task; ``train`` takes the whole step's batch
(in prompt-id order, whatever order the shards came back in). Both are deterministic given
their arguments, which is what lets a replaced trainer replay the steps since the last
committed sync and land on the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ftstate.cli.demo import task
from ftstate.cli.demo.policy import build_policy, sample
from ftstate.cli.demo.reinforce import reinforce_step
from ftstate.core.worker import RolloutWorker, TrainerWorker
from ftstate.transport import state_checksum


class PolicyTrainer(TrainerWorker):
    """seed: the run's seed (weights and prompts); size: build_policy's size arguments;
    lr: the learning rate of the stateless update."""

    def __init__(self, seed: int, size: Mapping[str, Any], lr: float) -> None:
        self.seed = seed
        self.lr = lr
        self.model = build_policy(seed, **dict(size))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(state))

    def train(self, prompt_ids: Sequence[int], prompts: Sequence[Sequence[int]],
              completions: Sequence[Sequence[int]], rewards: Sequence[float]) -> dict[str, float]:
        stats = reinforce_step(self.model, prompts, completions, rewards, self.lr, prompt_ids=prompt_ids)
        return {"reward": stats.mean_reward, "loss": stats.loss, "seconds": stats.seconds}

    def checksum(self) -> str:
        return state_checksum(self.state_dict())


class PolicyRollout(RolloutWorker):
    """Samples completions with the last committed weights."""

    def __init__(self, seed: int, size: Mapping[str, Any]) -> None:
        self.seed = seed
        self.model = build_policy(seed, **dict(size))
        self.version = 0

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(dict(state))
        self.version = version

    def generate(self, step: int, shard: Sequence[tuple[int, Sequence[int]]]) -> list[tuple[int, list[int], float]]:
        """Sample and score one shard: ``[(prompt_id, completion, reward)]`` in shard order."""
        ids = [pid for pid, _ in shard]
        prompts = [list(tokens) for _, tokens in shard]
        completions = sample(self.model, prompts, step, ids, task.N_DIGITS, seed=self.seed)
        return [(pid, c, task.reward(p, c)) for pid, p, c in zip(ids, prompts, completions, strict=True)]

    def checksum(self) -> str:
        return state_checksum({k: v.detach() for k, v in self.model.state_dict().items()})
