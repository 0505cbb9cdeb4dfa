"""Cross-entropy losses: the plain one over full logits, and a chunked one that never holds them all."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits (B, T, V) against labels (B, T), computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (h @ weight.t()).float()  # (N, V) for this chunk only
    return F.cross_entropy(logits, labels, reduction="sum")


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Mean cross-entropy of the output projection h @ weight.T against labels, chunk by chunk.

    Each chunk's logits are recomputed in backward (activation checkpointing per chunk), so at most one
    chunk of (chunk_size, V) fp32 logits is alive at a time instead of (B * T, V).
    """
    h = h.flatten(0, 1)
    labels = labels.flatten(0, 1)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        total = total + checkpoint(_chunk_loss_sum, h[sl], weight, labels[sl], use_reentrant=False)
    return total / labels.numel()
