"""The demo's trainer step, run in the trainer actor (or in one process by :func:`train_local`): REINFORCE
with a mean baseline and a stateless update, deterministic whatever order shards arrive in, and its sharded
form for several trainer ranks (docs/concepts.md, "The demo's training step")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ftstate.cli.demo import task
from ftstate.cli.demo.policy import build_policy, logprobs, sample, single_thread

_UPDATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sign": torch.sign,
    "sgd": lambda g: g,
}
#: The update rules a step takes (see the module docstring).
UPDATES = frozenset(_UPDATES)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step did: the batch's mean reward, the loss, the gradient norm before the
    update, and the step's wall time in seconds."""

    mean_reward: float
    loss: float
    grad_norm: float
    seconds: float


Batch = tuple[list[Sequence[int]], list[Sequence[int]], list[float]]


def in_prompt_order(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    prompt_ids: Sequence[int] | None,
    update: str,
) -> Batch:
    """The batch checked and, with ``prompt_ids``, put in prompt-id order (the canonical
    order a step computes in); without ``prompt_ids`` it is taken as already canonical."""
    if not (len(prompts) == len(completions) == len(rewards)) or not prompts:
        raise ValueError(
            f"need matching non-empty batches, got {len(prompts)} prompts, "
            f"{len(completions)} completions, {len(rewards)} rewards"
        )
    if update not in _UPDATES:
        raise ValueError(f"update must be one of {sorted(_UPDATES)}, got {update!r}")
    order = list(range(len(prompts)))
    if prompt_ids is not None:
        if len(prompt_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids")
        if len(set(prompt_ids)) != len(prompt_ids):
            raise ValueError("prompt ids must be unique within a step")
        order = sorted(order, key=lambda i: prompt_ids[i])
    return [prompts[i] for i in order], [completions[i] for i in order], [rewards[i] for i in order]


def reinforce_step(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    lr: float,
    *,
    prompt_ids: Sequence[int] | None = None,
    update: str = "sign",
) -> StepStats:
    """One REINFORCE step with a mean baseline, in place on ``model``; ``update`` is ``"sign"`` (signSGD) or
    ``"sgd"``. With ``prompt_ids`` the batch is put in prompt-id order first; without, the caller passes it in
    canonical order."""
    prompts, completions, rewards = in_prompt_order(prompts, completions, rewards, prompt_ids, update)
    start = time.perf_counter()
    r = torch.tensor(rewards, dtype=torch.float32)
    advantage = r - r.mean()
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    with single_thread():
        model.zero_grad(set_to_none=True)
        loss = -(advantage * logprobs(model, prompts, completions)).mean()
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.sub_(_UPDATES[update](p.grad), alpha=lr)
        model.zero_grad(set_to_none=True)
    return StepStats(
        mean_reward=float(r.mean()),
        loss=float(loss.detach()),
        grad_norm=grad_norm,
        seconds=time.perf_counter() - start,
    )


def row_slices(rows: int, ranks: int) -> list[tuple[int, int]] | None:
    """``(start, length)`` of each of ``ranks`` ranks' dim-0 slice of a ``rows``-row tensor by torch's
    ``chunk`` rule, or None when a rank would get an empty slice (rank 0 then owns it whole)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    size = -(-rows // ranks) if rows > 0 else 0
    if ranks == 1 or size == 0 or (ranks - 1) * size >= rows:
        return None
    return [(r * size, min(size, rows - r * size)) for r in range(ranks)]


@dataclasses.dataclass
class RankGradient:
    """One trainer rank's ``grads`` for its slice of a batch (every trainable parameter, zeros where the slice
    does not reach) and its share of the loss."""

    grads: list[torch.Tensor]
    loss: torch.Tensor


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a step updates (``requires_grad``; the ballast is not one), in order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def rank_gradient(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    rank: int,
    ranks: int,
) -> RankGradient:
    """Rank ``rank``'s gradient of its slice ``r::ranks`` of a canonical batch, with the whole batch's
    baseline and size; leaves weights and ``.grad`` alone."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank}")
    batch = len(prompts)
    r = torch.tensor(list(rewards), dtype=torch.float32)
    advantage = r - r.mean()
    params = [p for _, p in trainable(model)]
    mine = list(range(rank, batch, ranks))
    model.train()
    if not mine:
        return RankGradient([torch.zeros_like(p) for p in params], torch.zeros(()))
    with single_thread():
        lp = logprobs(model, [prompts[i] for i in mine], [completions[i] for i in mine])
        loss = -(advantage[mine] * lp).sum() / batch
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return RankGradient([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)],
                        loss.detach())


