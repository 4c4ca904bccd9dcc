"""Workers and helpers of the vLLM suite and benchmarks/vllm_update.py (imported by Ray workers).

* :class:`QwenTrainer`: the trainer side, a Qwen2 checkpoint's tensors in bf16 read with
  safetensors (no transformers model: the suite tests the weight path, not training);
  ``train_step`` moves every tensor by a seeded amount, and ``save`` writes the current
  weights as a checkpoint folder an engine can start from (the reference for generation).

The rollouts are in :mod:`tests.vllm.rollouts` (they import vLLM; the trainer's process need not).
"""

from __future__ import annotations

import os
import shutil

import torch

from ftstate import TrainerWorker
from ftstate.transport import state_checksum

#: Engine arguments for the tiny model on this machine: small KV cache, no graph capture.
ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
#: A tensor-parallel engine here: vLLM's automatic CPU binding refuses two workers on one NUMA
#: node, so each rank gets one core; its message queues' address stays on the loopback.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_HOST_IP": "127.0.0.1"}


def rollout_kwargs(tp: int = 1) -> dict:
    """VLLMRollout's keyword arguments for the suite's engines, at tensor-parallel size ``tp``."""
    if tp == 1:
        return {"engine_kwargs": ENGINE_KWARGS}
    return {"engine_kwargs": {**ENGINE_KWARGS, "tensor_parallel_size": tp}, "engine_env": TP_ENV}


#: Prompts as token ids (the tiny model's WordLevel tokenizer is not what vLLM loads for Qwen2).
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [4000, 17]]


def engine_environment() -> dict[str, str]:
    """What every process of the suite runs with, set before Ray starts (its workers inherit it)."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


class QwenTrainer(TrainerWorker):
    """The checkpoint's tensors in bf16; ``train_step`` adds seeded noise to every float tensor."""

    def __init__(self, model: str) -> None:
        from safetensors.torch import load_file

        self.model = model
        self.state = {k: v.to(torch.bfloat16) for k, v in sorted(load_file(os.path.join(model, "model.safetensors")).items())}
        self.steps = 0

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = {k: v.clone() for k, v in state.items()}

    def train_step(self, scale: float = 0.02) -> int:
        self.steps += 1
        g = torch.Generator().manual_seed(1000 + self.steps)
        with torch.no_grad():
            for t in self.state.values():
                t.add_((torch.randn(t.shape, generator=g) * scale).to(t.dtype))
        return self.steps

    def checksum(self) -> str:
        return state_checksum(self.state)

    def save(self, path: str) -> str:
        """The current weights as a checkpoint folder (config and tokenizer copied from the model)."""
        from safetensors.torch import save_file

        shutil.copytree(self.model, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.contiguous() for k, v in self.state.items()}, os.path.join(path, "model.safetensors"))
        return path
