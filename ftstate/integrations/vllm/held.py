"""What a vLLM engine computes with, read back under the trainer's (checkpoint) names, in the engine's worker
processes (``llm.collective_rpc``). On CPU vLLM repacks linear weights, so each layer's own kernel is run on
the identity matrix; fused layers (q/k/v, gate/up) are split back by ``output_sizes``; padded vocabulary rows
are cut. Under tensor parallelism the ranks' slices are assembled and the proof compares the whole state with
the trainer's one checksum (docs/integration.md, "vLLM"). Loaded only through ``ftstate.integrations.vllm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class Slot(NamedTuple):
    """Where one checkpoint tensor lives in the engine: the vLLM ``module`` and its parameter ``attr``,
    whether to read through its CPU ``kernel``, the ``rows`` of the fused, padded tensor that are this tensor,
    its checkpoint ``shape``/``dtype`` (this rank's slice under TP) and the ``split`` dim (None: every rank
    holds it whole)."""

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
            # lm_head computes logits through its packed copy (CPU); the embedding gathers from its parameter.
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
    """The tensors at ``slots`` (those in ``names``; default all) as the engine computes with them, on the
    host, contiguous; one kernel run per fused module."""
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
    """The ranks' :func:`read` results under the trainer's names: slices concatenated in rank order, a
    replicated tensor once, or its copies stacked where ranks disagree (so the proof fails)."""
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
    """``t`` in the checkpoint's dtype when that is exact; one that no longer rounds back was changed in the
    engine and keeps its dtype, failing the proof."""
    if t.dtype == dtype or not t.is_floating_point():
        return t
    narrow = t.to(dtype)
    return narrow if torch.equal(narrow.to(t.dtype), t) else t

