"""The vLLM suite's rollout: :class:`~ftstate.integrations.vllm.VLLMRollout` with the faults the
tests inject (imported by the Ray workers that host it):

* weights changed inside the engine behind ftstate's back, through a layer's packed kernel (on
  CPU the kernel's copy is the only one), now or right after the next load (a buggy loader);
* a SIGKILL of its own process part-way through vLLM's loader (a torn engine that dies);

and the baseline of ``benchmarks/vllm_update.py``: vLLM's own reload fed in-process from the
tensors the engine holds, with no ftstate in the way (:meth:`ProbedRollout.native_reload`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from ftstate.integrations.vllm import VLLMRollout, held


class ProbedRollout(VLLMRollout):
    """A VLLMRollout whose engine can be tampered with and whose next load can be killed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tamper_next = False
        self._kill_after: int | None = None

    def tamper_now(self, layer: str = "model.layers.0.mlp.down_proj") -> None:
        """Change one weight of ``layer`` inside the engine, behind ftstate's back: the layer's
        packed kernel is rebuilt from a copy with one element negated (on CPU the parameter is
        empty: the kernel's own copy is the only one)."""
        def tamper(model: torch.nn.Module) -> None:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            module = model.get_submodule(layer)
            k = module.input_size_per_partition
            slot = held.Slot(layer, "weight", True, (0, module.output_size_per_partition),
                             (module.output_size_per_partition, k), module.weight.dtype)
            w = held._whole(module, slot).contiguous().clone()  # (N, K), as the checkpoint holds it
            w[0, 0] = -w[0, 0] if w[0, 0] != 0 else 1.0
            module.weight = torch.nn.Parameter(w, requires_grad=False)
            dispatch_cpu_unquantized_gemm(module, remove_weight=True)

        with self._lock:
            self._on_model(tamper)

    def tamper_next_load(self) -> None:
        self._tamper_next = True

    def kill_during_next_load(self, after: int = 5) -> None:
        """SIGKILL this process after ``after`` tensors of the next load reached vLLM's loader."""
        self._kill_after = after

    def load_weights(self, state, version: int) -> None:
        super().load_weights(state, version)
        if self._tamper_next:
            self._tamper_next = False
            self.tamper_now()

    def _weights(self, state):
        pairs = super()._weights(state)
        if self._kill_after is None:
            return pairs
        after, self._kill_after = self._kill_after, None

        def killing():
            for i, pair in enumerate(pairs):
                if i == after:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield pair

        return killing()

    def native_reload(self, reps: int = 3) -> list[float]:
        """Seconds of each of ``reps`` reloads by vLLM alone, from tensors already in this
        process (what the engine holds, read back first): ``reload_weights`` with the same
        arguments as :meth:`load_weights` and the prefix cache reset, nothing checked or hashed."""
        state = self.held_weights()
        assert state is not None, "load weights first"
        pairs = list(super()._weights(state))
        times = []
        with self._lock:
            for _ in range(reps):
                t0 = time.perf_counter()
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs),
                                                                  "is_checkpoint_format": True})
                self.llm.reset_prefix_cache()
                times.append(time.perf_counter() - t0)
        return times

    def held_read_seconds(self) -> float:
        """Seconds of one read-back of what the engine holds (the proof's read, without its hash)."""
        t0 = time.perf_counter()
        self.held_weights()
        return time.perf_counter() - t0