def sum_in_rank_order(parts: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """``parts[0] + parts[1] + ...`` tensor by tensor, added left to right in rank order."""
    total = [t.clone() for t in parts[0]]
    for part in parts[1:]:
        for acc, t in zip(total, part, strict=True):
            acc.add_(t)
    return total


def update_rows(param: torch.Tensor, grad: torch.Tensor, lr: float, update: str) -> None:
    """The stateless update of one tensor (or of the rows one rank owns): ``param -= lr * u(grad)``."""
    with torch.no_grad():
        param.sub_(_UPDATES[update](grad), alpha=lr)


def sharded_reinforce_step(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    lr: float,
    *,
    ranks: int,
    prompt_ids: Sequence[int] | None = None,
    update: str = "sign",
) -> StepStats:
    """One step as ``ranks`` trainer ranks take it, in one process: gradients added in rank order, then each
    rank's update of its rows; the reference of ``ShardedPolicyTrainer``."""
    prompts, completions, rewards = in_prompt_order(prompts, completions, rewards, prompt_ids, update)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    start = time.perf_counter()
    per_rank = [rank_gradient(model, prompts, completions, rewards, k, ranks) for k in range(ranks)]
    grads = sum_in_rank_order([g.grads for g in per_rank])
    [loss] = sum_in_rank_order([[g.loss] for g in per_rank])
    grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
    for (_, p), g in zip(trainable(model), grads, strict=True):
        slices = row_slices(p.shape[0] if p.ndim else 0, ranks)
        if slices is None:
            update_rows(p, g, lr, update)
            continue
        for first, length in slices:
            update_rows(p[first:first + length], g[first:first + length], lr, update)
    return StepStats(
        mean_reward=float(torch.tensor(list(rewards), dtype=torch.float32).mean()),
        loss=float(loss),
        grad_norm=grad_norm,
        seconds=time.perf_counter() - start,
    )


@dataclasses.dataclass
class RunResult:
    """A :func:`train_local` run: the trained model and, per step, the mean reward and stats."""

    model: nn.Module
    rewards: list[float]
    stats: list[StepStats]


#: Defaults of the demo run (seed aside); its timings and rewards are in docs/benchmarks.md.
BATCH_SIZE = 128
LR = 0.005
UPDATE = "sign"
TEMPERATURE = 1.0


def train_local(
    seed: int = 0,
    steps: int = 30,
    *,
    batch_size: int = BATCH_SIZE,
    lr: float = LR,
    temperature: float = TEMPERATURE,
    update: str = UPDATE,
    shards: int = 1,
    shard_order: Sequence[int] | None = None,
    trainer_ranks: int = 1,
    stamps: Sequence[Mapping[int, int]] | None = None,
    **size: float,
) -> RunResult:
    """The demo's loop in one process: prompts dealt into ``shards`` (prompt ``i`` to ``i % shards``), sampled
    in ``shard_order``, scored, stepped (sharded with ``trainer_ranks`` > 1); the result does not depend on
    ``shards`` or ``shard_order``. ``stamps`` replays a ``--async`` run: per step, the number of steps taken
    before each prompt's weights."""
    if trainer_ranks < 1:
        raise ValueError(f"trainer_ranks must be >= 1, got {trainer_ranks}")
    model = build_policy(seed, **size)  # type: ignore[arg-type]
    order = list(shard_order) if shard_order is not None else list(range(shards))
    if sorted(order) != list(range(shards)):
        raise ValueError(f"shard_order {order} is not a permutation of range({shards})")
    rewards: list[float] = []
    stats: list[StepStats] = []
    past = _PastWeights(model, seed, size) if stamps is not None else None
    for step in range(steps):
        batch = task.make_prompts(step, batch_size, seed)
        parts = [batch[i::shards] for i in range(shards)]
        ids: list[int] = []
        prompts: list[list[int]] = []
        completions: list[list[int]] = []
        for k in order:
            part = parts[k]
            ids += [pid for pid, _ in part]
            prompts += [toks for _, toks in part]
            if past is None or stamps is None:
                completions += sample(model, [toks for _, toks in part], step, [pid for pid, _ in part],
                                      task.N_DIGITS, temperature, seed=seed)
                continue
            for pid, toks in part:
                completions += sample(past.at(stamps[step][pid]), [toks], step, [pid], task.N_DIGITS,
                                      temperature, seed=seed)
        scores = [task.reward(p, c) for p, c in zip(prompts, completions, strict=True)]
        if trainer_ranks == 1:
            st = reinforce_step(model, prompts, completions, scores, lr, prompt_ids=ids, update=update)
        else:
            st = sharded_reinforce_step(model, prompts, completions, scores, lr, ranks=trainer_ranks,
                                        prompt_ids=ids, update=update)
        rewards.append(st.mean_reward)
        stats.append(st)
        if past is not None and stamps is not None:
            past.keep(step + 1, oldest=min((min(s.values()) for s in stamps[step + 1:] if s), default=step + 1))
    return RunResult(model=model, rewards=rewards, stats=stats)


class _PastWeights:
    """The weights after each step a replayed asynchronous run may still sample on, built on demand and
    dropped once no later stamp names them."""

    def __init__(self, model: nn.Module, seed: int, size: Mapping[str, Any]) -> None:
        self.model, self.seed, self.size = model, seed, size
        self.states: dict[int, dict[str, torch.Tensor]] = {0: _copy(model)}
        self.models: dict[int, nn.Module] = {}

    def keep(self, steps_done: int, oldest: int) -> None:
        self.states[steps_done] = _copy(self.model)
        for k in [k for k in self.states if k < oldest]:
            del self.states[k]
            self.models.pop(k, None)

    def at(self, steps_done: int) -> nn.Module:
        if steps_done not in self.states:
            raise ValueError(f"no weights after {steps_done} steps to replay a stamp with "
                             f"(kept: {sorted(self.states)})")
        if steps_done not in self.models:
            m = build_policy(self.seed, **self.size)  # type: ignore[arg-type]
            m.load_state_dict(self.states[steps_done])
            self.models[steps_done] = m
        return self.models[steps_done]


def _copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
