"""Load balance between steps: the routing bias update (DeepSeek-V3) and the experts' load metrics.

Every MoE layer counts the tokens each of its experts received during the step's forward passes
(`MoE.tokens_per_expert`, summed over micro-batches). Once per optimizer step, `balance_experts` sums the
counts over the data-parallel (and context-parallel) ranks, so that every rank sees the same global load
and moves the same bias, then for each layer:

    bias_e += rate x sign(mean load - load_e), re-centred to mean zero,

so overloaded experts become less attractive and idle ones more (the scores that weight the experts'
outputs never see the bias). The counts are then reset.

Activation checkpointing runs a block's forward again in backward, which counts its tokens twice; the
sign of a difference and the shares of the load do not change with a common factor, so the update and
the metrics use only those: each expert's share of the layer's routed tokens, and the imbalance, the
largest load over the mean (1.0 is perfect balance; E when one expert gets every token).

One step's load measures one batch: a few sequences, whose tokens share topics, so it swings from step to
step even when the bias balances the experts over time (on a GPU, 2.56x at a step whose 10-step window
was within 1.52x: docs/moe.md). The metrics give both: the logged step's imbalance and the imbalance of the
load summed over every step since the previous log (the window), which is what balance means.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanrush.models.llama4.moe import MoE

logger = logging.getLogger("titanrush")

COLLAPSE_WINDOWS = 3
"""Judged windows in a row above half the expert count's max/mean load that make routing 'collapsed'."""
JUDGE_STEPS = 10
"""The fewest steps whose summed load the collapse check judges at once (and `rush moe`'s balance
window): with a log interval shorter than this, logged windows are pooled, since one batch's load can go
to one expert while the next batches' go to others (on a GPU, `rush moe` logging every step: 8.0 at step
after step, 1.8 over those 10)."""


def moe_modules(parts: list[nn.Module]) -> dict[str, MoE]:
    """The MoE modules of the model parts, keyed by layer (`"3"`), in layer order."""
    found: dict[str, MoE] = {}
    for part in parts:
        for key, block in getattr(part, "layers", {}).items():
            moe = getattr(block, "moe", None)
            if isinstance(moe, MoE):
                found[key] = moe
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))


@torch.no_grad()
def update_bias(moes: dict[str, MoE], *, rate: float, group: Any = None, update: bool = True) -> torch.Tensor:
    """The step's load of every layer (summed over `group`), the routing biases moved by it (`update`),
    the layers' counts reset; all on the device, no host sync.

    Args:
        moes: This rank's MoE modules by layer (`moe_modules`).
        rate: The bias step (moe.bias_update_rate); 0 only measures.
        group: The process group over which the loads are summed (the data- and context-parallel ranks),
            or None for one process.
        update: False leaves the biases as they are (a step skipped as non-finite changes no state).

    Returns:
        The summed counts, (layers, experts).
    """
    counts = torch.stack([m.tokens_per_expert for m in moes.values()]).float()  # (layers, E)
    if group is not None:
        dist.all_reduce(counts, group=group)
    if rate > 0 and update:
        mean = counts.mean(-1, keepdim=True)
        delta = rate * torch.sign(mean - counts)
        delta = delta - delta.mean(-1, keepdim=True)
        for moe, d in zip(moes.values(), delta):
            moe.expert_bias.add_(d)
    for moe in moes.values():
        moe.tokens_per_expert.zero_()
    return counts


def load_stats(layers: list[str], counts: torch.Tensor, routed_tokens: int = 0) -> dict[str, Any]:
    """The load metrics of one step's counts (layers, experts), read to the host.

    Returns:
        `moe_imbalance` (the largest layer's max / mean load), `moe_imbalance_mean` (over layers), and per
        layer `moe_imbalance_l<i>` and `moe_tokens_l<i>` (tokens per expert: a list; `moe_share_l<i>`, the
        shares, where `routed_tokens`, the step's routed choices over all ranks, is 0).
    """
    share = counts / counts.sum(-1, keepdim=True).clamp(min=1.0)
    mean = counts.mean(-1)
    imbalance = (counts.max(-1).values / mean.clamp(min=1e-9)).tolist()
    stats: dict[str, Any] = {
        "moe_imbalance": max(imbalance),
        "moe_imbalance_mean": sum(imbalance) / len(imbalance),
    }
    for layer, imb, sh in zip(layers, imbalance, share.tolist()):
        stats[f"moe_imbalance_l{layer}"] = imb
        if routed_tokens:
            stats[f"moe_tokens_l{layer}"] = [round(x * routed_tokens) for x in sh]
        else:
            stats[f"moe_share_l{layer}"] = sh
    return stats


