"""What a vLLM engine computes with, read back under the trainer's (checkpoint) names.

ftstate admits a rollout to serving only when the bytes it serves from hash to the trainer's
checksum (``RolloutWorker.held_weights``). For a vLLM engine, "the bytes it serves from" are not
what ``model.named_parameters()`` shows, and not what ``load_weights`` was given:

* **CPU: packed kernels.** After loading, vLLM's ``process_weights_after_loading`` repacks each
  linear layer's weight for its GEMM kernel (oneDNN's ``onednn_mm``, or sgl's
  ``weight_packed_linear`` for small weights) and replaces the parameter with a 0-element
  tensor; ``lm_head`` keeps its parameter but computes the logits from its packed copy. The one
  faithful reading is through the layer's own kernel: pushing the identity matrix ``I_K``
  through ``layer.cpu_linear`` gives ``W^T`` exactly (every output element is one product with
  1.0 plus zeros, accumulated in fp32 and rounded to the weight's own dtype: nothing rounds).
  That costs one GEMM of ``K x K`` by ``K x N`` per layer (~0.6 s for 311 MB here, measured in
  ``benchmarks/vllm_update.py``), hence ``held_weights_proof`` in the config.
* **GPU: fused parameters.** The parameters are plain tensors, but under the fused names.
* **Fused layers, both.** vLLM loads q/k/v into one ``qkv_proj`` and gate/up into one
  ``gate_up_proj`` (the model's ``packed_modules_mapping``); the rows split back by the
  layer's ``output_sizes``, in the mapping's order.
* **Padding.** The embedding table and ``lm_head`` may be padded to a multiple of 64 rows;
  only the first ``num_embeddings`` rows are the checkpoint's.

:func:`layout` maps every checkpoint name the engine holds to where it lives (one
:class:`Slot` each), once per engine; :func:`read` reads a set of slots back. Both run inside
the engine's worker (``llm.collective_rpc``): in the actor's process for an in-process engine,
in each rank's process under tensor parallelism.

**Tensor parallelism: assembled, then compared whole.** Each rank holds a slice: column-parallel
layers (q/k/v, gate/up, the vocabulary of the embedding and ``lm_head``) a block of rows,
row-parallel ones (``o_proj``, ``down_proj``) a block of columns, the rest (norms, a row-parallel
bias) a full copy. :func:`layout` gives each rank's slots with the dimension they are split on
(``Slot.split``), :func:`merge` the trainer's view of them, and :func:`assemble` puts the ranks'
read-backs together under the trainer's names: the ranks' slices concatenated in rank order, a
replicated tensor once (or, where the ranks disagree, all copies stacked: a shape the trainer's
never has, so the proof fails). Assembled, the engine's state hashes to the one checksum the
trainer sealed its send with, so the proof is ftstate's usual one and needs nothing from the
sender per rank; comparing each rank's slice with a checksum of the same slice of the sender's
tensors would need the sender to know the engine's partitioning. The cost is one full copy in
the actor while the proof reads (the in-process engine's proof costs the same).

This module imports torch and vLLM's layer classes; it is loaded only through the
``ftstate.integrations.vllm`` package, which checks vLLM is importable first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class Slot(NamedTuple):
    """Where one checkpoint tensor lives in the engine.

    module: the vLLM module's dotted name; attr: its parameter (``weight``/``bias``);
    kernel: read through the module's CPU kernel (``cpu_linear``) rather than the parameter;
    rows: the rows of the (fused, padded) tensor that are this checkpoint tensor;
    shape, dtype: the checkpoint tensor's, as the trainer must send it (under tensor
    parallelism: this rank's slice of it); split: the dimension the ranks split it on (None: each
    rank holds all of it).
    """

    module: str
    attr: str
    kernel: bool
    rows: tuple[int, int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: int | None = None


def layout(model: torch.nn.Module) -> dict[str, Slot]:
    """Every checkpoint name ``model`` holds, with its :class:`Slot`. A tied ``lm_head`` (the
    embedding module itself) is not listed: its checkpoint tensor is the embedding's."""
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    slots: dict[str, Slot] = {}
    for prefix, module in model.named_modules():
        parent, _, leaf = prefix.rpartition(".")
        if isinstance(module, LinearBase):
            kernel = hasattr(module, "cpu_linear")
            k = int(module.input_size_per_partition)
            tp = int(getattr(module, "tp_size", 1) or 1)
            row_parallel = isinstance(module, RowParallelLinear)
            split_w = None if tp == 1 or isinstance(module, ReplicatedLinear) else (1 if row_parallel else 0)
            parts = packed.get(leaf)
            # output_sizes are the whole layer's: a column-parallel rank holds 1/tp of each part
            div = tp if split_w == 0 else 1
            sizes = [int(s) // div for s in getattr(module, "output_sizes", None) or []] or \
                [int(module.output_size_per_partition)]
            if parts is None or len(parts) != len(sizes):
                parts, sizes = [leaf], [int(module.output_size_per_partition)]
            split_b = None if row_parallel else split_w  # a row-parallel bias is whole on every rank
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                name = f"{parent}.{part}" if parent else part
                rows = (start, start + size)
                slots[f"{name}.weight"] = Slot(prefix, "weight", kernel, rows, (size, k), dtype, split_w)
                if getattr(module, "bias", None) is not None:
                    slots[f"{name}.bias"] = Slot(prefix, "bias", False, rows, (size,), dtype, split_b)
                start += size
        elif isinstance(module, VocabParallelEmbedding):
            # lm_head computes the logits through its packed copy (CPU); the embedding
            # gathers rows from its parameter, which vLLM leaves in place.
            kernel = isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear")
            n = int(getattr(module, "num_embeddings", module.weight.shape[0]))
            split = None
            if int(getattr(module, "tp_size", 1) or 1) > 1:  # this rank's block of the vocabulary
                n, split = int(module.shard_indices.num_org_elements), 0
            slots[f"{prefix}.weight"] = Slot(prefix, "weight", kernel, (0, n), (n, int(module.embedding_dim)), dtype,
                                             split)
        else:
            for attr, p in module.named_parameters(recurse=False):
                if p.numel() == 0:
                    continue
                slots[f"{prefix}.{attr}"] = Slot(prefix, attr, False, (0, int(p.shape[0])) if p.dim() else (0, 0),
                                                 tuple(p.shape), p.dtype)
    return slots


def read(model: torch.nn.Module, slots: Mapping[str, Slot], names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors at ``slots`` (those named in ``names``; all of them by default), as the
    engine computes with them now, on the host, contiguous. A module's kernel is run once for
    all the checkpoint tensors fused in it."""
    wanted = list(slots) if names is None else list(names)
    fused: dict[tuple[str, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name in wanted:
        slot = slots[name]
        key = (slot.module, slot.attr)
        if key not in fused:
            fused[key] = _whole(model.get_submodule(slot.module), slot)
        whole = fused[key]
        t = whole if whole.dim() == 0 else whole[slot.rows[0]:slot.rows[1]]
        out[name] = _as_checkpoint(t, slot.dtype).reshape(slot.shape).contiguous().cpu()
    return out


def merge(ranks: list[dict[str, Slot]]) -> dict[str, Slot]:
    """The trainer's view of the ranks' :func:`layout`: each name once, rank 0's slot with the
    whole tensor's shape (the ranks' slices summed along ``split``)."""
    merged: dict[str, Slot] = {}
    for name, slot in ranks[0].items():
        if slot.split is None:
            merged[name] = slot
            continue
        shape = list(slot.shape)
        shape[slot.split] = sum(r[name].shape[slot.split] for r in ranks)
        merged[name] = slot._replace(shape=tuple(shape))
    return merged


def assemble(merged: Mapping[str, Slot], ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' :func:`read` results put together under the trainer's names (see the module
    docstring): slices concatenated in rank order; a replicated tensor once, or all its copies
    stacked where the ranks disagree (so that no copy hides another)."""
    if len(ranks) == 1:
        return ranks[0]
    out: dict[str, torch.Tensor] = {}
    for name in ranks[0]:
        parts = [r[name] for r in ranks]
        split = merged[name].split
        if split is not None:
            out[name] = torch.cat(parts, dim=split)
        elif all(p.dtype == parts[0].dtype and torch.equal(p, parts[0]) for p in parts[1:]):
            out[name] = parts[0]
        else:
            out[name] = torch.stack([p.to(parts[0].dtype) for p in parts])
    return out


def _whole(module: torch.nn.Module, slot: Slot) -> torch.Tensor:
    """The module's whole (fused, padded) parameter as its forward pass uses it."""
    param = getattr(module, slot.attr)
    if not slot.kernel:
        return param.detach()
    # x = I_K through the layer's own GEMM: y = x @ W^T + b, so without the bias y = W^T.
    k = slot.shape[1]
    eye = torch.eye(k, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        return module.cpu_linear(eye, param, None).t()


def _as_checkpoint(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the checkpoint's dtype when that is exact. A kernel may keep a tensor wider
    (sgl's path holds biases in fp32); one that no longer rounds back to itself was changed
    inside the engine, so it is returned as it is and its different dtype fails the proof."""
    if t.dtype == dtype or not t.is_floating_point():
        return t
    narrow = t.to(dtype)
    return narrow if torch.equal(narrow.to(t.dtype), t) else t

