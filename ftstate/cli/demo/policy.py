"""The demo's policy, built in the demo's trainer and rollouts: a tiny causal transformer (about 0.1 M
parameters by default; ``pad_mb`` adds a synced, never-read ballast) and sampling seeded per (run seed, step,
prompt id), never per worker, one prompt at a time on one thread, so runs are bit-for-bit reproducible
(docs/concepts.md, "The demo's training step")."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ftstate.cli.demo.task import VOCAB_SIZE, derive_seed


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP (4x wide)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, n, h, d // h).transpose(1, 2) for t in (q, k, v))
        # Plain matmul + softmax rather than scaled_dot_product_attention: one code path
        # on every build, no kernel chosen by shape.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Policy(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, a final norm and a
    vocabulary head. ``forward(tokens[b, n]) -> logits[b, n, vocab]``."""

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        d_model: int = 64,
        layers: int = 2,
        heads: int = 4,
        max_len: int = 16,
        pad_mb: float = 0.0,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        if pad_mb > 0:
            # Ballast: synced like every weight, read by nothing; random, so a misplaced bucket changes the
            # checksum.
            self.ballast = nn.Parameter(torch.randn(int(pad_mb * 2**20) // 4) * 0.02, requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        if n > self.max_len:
            raise ValueError(f"sequence of {n} tokens is longer than max_len={self.max_len}")
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_policy(
    seed: int,
    *,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_len: int = 16,
    pad_mb: float = 0.0,
    vocab_size: int = VOCAB_SIZE,
) -> Policy:
    """A freshly initialised policy; the same ``seed`` and sizes give identical weights in any process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("policy", seed))
        model = Policy(vocab_size, d_model, layers, heads, max_len, pad_mb)
    return model


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the block with one intra-op thread, then restore the count; process-wide, so call :func:`sample`
    and :func:`logprobs` from one thread at a time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sample_seed(seed: int, step: int, prompt_id: int) -> int:
    """The seed of one prompt's generator: a function of the run, the step and the prompt
    only — never of the worker that serves it."""
    return derive_seed("sample", seed, step, prompt_id)


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    step: int,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[list[int]]:
    """Sample one completion per prompt (the new tokens). Each prompt runs alone with its :func:`sample_seed`
    generator, so its completion depends on nothing but the weights, its seed, tokens and settings.
    ``temperature <= 0`` is greedy; with ``eos_id`` a completion stops after it."""
    if len(prompts) != len(prompt_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids")
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    try:
        with single_thread():
            for prompt, pid in zip(prompts, prompt_ids, strict=True):
                gen = torch.Generator().manual_seed(sample_seed(seed, step, pid))
                seq = torch.tensor([list(prompt)], dtype=torch.long)
                new: list[int] = []
                for _ in range(max_new_tokens):
                    logits = model(seq)[0, -1].double()
                    if temperature <= 0:
                        tok = int(logits.argmax())
                    else:
                        probs = torch.softmax(logits / temperature, dim=-1)
                        tok = int(torch.multinomial(probs, 1, generator=gen))
                    new.append(tok)
                    seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
                    if tok == eos_id:
                        break
                out.append(new)
    finally:
        model.train(was_training)
    return out


def logprobs(
    model: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Summed log-probabilities of each completion given its prompt (``[batch]``, with gradients), in one
    right-padded batch; the result depends on the batch, so the trainer passes it in prompt-id order."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    longest = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest - 1, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        tokens[i, : len(s)] = torch.tensor(s)
        # Predictions at positions len(p)-1 .. len(s)-2 score the completion's tokens.
        mask[i, len(p) - 1 : len(s) - 1] = True
    with single_thread():
        logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)
        picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return (picked * mask).sum(dim=1)
