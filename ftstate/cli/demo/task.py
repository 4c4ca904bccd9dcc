"""The demo's toy task, for the demo's workers and driver: sort three digits (``BOS 7 2 5 SEP`` → ``2 5 7``),
rewarded 1/3 per correct position. Prompts are a pure function of (seed, step, index) with run-unique ids, so
samples are seeded by prompt, not by worker. A random policy scores ≈ 0.07, learns digit placement (≈ 0.2),
then copying (past 0.4). No Ray, no torch."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

#: Tokens 0-9 are the digits themselves.
DIGITS = tuple(range(10))
BOS = 10
SEP = 11
EOS = 12
PAD = 13
#: The policy's vocabulary: the ten digits and the special tokens above.
VOCAB_SIZE = 14
#: Digits in a prompt, and tokens in an answer.
N_DIGITS = 3
#: ``BOS`` + digits + ``SEP``.
PROMPT_LEN = N_DIGITS + 2

TOKEN_NAMES = {BOS: "<s>", SEP: "|", EOS: "</s>", PAD: "_"}


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts``, the same in every process (blake2b, not ``hash()``,
    which Python randomises per process for strings)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_prompts(step: int, batch_size: int, seed: int) -> list[tuple[int, list[int]]]:
    """The prompts of one step: ``batch_size`` pairs ``(prompt_id, tokens)``, deterministic in ``(step,
    batch_size, seed)``; ids are ``step * batch_size + i``."""
    out = []
    for i in range(batch_size):
        rng = random.Random(derive_seed("prompt", seed, step, i))
        digits = [rng.choice(DIGITS) for _ in range(N_DIGITS)]
        out.append((step * batch_size + i, [BOS, *digits, SEP]))
    return out


def target(prompt_tokens: Sequence[int]) -> list[int]:
    """The right answer: the prompt's digits in ascending order."""
    return sorted(t for t in prompt_tokens if t in DIGITS)


def reward(prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> float:
    """Fraction of the answer's positions holding the sorted digits (0.0 to 1.0); missing ones score 0."""
    want = target(prompt_tokens)
    if not want:
        raise ValueError(f"prompt {list(prompt_tokens)} holds no digits")
    hits = sum(1 for i, tok in enumerate(completion_tokens[: len(want)]) if tok == want[i])
    return hits / len(want)


def render(tokens: Sequence[int]) -> str:
    """Tokens as text, e.g. ``<s> 7 2 5 | 2 5 7``."""
    return " ".join(TOKEN_NAMES.get(t, str(t)) for t in tokens)
