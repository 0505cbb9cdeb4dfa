"""Llama 4: the dense Llama with mixture-of-experts feed-forwards, and iRoPE's attention options.

A `Llama4` is a `Llama` (same embedding, norms, output, loss, RoPE table, pipeline cutting, parameter
names) whose blocks differ in two ways:

- every `moe_every`-th block (layer i with (i + 1) % moe_every == 0; 1: all of them) replaces its
  `feed_forward` with `moe` (`moe.py`): router, routed experts, shared expert;
- iRoPE: every `nope_every`-th block (layer i with (i + 1) % nope_every == 0, as Meta's and Hugging
  Face's Llama 4) attends without rotary embeddings over the whole sequence (NoPE); with `attn_chunk`, the
  other blocks attend only within chunks of that many tokens (chunked attention, computed by folding the
  chunks into the batch: no mask, any attention kernel), and with `qk_norm` they RMS-normalize queries
  and keys after the rotation (Scout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titanrush.models.llama.attention import attention
from titanrush.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    RMSNorm,
    TransformerBlock,
    apply_rope,
)
from titanrush.models.llama4.args import Llama4Args
from titanrush.models.llama4.moe import MoE


class Llama4Attention(Attention):
    """The Llama attention, with RoPE optional and chunked attention on the RoPE layers."""

    def __init__(self, args: Llama4Args, *, rope: bool) -> None:
        super().__init__(args)
        self.rope = rope
        self.chunk = args.attn_chunk if rope else 0
        self.qk_norm_eps = args.norm_eps if rope and args.qk_norm else 0.0

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: object = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        if rope.dim() == 3:  # the model's whole table (positions, D/2, 2): this sequence's positions
            rope = rope[:seq]
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.qk_norm_eps:  # Scout's QK-norm: each head's query and key to unit RMS, in fp32
            q, k = (F.rms_norm(t.float(), (t.shape[-1],), eps=self.qk_norm_eps).type_as(t) for t in (q, k))
        chunks = seq // self.chunk if self.chunk and seq > self.chunk else 1
        if chunks > 1:  # causal attention within each chunk = causal attention over a batch of chunks
            q, k, v = (t.reshape(bsz * chunks, self.chunk, *t.shape[2:]) for t in (q, k, v))
        out = attention(q, k, v, backend=self.backend, n_rep=self.n_rep, mask=mask, expand_kv=self.expand_kv)
        return self.wo(out.reshape(bsz, seq, -1))


class Llama4Block(TransformerBlock):
    """A Llama block whose feed-forward is `feed_forward` (dense) or `moe` (mixture of experts)."""

    def __init__(self, layer_id: int, args: Llama4Args) -> None:
        nn.Module.__init__(self)
        self.attention = Llama4Attention(args, rope=args.uses_rope(layer_id))
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if args.is_moe(layer_id):
            self.moe = MoE(
                args.dim,
                args.expert_hidden,
                args.n_experts,
                args.top_k,
                shared_expert=args.shared_expert,
                grouped=args.grouped_mm,
                aux_loss_weight=args.aux_loss_weight,
                z_loss_weight=args.z_loss_weight,
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: object = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Llama4(Llama):
    """The Llama with `Llama4Block`s: forward, loss, pipeline cutting and checkpoints are the Llama's."""

    def __init__(self, args: Llama4Args) -> None:
        super().__init__(args)
        # Built twice on the meta device (the dense blocks above cost nothing there); replaced here.
        self.layers = nn.ModuleDict({str(i): Llama4Block(i, args) for i in range(args.n_layers)})

    def moe_modules(self) -> list[MoE]:
        """This model's (or pipeline stage's) MoE modules, in layer order."""
        return [b.moe for b in self.layers.values() if getattr(b, "moe", None) is not None]

    def param_inits(self) -> dict[str, Callable[[torch.Tensor, torch.Generator], None]]:
        inits = super().param_inits()

        def normal(std: float) -> Callable[[torch.Tensor, torch.Generator], None]:
            return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-2.0, b=2.0, generator=g)

        def gate_up(std: float) -> Callable[[torch.Tensor, torch.Generator], None]:
            def init(t: torch.Tensor, g: torch.Generator) -> None:  # w1 (first half) as w1, w3 as w3
                half = t.shape[-1] // 2
                nn.init.trunc_normal_(t[..., :half], std=0.02, a=-2.0, b=2.0, generator=g)
                nn.init.trunc_normal_(t[..., half:], std=std, a=-2.0, b=2.0, generator=g)

            return init

        for i, block in self.layers.items():
            if getattr(block, "moe", None) is None:
                continue
            p, std = f"layers.{i}.moe.", block.init_std
            for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
                inits.pop(f"layers.{i}.{name}.weight", None)
            inits[f"{p}router.gate.weight"] = normal(std)
            inits[f"{p}experts.w13"] = gate_up(std)
            inits[f"{p}experts.w2"] = normal(std)
            if block.moe.shared_expert is not None:
                inits[f"{p}shared_expert.w1.weight"] = normal(0.02)
                for name in ("w2", "w3"):
                    inits[f"{p}shared_expert.{name}.weight"] = normal(std)
        return inits

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        super().init_weights(seed, buffer_device)
        for moe in self.moe_modules():  # (filled in place: the buffers stay the registered tensors)
            moe.expert_bias.zero_()
            moe.tokens_per_expert.zero_()
