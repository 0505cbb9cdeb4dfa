"""A native Llama 3 in plain PyTorch: RMSNorm, RoPE with Llama 3.1 scaling, GQA, SwiGLU.

Built on the meta device, materialized with `to_empty`, then `init_weights()`. Module names follow
Meta's checkpoints (`tok_embeddings`, `layers.<i>.attention.wq`, ...), which the TP plans, FSDP units,
activation checkpointing and checkpoint conversion key on. `tok_embeddings`, `norm` and `output` may be
None so that a pipeline stage can drop them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titanrush.models.init import init_parameters
from titanrush.models.llama.args import ModelArgs
from titanrush.models.llama.attention import attention, build_mask
from titanrush.models.llama.loss import chunked_cross_entropy


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama 3.1's long-context scaling when enabled."""
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
    if not args.rope_scaling:
        return freqs.float()
    low_wavelen = args.rope_original_max_len / args.rope_low_freq_factor
    high_wavelen = args.rope_original_max_len / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = freqs / args.rope_scale_factor
    # Between the two wavelengths, blend the scaled and unscaled frequency smoothly.
    smooth = (args.rope_original_max_len / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    blended = (1 - smooth) * scaled + smooth * freqs
    out = torch.where(wavelen < high_wavelen, freqs, torch.where(wavelen > low_wavelen, scaled, blended))
    return out.float()


def rope_cache(args: ModelArgs, length: int) -> torch.Tensor:
    """cos and sin of position x frequency, fp32: (length, head_dim/2, 2), [..., 0] cos and [..., 1] sin.

    Real-valued so that compiled blocks hold no complex tensor (inductor generates no code for complex
    operators and leaves them to eager kernels between its fused ones); the trailing pair is what
    `torch.view_as_complex` reads as exp(i * position * frequency), which the eager path uses (a view,
    not a copy). Blocks take the table as a forward input in fp32: FSDP's block units do not cast their
    inputs (`titanrush.parallel.fsdp`), so no block rotates with a bf16-rounded table or keeps a copy of it.
    """
    angles = torch.outer(torch.arange(length, dtype=torch.float32), rope_frequencies(args))
    # torch.polar's cos and sin (bit for bit the complex table titanrush used before), as real numbers
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).clone()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x (B, T, H, D) by the angles of rope (T or B x T,
    D/2, 2; fp32 cos and sin), in fp32: x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos."""
    xp = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    if not torch.compiler.is_compiling() and xp.is_contiguous() and rope.is_contiguous():
        # Eager: one complex multiply, (x0 + i x1)(cos + i sin), over views of both (no copy of the table),
        # instead of six element-wise kernels.
        table = torch.view_as_complex(rope)
        table = table[None, :, None] if table.dim() == 2 else table[:, :, None]  # broadcast over heads
        return torch.view_as_real(torch.view_as_complex(xp) * table).flatten(-2).type_as(x)
    # Compiled: the same arithmetic in real numbers, which inductor fuses into one kernel.
    rope = rope[None, :, None] if rope.dim() == 3 else rope[:, :, None]  # (1 or B, T, 1, D/2, 2)
    cos, sin = rope[..., 0], rope[..., 1]
    x0, x1 = xp[..., 0], xp[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # One kernel (CUDA's fused RMSNorm), which accumulates in fp32 for bf16 inputs as well: the
            # case under FSDP's bf16 parameters, where casting x up and back cost two more kernels and an
            # fp32 copy of the activations.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def to_matmul_dtype(x: torch.Tensor) -> torch.Tensor:
    """A norm's output in autocast's dtype where autocast is on, else unchanged.

    In a block the norms feed only linears, each of which would cast the same fp32 activations to bf16:
    one cast here instead gives the same inputs, and tensor parallel's all-gather of them (sequence
    parallel) moves half the bytes and sits right before the matmul, where async TP fuses the two.
    """
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.backend = args.attn_backend
        self.expand_kv = args.expand_kv
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: object = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        if rope.dim() == 3:  # the model's whole table (positions, D/2, 2): this sequence's positions
            rope = rope[:seq]
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = attention(q, k, v, backend=self.backend, n_rep=self.n_rep, mask=mask, expand_kv=self.expand_kv)
        return self.wo(out.reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # Deeper blocks start with smaller output projections (keeps the residual stream's scale).
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: object = None) -> torch.Tensor:
        h = x + self.attention(to_matmul_dtype(self.attention_norm(x)), rope, mask)
        return h + self.feed_forward(to_matmul_dtype(self.ffn_norm(h)))


class Llama(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_cache(args, args.rope_len), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) ids, or (B, T, dim) hidden states on a later pipeline stage.

        Returns logits (B, T, vocab), the hidden states when this stage has no output layer, or, with
        labels and a chunked loss configured, the mean cross-entropy.
        """
        if position_ids is None and tokens.shape[1] > self.rope.shape[0]:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens, but the RoPE table covers {self.rope.shape[0]} "
                "positions: build the model with ModelArgs.rope_positions >= that (0: 2 x max_seq_len)"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        # The whole table: each attention slices it to the sequence it sees. Under sequence parallel the
        # hidden states between blocks hold 1/tp of the sequence and attention all of it. Under context
        # parallel the table holds this rank's positions in its tokens' order for the step
        # (`titanrush.parallel.context_parallel`). One table (or one gather by position_ids) for all the
        # blocks, in fp32: the blocks keep no copy of it for backward.
        rope = self.rope if position_ids is None else self.rope[position_ids]
        # The mask spans the whole sequence (under sequence parallel h holds only a shard of it).
        mask_len = document_ids.shape[1] if document_ids is not None else seq
        mask = build_mask(self.args.attn_backend, document_ids, mask_len, self.args.n_heads)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if labels is not None and self.args.loss_chunk_size > 0:
            return chunked_cross_entropy(
                h, self.output.weight, labels, self.args.loss_chunk_size, compiled=self.args.compile_loss
            )
        return self.output(h)

    def param_inits(self) -> dict[str, Callable[[torch.Tensor, torch.Generator], None]]:
        """Parameter name -> how to initialize that (full, unsharded) tensor from a generator."""

        def normal(std: float, trunc: float | None = None) -> Callable[[torch.Tensor, torch.Generator], None]:
            if trunc is None:
                return lambda t, g: nn.init.normal_(t, std=std, generator=g)
            return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-trunc, b=trunc, generator=g)

        ones = lambda t, g: nn.init.ones_(t)  # noqa: E731
        inits: dict[str, Callable[[torch.Tensor, torch.Generator], None]] = {}
        if self.tok_embeddings is not None:
            # A tied table is also the output projection: keep its logits small at the start.
            inits["tok_embeddings.weight"] = normal(0.02 if self.args.tie_embeddings else 1.0)
        for i, layer in self.layers.items():
            p, std = f"layers.{i}.", layer.init_std
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
                inits[f"{p}{name}.weight"] = normal(0.02, 2.0)
            for name in ("attention.wo", "feed_forward.w2", "feed_forward.w3"):
                inits[f"{p}{name}.weight"] = normal(std, 2.0)
            inits[f"{p}attention_norm.weight"] = ones
            inits[f"{p}ffn_norm.weight"] = ones
        if self.norm is not None:
            inits["norm.weight"] = ones
        if self.output is not None and not self.args.tie_embeddings:
            final_std = self.args.dim**-0.5
            inits["output.weight"] = normal(final_std, 3 * final_std)
        return inits

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and buffer in place (after `to_empty`).

        Each parameter draws from its own generator seeded by (seed, name) over its full shape, so the
        weights are the same whatever the mesh shards them over.
        """
        device = buffer_device or self.rope.device
        self.rope = rope_cache(self.args, self.args.rope_len).to(device)
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            # `to_empty` gives each module its own new tensor, which unties shared weights: tie again.
            self.output.weight = self.tok_embeddings.weight
        init_parameters(self, self.param_inits(), seed)
