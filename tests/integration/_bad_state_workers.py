"""A trainer whose ``state_dict()`` returns, on demand, a state the transport cannot send
(imported by the Ray worker processes of test_bad_state_dict.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from tests.integration.workers import TinyTrainer


def _quantized(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    with warnings.catch_warnings():  # torch's deprecation notice for quantized dtypes
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(state["layer.bias"], 0.1, 0, torch.quint8)
    return {**state, "layer.bias": q}


#: mode → what ``state_dict()`` returns instead of the trainer's state.
BAD: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "str": lambda s: {**s, "layer.bias": "not a tensor"},
    "sparse": lambda s: {**s, "layer.weight": s["layer.weight"].to_sparse()},
    "meta": lambda s: {**s, "layer.bias": torch.empty(32, device="meta")},
    "pairs": lambda s: list(s.items()),
    "empty": lambda s: {},
    "int key": lambda s: {**s, 7: torch.zeros(1)},
    "quantized": _quantized,
    "conj": lambda s: {**s, "rotary": torch.ones(4, dtype=torch.complex64).conj()},
}


class BadStateTrainer(TinyTrainer):
    """:class:`TinyTrainer` whose ``state_dict()`` returns ``BAD[mode](state)`` until the mode
    is set back to ``"good"`` (it stays bad across calls, so a retry would fail again)."""

    mode = "good"

    def set_mode(self, mode: str) -> None:
        if mode != "good" and mode not in BAD:
            raise ValueError(f"unknown mode {mode!r}; known: good, {', '.join(BAD)}")
        self.mode = mode

    def state_dict(self):
        if self.mode == "good":
            return super().state_dict()
        return BAD[self.mode](self.state)
