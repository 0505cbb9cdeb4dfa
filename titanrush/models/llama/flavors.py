"""Model sizes: the debug model, the published Llama 3.x shapes, and custom shapes."""

from __future__ import annotations

import dataclasses

from titanrush.models.llama.args import ModelArgs

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


CUSTOM = "custom"
"""The flavor name of a shape given field by field (`[model]` keys or `model.from_checkpoint`)."""

CUSTOM_BASE = ModelArgs(multiple_of=256)
"""What a custom shape starts from before its fields are set: Meta's reference defaults (FFN rounded to
256, RMSNorm eps 1e-5, RoPE theta 500000, no RoPE scaling, 2048 positions, untied)."""

SHAPE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "multiple_of",
    "ffn_dim_multiplier",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_scale_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
    "max_seq_len",
    "tie_embeddings",
)
"""The ModelArgs fields that make up a model's shape (the rest say how a run computes it: the
attention kernel, the loss's chunking, the RoPE table's length)."""


def model_args(flavor: str, **overrides: object) -> ModelArgs:
    """A copy of the flavor's arguments with the given fields replaced (`custom`: from CUSTOM_BASE)."""
    if flavor == CUSTOM:
        return dataclasses.replace(CUSTOM_BASE, **overrides)
    if flavor not in FLAVORS:
        raise KeyError(flavor)
    return dataclasses.replace(FLAVORS[flavor], **overrides)


def shape_of(args: ModelArgs) -> dict[str, object]:
    """The shape fields of args (what a checkpoint's `model_args` must agree on to load)."""
    return {name: getattr(args, name) for name in SHAPE_FIELDS}


def ffn_sizing(dim: int, hidden: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) that make `ModelArgs.ffn_hidden == hidden` for this dim.

    A flavor's pair when one fits, else the simplest pair that does: Hugging Face configs state the FFN
    width (`intermediate_size`) directly, Meta's derive it from these two numbers.
    """
    base = int(8 * dim / 3)
    candidates = [(a.multiple_of, a.ffn_dim_multiplier) for a in FLAVORS.values() if a.dim == dim]
    for multiple_of in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if hidden % multiple_of == 0:
            candidates += [(multiple_of, None)] + [
                (multiple_of, round(hidden / base, d)) for d in range(1, 5)
            ]
    # multiple_of = hidden rounds any 0 < int(multiplier * base) <= hidden up to exactly hidden.
    candidates.append((hidden, None if base <= hidden else hidden / base))
    for multiple_of, mult in candidates:
        if ModelArgs(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=mult).ffn_hidden == hidden:
            return multiple_of, mult
    raise AssertionError(f"no ffn sizing for dim={dim}, hidden={hidden}")  # unreachable: the last one fits
