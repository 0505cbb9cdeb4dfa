"""Llama 4's shape and options (`Llama4Args`: the Llama's, the experts' and iRoPE's): plain numbers, which the
config's checks, the plan and the estimator read without importing the model (or torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanrush.models.llama.args import ModelArgs


@dataclass
class Llama4Args(ModelArgs):
    n_experts: int = 8
    top_k: int = 1
    # Each routed (and the shared) expert's hidden size; 0: the dense FFN's divided by top_k + shared
    # experts (same active FFN width per token), rounded up to multiple_of.
    moe_hidden: int = 0
    shared_expert: bool = True
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0
    nope_every: int = 0  # layer i has no RoPE when (i + 1) % nope_every == 0; 0: RoPE everywhere
    attn_chunk: int = 0  # RoPE layers attend within chunks of this many tokens; 0: the whole sequence
    qk_norm: bool = False  # RoPE layers: queries and keys RMS-normalized (no weight) after the rotation
    grouped_mm: bool = True  # the experts' grouped GEMM where torch has one (else the per-expert loop)
    # Weights of the router's losses in the training loss (the plan divides the config's coefficients by
    # the micro-batches of one optimizer step); 0: off.
    aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0

    @property
    def expert_hidden(self) -> int:
        if self.moe_hidden:
            return self.moe_hidden
        per = self.ffn_hidden / (self.top_k + int(self.shared_expert))
        return self.multiple_of * math.ceil(int(per) / self.multiple_of)

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    def uses_rope(self, layer: int) -> bool:
        return not (self.nope_every and (layer + 1) % self.nope_every == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe(i)]
