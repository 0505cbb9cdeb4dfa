"""The Llama's shape and options (`ModelArgs`): plain numbers, which the config's checks, the plan and the
estimator read without importing the model (or torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 8192
    multiple_of: int = 64
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_seq_len: int = 2048
    # Positions the RoPE table covers: the run's sequence length where a trainer knows it (an 8B's
    # 2 x 131,072-position table is 128 MiB on every GPU and 0.4 s of set-up); 0 for twice max_seq_len.
    rope_positions: int = 0
    tie_embeddings: bool = False
    attn_backend: str = "sdpa"
    expand_kv: bool = False  # sdpa: K/V heads repeated to the query heads (fp32 context parallel)
    loss_chunk_size: int = 0  # > 0: forward(labels=...) returns the chunked cross-entropy loss
    compile_loss: bool = False  # torch.compile the chunked loss's per-chunk math

    @property
    def rope_len(self) -> int:
        return self.rope_positions or 2 * self.max_seq_len

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)
