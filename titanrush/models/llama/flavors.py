"""Model sizes: the debug model and the published Llama 3.x shapes."""

from __future__ import annotations

import dataclasses

from titanrush.models.llama.model import ModelArgs

_LLAMA31_ROPE = dict(rope_scaling=True, rope_scale_factor=8.0, rope_original_max_len=8192)
_LLAMA32_ROPE = dict(rope_scaling=True, rope_scale_factor=32.0, rope_original_max_len=8192)

FLAVORS: dict[str, ModelArgs] = {
    # Small enough to train a few dozen steps on two CPU cores; vocab = the shipped tokenizer's.
    "debug": ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=64, max_seq_len=2048
    ),
    # Llama 3.2 (tied embeddings).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        max_seq_len=131072,
        tie_embeddings=True,
        **_LLAMA32_ROPE,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        max_seq_len=131072,
        tie_embeddings=True,
        **_LLAMA32_ROPE,
    ),
    # Llama 3.1.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        max_seq_len=131072,
        **_LLAMA31_ROPE,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        max_seq_len=131072,
        **_LLAMA31_ROPE,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        max_seq_len=131072,
        **_LLAMA31_ROPE,
    ),
}


def model_args(flavor: str, **overrides: object) -> ModelArgs:
    """A copy of the flavor's arguments with the given fields replaced."""
    if flavor not in FLAVORS:
        raise KeyError(flavor)
    return dataclasses.replace(FLAVORS[flavor], **overrides)
