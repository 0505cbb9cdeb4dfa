"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from titanrush import clip_adamw

logger = logging.getLogger("titanrush")


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
    *,
    name: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: str,
) -> torch.optim.Optimizer:
    """AdamW from torch (fused / foreach / for-loop kernels), ours with the clip folded in (fused_clip:
    `titanrush.clip_adamw.ClipAdamW`, or torch's fused where it cannot run, said once on a machine with
    CUDA), or torchao's low-bit AdamW; `params` is the parameters, or lists of them (one parameter group
    each)."""
    params = list(params)
    if params and isinstance(params[0], list):
        params = [{"params": [p for p in g if p.requires_grad]} for g in params]
        flat = [p for g in params for p in g["params"]]
    else:
        params = flat = [p for p in params if p.requires_grad]
    if name == "adamw" and implementation == "fused_clip":
        why = clip_adamw.unavailable(flat)
        if why is None:
            return clip_adamw.ClipAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if torch.cuda.is_available():  # (on a machine without CUDA torch's kernel is the expected one)
            logger.info(f"optimizer.implementation = fused_clip: {why}; torch's fused AdamW, the clip apart")
        implementation = "fused"
    if name == "adamw":
        impl = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl[implementation]
        )
    if name in ("adamw8bit", "adamw4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit  # (validate.check_machine: torchao imports)

        cls = AdamW8bit if name == "adamw8bit" else AdamW4bit
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"optimizer.name = {name!r} is not one of adamw, adamw8bit, adamw4bit")


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, decay: str, decay_ratio: float, min_lr_factor: float
) -> float:
    """Multiplier of the peak learning rate for the 1-based optimizer step `step`.

    Linear warmup reaches 1 at `warmup_steps`; then linear or cosine decay reaches `min_lr_factor` at
    the last step; wsd stays at 1 and decays linearly over the last `decay_ratio` of the steps after warmup.
    """
    if step <= warmup_steps:
        return step / max(warmup_steps, 1)
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    if decay == "linear":
        return 1.0 - progress * (1.0 - min_lr_factor)
    if decay == "cosine":
        return min_lr_factor + (1.0 - min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "wsd":
        decay_steps = max(math.ceil(decay_ratio * span), 1)
        start = total_steps - decay_steps
        if step <= start:
            return 1.0
        return 1.0 - (step - start) / decay_steps * (1.0 - min_lr_factor)
    raise ValueError(f"lr_scheduler.decay = {decay!r} is not one of linear, cosine, wsd")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    decay: str,
    decay_ratio: float,
    min_lr_factor: float,
) -> LambdaLR:
    """A LambdaLR whose factor for the k-th optimizer step (k from 1) is `lr_factor(k)`."""
    fn = functools.partial(
        lr_factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay=decay,
        decay_ratio=decay_ratio,
        min_lr_factor=min_lr_factor,
    )
    # LambdaLR evaluates its lambda at 0 for the first step's lr, so shift by one.
    return LambdaLR(optimizer, lambda i: fn(i + 1))
