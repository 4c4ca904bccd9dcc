"""The demo's workers, run in the demo's Ray actors: a REINFORCE trainer (one, or
:class:`ShardedPolicyTrainer` over several ranks) and rollouts that sample the toy task. Both are
deterministic given their arguments, so a replaced trainer replays the steps since the last sync and lands on
the same weights (docs/concepts.md, "The demo's training step")."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ftstate.cli.demo import task
from ftstate.cli.demo.policy import build_policy, sample
from ftstate.cli.demo.reinforce import (
    UPDATES,
    in_prompt_order,
    rank_gradient,
    reinforce_step,
    row_slices,
    trainable,
    update_rows,
)
from ftstate.core.ownership import Shard
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

    def generate_stamped(self, step: int, shard: Sequence[tuple[int, Sequence[int]]]) -> list[tuple[int, list[int], float, int]]:
        """:meth:`generate` for ``--async``: a safe point before each prompt, and each sample stamped with the
        version it ran on, ``[(prompt_id, completion, reward, version)]``."""
        out = []
        for pid, tokens in shard:
            version = self.safe_point()
            completion = sample(self.model, [list(tokens)], step, [pid], task.N_DIGITS, seed=self.seed)[0]
            out.append((pid, completion, task.reward(list(tokens), completion), version))
        return out

    def checksum(self) -> str:
        return state_checksum({k: v.detach() for k, v in self.model.state_dict().items()})


class ShardedPolicyTrainer(TrainerWorker):
    """One of ``N`` trainer ranks of the demo's policy; ``update`` is stateless either way, so a replaced rank
    has no optimizer state to miss. ``part`` is the authoritative state; ``model`` is a compute buffer a step
    fills with the gathered weights. Collectives run on the group given to :meth:`setup`; gradients are
    all-gathered and summed in rank order, not all-reduced."""

    def __init__(self, seed: int, size: Mapping[str, Any], lr: float, update: str = "sign") -> None:
        if update not in UPDATES:
            raise ValueError(f"update must be one of {sorted(UPDATES)}, got {update!r}")
        self.seed = seed
        self.lr = lr
        self.update = update
        self.model = build_policy(seed, **dict(size))
        #: Every tensor of the full state, in ``state_dict`` order: its shape and dtype.
        self.meta = {name: (tuple(t.shape), t.dtype) for name, t in self.model.state_dict().items()}
        self.group: Any = None
        self.rank, self.world = 0, 1
        self.part: dict[str, Any] | None = None
        self.steps = 0
        self.loads = 0
        self.setups = 0

    # -- ownership ------------------------------------------------------------------------

    def _layout(self) -> dict[str, list[tuple[int, int]] | None]:
        """Per tensor of the state: each rank's ``(start, length)`` rows, or None (rank 0 whole)."""
        return {name: row_slices(shape[0] if shape else 0, self.world) for name, (shape, _) in self.meta.items()}

    def setup(self, group: Any, rank: int, world_size: int) -> None:
        """The trainer group (again after every membership change: a survivor keeps its part, a first rank or
        newcomer cuts its part of the seeded initial weights)."""
        if self.part is not None and (rank, world_size) != (self.rank, self.world):
            raise RuntimeError(f"trainer rank {self.rank} of {self.world} was handed rank {rank} of {world_size}: "
                               "its part covers other rows")
        self.group, self.rank, self.world = group, rank, world_size
        self.setups += 1
        if self.part is None:
            full = self.model.state_dict()
            self.part = {}
            for name, slices in self._layout().items():
                if slices is not None:
                    first, length = slices[rank]
                    self.part[name] = Shard(full[name][first:first + length].detach().clone(), 0, rank, world_size)
                elif rank == 0:
                    self.part[name] = full[name].detach().clone()
            if hasattr(self.model, "ballast"):
                del self.model.ballast

    def state_dict(self) -> dict[str, Any]:
        """This rank's part only (no collective)."""
        return dict(self._own())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """This rank's part of the last committed version back (no collective)."""
        self.loads += 1
        self.part = {k: Shard(v.tensor.detach().clone(), v.dim, v.index, v.count) if isinstance(v, Shard)
                     else v.detach().clone() for k, v in state.items()}

    def _own(self) -> dict[str, Any]:
        if self.part is None:
            raise RuntimeError("ShardedPolicyTrainer has no part before setup(): it needs the trainer group")
        return self.part

    def _local(self, name: str) -> torch.Tensor | None:
        v = self._own().get(name)
        return v.tensor if isinstance(v, Shard) else v

    # -- collectives on the trainer group ---------------------------------------------------

    def _gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` from every rank's part: one all-gather per dtype of a flat buffer with
        an equal-length, padded segment per tensor on every rank."""
        layout = self._layout()
        out: dict[str, torch.Tensor] = {}
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in names:
            by_dtype.setdefault(self.meta[name][1], []).append(name)
        for dtype, group_names in by_dtype.items():
            segments: list[torch.Tensor] = []
            for name in group_names:
                shape, slices = self.meta[name][0], layout[name]
                if slices is None:
                    mine = self._local(name) if self.rank == 0 else None
                    segments.append(mine.reshape(-1) if mine is not None else torch.zeros(shape, dtype=dtype).reshape(-1))
                else:
                    row = math.prod(shape[1:])
                    seg = torch.zeros(slices[0][1] * row, dtype=dtype)
                    mine = self._local(name)
                    assert mine is not None, f"rank {self.rank} holds no part of {name}"
                    seg[: mine.numel()] = mine.reshape(-1)
                    segments.append(seg)
            flat = torch.cat(segments)
            gathered = [torch.empty_like(flat) for _ in range(self.world)]
            self.group.allgather([gathered], [flat]).wait()
            offset = 0
            for name, seg in zip(group_names, segments, strict=True):
                shape, slices = self.meta[name][0], layout[name]
                if slices is None:
                    out[name] = gathered[0][offset:offset + seg.numel()].view(shape).clone()
                else:
                    row = math.prod(shape[1:])
                    out[name] = torch.cat([gathered[k][offset:offset + length * row].view(length, *shape[1:])
                                           for k, (_, length) in enumerate(slices)])
                offset += seg.numel()
        return {name: out[name] for name in names}

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered from every rank (collective), in ``state_dict`` order."""
        return self._gather(list(self.meta))

    def train(self, prompt_ids: Sequence[int], prompts: Sequence[Sequence[int]],
              completions: Sequence[Sequence[int]], rewards: Sequence[float]) -> dict[str, float]:
        """One step over the whole batch, called on every rank together (collective)."""
        start = time.perf_counter()
        prompts, completions, rewards = in_prompt_order(prompts, completions, rewards, prompt_ids, self.update)
        names = [name for name, _ in trainable(self.model)]
        full = self._gather(names)
        with torch.no_grad():
            for name, p in trainable(self.model):
                p.copy_(full[name])
        mine = rank_gradient(self.model, prompts, completions, rewards, self.rank, self.world)
        flat = torch.cat([g.reshape(-1) for g in mine.grads] + [mine.loss.reshape(1)])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        self.group.allgather([gathered], [flat]).wait()
        total = gathered[0].clone()
        for other in gathered[1:]:  # rank order, the same bits on every rank
            total.add_(other)
        layout = self._layout()
        offset = 0
        for name, p in trainable(self.model):
            g = total[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            slices = layout[name]
            if slices is None:
                if self.rank == 0:
                    update_rows(self._local(name), g, self.lr, self.update)
                continue
            first, length = slices[self.rank]
            update_rows(self._local(name), g[first:first + length], self.lr, self.update)
        self.steps += 1
        reward = float(torch.tensor(list(rewards), dtype=torch.float32).mean())
        return {"reward": reward, "loss": float(total[-1]), "seconds": time.perf_counter() - start}

    def checksum(self) -> str:
        """The full weights' checksum (collective), comparable with the single trainer's and the rollouts'."""
        return state_checksum(self.full_state())

    def facts(self) -> dict[str, Any]:
        """Rank, world, pid and counts (setups, loads, steps) of this rank."""
        return {"rank": self.rank, "world": self.world, "pid": os.getpid(), "setups": self.setups,
                "loads": self.loads, "steps": self.steps}
