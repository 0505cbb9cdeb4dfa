"""Llama 4 sizes: a debug MoE, two benchmark sizes, and the published Scout and Maverick shapes.

Parameter counts (total / active per token, embedding included; docs/mfu.md has the matmul counts):
- llama4_debug: 8 experts, 4 layers, the debug model's width: CPU tests.
- llama4_1Bx8E: 3.2B / 1.25B, every layer MoE (8 routed experts + 1 shared, top-1): one GPU.
- llama4_1Bx16E: 5.4B / 1.25B, the same with 16 experts: two GPUs (FSDP or EP).
- llama4_17Bx16E (Scout): 108B / 17B, all 48 layers MoE, NoPE every 4th layer, chunked attention, QK-norm.
- llama4_17Bx128E (Maverick): 400B / 17B, MoE every other layer with 128 experts.
"""

from __future__ import annotations

import dataclasses

from titanrush.models.llama4.args import Llama4Args

# Llama 4's RoPE: theta 500,000; Scout scales the frequencies for long context (factor 16).
_SCOUT_ROPE = dict(
    rope_theta=500000.0,
    rope_scaling=True,
    rope_scale_factor=16.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=1.0,
    rope_original_max_len=8192,
)
_17B = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048, multiple_of=2048)
# The benchmark sizes: the Llama 3.2 1B's attention and width, with Llama 3's vocabulary (torchtitan's
# Llama 4 is given the same shapes through its custom import: scripts/bench/torchtitan_compat).
_1B = dict(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=256,
    max_seq_len=8192,
    rope_theta=500000.0,
    moe_hidden=2816,
)

FLAVORS: dict[str, Llama4Args] = {
    "llama4_debug": Llama4Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=8192,
        multiple_of=64,
        max_seq_len=2048,
        n_experts=8,
        moe_every=1,
    ),
    "llama4_1Bx8E": Llama4Args(**_1B, n_experts=8),
    "llama4_1Bx16E": Llama4Args(**_1B, n_experts=16),
    "llama4_17Bx16E": Llama4Args(
        **_17B,
        **_SCOUT_ROPE,
        ffn_dim_multiplier=1.2,  # (no dense layer: only config.json's intermediate_size_mlp shows it)
        max_seq_len=262144,
        n_experts=16,
        moe_hidden=8192,
        moe_every=1,
        nope_every=4,
        attn_chunk=8192,
        qk_norm=True,
    ),
    "llama4_17Bx128E": Llama4Args(
        **_17B,
        rope_theta=500000.0,
        max_seq_len=262144,
        ffn_dim_multiplier=1.2,
        n_experts=128,
        moe_hidden=8192,
        moe_every=2,
        nope_every=4,
        attn_chunk=8192,
    ),
}


def model_args(flavor: str, **overrides: object) -> Llama4Args:
    """A copy of the flavor's arguments with the given fields replaced."""
    if flavor not in FLAVORS:
        raise KeyError(flavor)
    return dataclasses.replace(FLAVORS[flavor], **overrides)
