"""A tiny Qwen2 written to disk without the hub, shared by the verl and vLLM suites.

The writer is the engine demo's (:func:`ftstate.cli.demo.llm.write_tiny_qwen2`): random
initialisation from a ``Qwen2Config``, ``save_pretrained`` (safetensors) and a WordLevel
tokenizer built with ``tokenizers``: nothing is downloaded (``HF_HUB_OFFLINE=1`` holds). The
same seed gives the same bytes, so two suites (or two runs) build the same model.
"""

from __future__ import annotations

from ftstate.cli.demo.llm import write_tiny_qwen2


def make_tiny_qwen2(path: str, *, vocab: int = 4096, hidden: int = 128, layers: int = 2, intermediate: int = 0,
                    heads: int = 4, kv_heads: int = 2, dtype: str = "float32", seed: int = 0) -> str:
    """A Qwen2 of ``layers`` layers (about 6 MB of float32 at the defaults) and its tokenizer
    under ``path``; a folder that already holds one is reused. intermediate: the MLP's width
    (default ``2 * hidden``); dtype: the dtype the weights are saved in."""
    return write_tiny_qwen2(path, vocab=vocab, hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
                            kv_heads=kv_heads, dtype=dtype, seed=seed)
