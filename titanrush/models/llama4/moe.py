"""The MoE feed-forward of Llama 4: a shared expert every token goes through, plus routed experts.

    out = shared(x) + sum over the token's chosen experts e of expert_e(score_e * x)

(Llama 4 scales the expert's input by the router score, not its output.) The routed part, with N tokens
and k choices each:

1. route: each token's k experts and scores (`router.py`), and the tokens per expert;
2. permute: a stable sort of the N x k choices by expert puts each expert's tokens in one contiguous
   group (no Python loop over experts; static shapes);
3. the experts: a grouped GEMM over the groups (`grouped_gemm.py`); under expert parallel,
   `titanrush.parallel.expert_parallel` wraps this module to send each group to the rank that holds its
   expert and the results back (all-to-all), so the model code is the same on one device and on a mesh;
4. unpermute: the inverse permutation (a gather, not an atomic scatter-add: deterministic), and the sum
   over the k choices.

The module also keeps what load balancing needs: `expert_bias` (a persistent buffer: checkpointed, moved
between steps by `balance.py`) and `tokens_per_expert` (this step's counts, summed over micro-batches).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanrush.models.llama.model import FeedForward
from titanrush.models.llama4.grouped_gemm import float8_grouped_mm, grouped_mm
from titanrush.models.llama4.router import Router, Routing, add_loss_grad, balance_loss, z_loss


class _CastForCompute(torch.autograd.Function):
    """w in `dtype` for the GEMMs; backward: the gradient back in w's dtype, divided by `divisor` (what an
    FSDP unit's mixed precision and gradient division do, for experts that have none)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, dtype: torch.dtype, divisor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.source, ctx.divisor = w.dtype, divisor
        return w.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return grad.to(ctx.source) / ctx.divisor, None, None


def _recast_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001 (torch's signature)
    """Recompute dtype casts (the weights' compute-dtype copies) in backward; keep every other output."""
    return (
        CheckpointPolicy.MUST_RECOMPUTE
        if op is torch.ops.aten._to_copy.default
        else CheckpointPolicy.PREFER_SAVE
    )


def _recast_contexts() -> tuple:
    """Checkpoint contexts of `_recast_policy` (a module-level function: torch.compile guards on it)."""
    return create_selective_checkpoint_contexts(_recast_policy)


class GroupedExperts(nn.Module):
    """E SwiGLU experts in two stacked weights, in Hugging Face Llama 4's layout (x @ W):

    `w13` (E, dim, 2 x hidden): each expert's gate (w1) and up (w3) projections side by side;
    `w2` (E, hidden, dim): the down projections. One grouped GEMM computes w1 and w3 together.
    With `float8` (set by `titanrush.parallel.float8.apply_float8_experts`) both GEMMs run in float8.
    With `compute_dtype` (set by `titanrush.parallel.expert_parallel.local_experts`, where no FSDP unit
    manages the experts) the weights are cast to it for the GEMMs, and their gradients divided by
    `grad_divisor`; with `recast` too (compiled bf16 GEMMs outside a checkpointed block) backward casts
    them again rather than keep the casts (a compiled graph would keep them: 2 bytes per expert weight).
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, *, grouped: bool = True) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.grouped = grouped
        self.float8 = False
        self.compute_dtype: torch.dtype | None = None
        self.grad_divisor = 1.0
        self.recast = False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (T, dim): rows sorted by expert, counts[e] of them for this module's e-th expert."""
        # (traced only: eager, selective checkpointing would cache every output it keeps, beyond what
        # autograd keeps; and only where the weights are cast)
        casts = self.compute_dtype not in (None, self.w13.dtype) and not self.float8
        if self.recast and casts and torch.is_grad_enabled() and torch.compiler.is_compiling():
            return checkpoint(self._compute, x, counts, use_reentrant=False, context_fn=_recast_contexts)
        return self._compute(x, counts)

    def _compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Under expert parallel the weights are DTensors sharded over the experts: this rank computes
        # with its own experts (the dispatch sent it their tokens), as plain tensors.
        w13 = self.w13.to_local() if isinstance(self.w13, DTensor) else self.w13
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        if self.compute_dtype is not None or self.grad_divisor != 1.0:
            w13 = _CastForCompute.apply(w13, self.compute_dtype or w13.dtype, self.grad_divisor)
            w2 = _CastForCompute.apply(w2, self.compute_dtype or w2.dtype, self.grad_divisor)
        if self.float8:
            gate, up = float8_grouped_mm(x, w13, counts).chunk(2, dim=-1)
            return float8_grouped_mm(F.silu(gate) * up, w2, counts)
        gate, up = grouped_mm(x, w13, counts, grouped=self.grouped).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, w2, counts, grouped=self.grouped)


class MoE(nn.Module):
    """Router + routed experts + shared expert, for one layer."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        *,
        shared_expert: bool = True,
        grouped: bool = True,
        aux_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.router = Router(dim, n_experts, top_k)
        self.experts = GroupedExperts(dim, hidden, n_experts, grouped=grouped)
        self.shared_expert = FeedForward(dim, hidden) if shared_expert else None
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # (N, dim)
        # 1. Route: each token's k experts and their scores.
        r = self.router(tokens, self.expert_bias, n_seqs=bsz)
        if torch.is_grad_enabled() and not x.is_meta:  # training passes only; see balance.py for AC
            self.tokens_per_expert.add_(r.counts)
        # 2. Permute: choices sorted by expert (stable: a token's choices keep the token order).
        order = torch.argsort(r.experts.reshape(-1), stable=True)  # (N k,)
        token = order // self.top_k
        routed_in = (tokens[token].float() * r.weights.reshape(-1, 1)[order]).to(x.dtype)
        # 3. The experts.
        routed_out = self.experts(routed_in, r.counts)
        # 4. Unpermute: row i of the sorted output belongs to choice order[i].
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        out = routed_out[inverse]
        if self.top_k > 1:
            out = out.reshape(-1, self.top_k, dim).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        out = self._add_router_losses(out, r)
        return out.reshape(bsz, seq, dim)

    def _add_router_losses(self, out: torch.Tensor, r: Routing) -> torch.Tensor:
        if not torch.is_grad_enabled() or (self.aux_loss_weight == 0 and self.z_loss_weight == 0):
            return out
        loss = out.new_zeros((), dtype=torch.float32)
        if self.aux_loss_weight:
            loss = loss + self.aux_loss_weight * balance_loss(r)
        if self.z_loss_weight:
            loss = loss + self.z_loss_weight * z_loss(r)
        return add_loss_grad(out, loss)