def _imbalance(load: torch.Tensor) -> torch.Tensor:
    """Per layer: the largest expert's load over the mean, of a (layers, experts) load."""
    return load.max(-1).values / load.mean(-1).clamp(min=1e-9)


def balance_experts(
    moes: dict[str, MoE], *, rate: float, group: Any = None, routed_tokens: int = 0
) -> dict[str, Any]:
    """`update_bias` then `load_stats`: one step's balance and its metrics (empty for no MoE layer)."""
    if not moes:
        return {}
    return load_stats(list(moes), update_bias(moes, rate=rate, group=group), routed_tokens)


class ExpertBalance:
    """The MoE layers' balance over the model parts, once per optimizer step (nothing for a dense model):
    `step` moves the routing biases on the device; `stats` reads the last step's load when it is logged."""

    def __init__(self, parts: list[nn.Module], *, rate: float, group: Any = None, tokens: int = 0) -> None:
        """`tokens`: the tokens of one optimizer step over all data-parallel ranks."""
        self.moes = moe_modules(parts)
        self.rate, self.group = rate, group
        top_k = next(iter(self.moes.values())).top_k if self.moes else 0
        self.routed = tokens * top_k
        self.counts: torch.Tensor | None = None
        self.window: torch.Tensor | None = None  # the load summed since the last `stats`
        self.window_steps = 0
        self.judged: torch.Tensor | None = None  # logged windows pooled up to JUDGE_STEPS steps
        self.judged_steps = 0
        self.collapsed: list[int] = []  # per layer: judged windows in a row above E / 2 max/mean
        self.warned = False

    def step(self, *, update: bool = True) -> None:
        """This step's load; the routing biases moved by it unless `update` is False (a skipped step)."""
        if self.moes:
            self.counts = update_bias(self.moes, rate=self.rate, group=self.group, update=update)
            self.window = self.counts if self.window is None else self.window + self.counts
            self.window_steps += 1

    def stats(self) -> dict[str, Any]:
        """The last step's load metrics and the window's (a host sync: for logged steps): `load_stats`,
        plus `moe_imbalance_window` (the largest layer's max / mean load summed over the steps since the
        previous call) and `moe_imbalance_window_mean` (over layers); empty for a dense model."""
        if self.counts is None or self.window is None:
            return {}
        window, self.window = self.window, None
        per_layer = _imbalance(window)
        self.judged = window if self.judged is None else self.judged + window
        self.judged_steps, self.window_steps = self.judged_steps + self.window_steps, 0
        if self.judged_steps >= JUDGE_STEPS:
            self._check_collapse(self.judged, _imbalance(self.judged).tolist())
            self.judged, self.judged_steps = None, 0
        return load_stats(list(self.moes), self.counts, self.routed) | {
            "moe_imbalance_window": per_layer.max().item(),
            "moe_imbalance_window_mean": per_layer.mean().item(),
        }

    def _check_collapse(self, window: torch.Tensor, per_layer: list[float]) -> None:
        """Warn once per run (rank 0) when a layer's max/mean load stays above E / 2 for
        `COLLAPSE_WINDOWS` judged windows (of at least JUDGE_STEPS steps) in a row: most of its tokens go
        to one or two experts."""
        limit = window.shape[-1] / 2
        before = self.collapsed or [0] * len(per_layer)
        self.collapsed = [n + 1 if imb > limit else 0 for n, imb in zip(before, per_layer)]
        worst = max(range(len(per_layer)), key=lambda i: (self.collapsed[i], per_layer[i]))
        if self.warned or self.collapsed[worst] < COLLAPSE_WINDOWS:
            return
        self.warned = True
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        layer = list(self.moes)[worst]
        share = (window[worst] / window[worst].sum().clamp(min=1.0)).tolist()
        logger.warning(
            f"MoE routing collapsed: layer {layer} max/mean load {per_layer[worst]:.2f} (of at most "
            f"{window.shape[-1]}) for {self.collapsed[worst]} windows of {JUDGE_STEPS}+ steps in a row, "
            f"token shares {[round(x, 2) for x in share]}; raise moe.bias_update_rate (now {self.rate:g}) or "
            "moe.aux_loss_coeff, or lengthen lr_scheduler.warmup_steps (docs/moe.md, 'Load balance')"
        )
