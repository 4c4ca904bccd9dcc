"""A tiny Qwen2 written to disk without the hub, shared by the verl and vLLM suites.

Random initialisation from a ``Qwen2Config``, ``save_pretrained`` (safetensors) and a WordLevel
tokenizer built with ``tokenizers``: nothing is downloaded (``HF_HUB_OFFLINE=1`` holds). The
same seed gives the same bytes, so two suites (or two runs) build the same model.
"""

from __future__ import annotations

import os


def make_tiny_qwen2(path: str, *, vocab: int = 4096, hidden: int = 128, layers: int = 2, intermediate: int = 0,
                    heads: int = 4, kv_heads: int = 2, dtype: str = "float32", seed: int = 0) -> str:
    """A Qwen2 of ``layers`` layers (about 6 MB of float32 at the defaults) and its tokenizer
    under ``path``; a folder that already holds one is reused. intermediate: the MLP's width
    (default ``2 * hidden``); dtype: the dtype the weights are saved in."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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
