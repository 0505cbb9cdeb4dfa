"""Token-choice routing: each token picks its top-k experts by a sigmoid score, capacity-free.

Llama 4 routes each token to k = 1 expert. The router is a linear layer `gate` (dim -> experts); a token's
score for expert e is sigmoid(gate(x)_e), the sigmoid in fp32 (the gate's matmul in the model's precision:
an fp32 matmul, measured, balanced no better and keeps an fp32 copy of the layer's input). Load balance
(DeepSeek-V3's auxiliary-loss-free method) adds a per-expert bias to the scores for the choice only: the
bias steers tokens away from overloaded experts, while the weight a chosen expert's output gets is its
unbiased score, so the bias never enters the gradient. `titanrush.models.llama4.balance` moves the bias
between steps.

Two optional losses shape the router through its gradient only: the sequence-wise balance loss (the
auxiliary loss of Switch / DeepSeek-V3: per sequence, the fraction of its tokens each expert receives times
the mean normalized score it gets, summed over experts, times the expert count; 1 when balanced) and the
router z-loss (ST-MoE: the squared log-sum-exp of the logits, which keeps them small). They are added to
the training loss's gradient by `add_loss_grad`, so the trainer's loss function need not know about them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    """One batch's routing; N tokens, k choices each, E experts."""

    experts: torch.Tensor  # (N, k) the chosen experts
    weights: torch.Tensor  # (N, k) fp32: the chosen experts' (unbiased) sigmoid scores
    counts: torch.Tensor  # (E,) int64: tokens routed to each expert
    scores: torch.Tensor  # (N, E) fp32: every score (the balance loss reads them)
    logits: torch.Tensor  # (N, E) the gate's output (the z-loss reads them)
    # (B, E) fp32: each sequence's choices per expert (the balance loss's token fractions). Where a
    # sequence is split over ranks (sequence or context parallel), the parallelization sums them over
    # those ranks after the router's forward, so that they count whole sequences.
    seq_counts: torch.Tensor


class Router(nn.Module):
    """The gate of a MoE layer: `gate.weight` (experts, dim)."""

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.n_experts = n_experts
        self.top_k = top_k

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, n_seqs: int = 1) -> Routing:
        """Route tokens x (N, dim), `n_seqs` sequences of N / n_seqs tokens; `bias` (E,) fp32 only steers
        the choice."""
        logits = self.gate(x)
        scores = torch.sigmoid(logits.float())  # fp32: the ranking and weights of near-equal experts
        with torch.no_grad():
            biased = scores if bias is None else scores + bias
            experts = torch.topk(biased, self.top_k, dim=-1).indices  # (N, k)
            picks = experts.reshape(n_seqs, -1)  # (B, T k)
            ones = torch.ones_like(picks, dtype=torch.float32)
            seq_counts = torch.zeros(n_seqs, self.n_experts, device=x.device).scatter_add_(1, picks, ones)
        weights = scores.gather(-1, experts)
        counts = expert_counts(experts, self.n_experts)
        return Routing(
            experts=experts,
            weights=weights,
            counts=counts,
            scores=scores,
            logits=logits,
            seq_counts=seq_counts,
        )


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert (E,) int64: a scatter-add of ones (static shape, unlike bincount's)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def balance_loss(routing: Routing) -> torch.Tensor:
    """Sequence-wise balance loss: mean over sequences of E x sum_e f_e x P_e (1 when balanced).

    f_e is the fraction of the sequence's k x T choices that went to expert e (`Routing.seq_counts`: no
    gradient); P_e the mean over its tokens of e's score normalized over the experts. Per sequence, so
    that the loss does not depend on how a batch is split over data-parallel ranks.

    Where each rank holds a shard of every sequence (sequence or context parallel), `seq_counts` are
    the whole sequences' (summed over the shards) and P_e is the mean over this rank's shard: the mean of
    the shards' losses is then the whole sequences' loss, since f carries no gradient.
    """
    n_seqs, e = routing.seq_counts.shape
    f = routing.seq_counts / routing.seq_counts.sum(-1, keepdim=True)
    p = routing.scores / routing.scores.sum(-1, keepdim=True)
    p = p.reshape(n_seqs, -1, e).mean(1)
    return e * (f * p).sum(-1).mean()


def z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(routing.logits.float(), dim=-1).square().mean()


class _AddLossGrad(torch.autograd.Function):
    """Identity on `out` in forward; in backward also sends d(total)/d(loss) = 1 into `loss`."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, out: torch.Tensor, loss: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def add_loss_grad(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`out` unchanged, with `loss` (already weighted) added to the training loss for the backward pass.

    The gradient of the total loss with respect to an added term is 1, whatever the trainer does with its
    own loss; the plan's weight already divides by the micro-batches one optimizer step averages.
    """
    return _AddLossGrad.apply(out, loss)
