"""Activation checkpointing of transformer blocks: full, every N-th block, or selective by op.

Each block of `model.layers` (a ModuleDict) is replaced by a non-reentrant `checkpoint_wrapper` around
it. Parameter names gain `_checkpoint_wrapped_module.`, which checkpoint loading and weight init strip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanrush.config import ConfigError


def _ops_to_save() -> set[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls, attention kernels, reductions over ranks.

    Everything else in a block (RMSNorm, RoPE, SiLU, the gating product, residual adds, casts) is
    element-wise and memory-bound: recomputing it costs little time, while keeping its fp32
    intermediates costs a lot of memory.
    """
    aten = torch.ops.aten
    ops: set[Any] = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        # Under tensor parallel the row-wise outputs are reduce-scattered: keeping the result means the
        # recomputation issues no collective.
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # float8 scaling computes absolute maxima of whole tensors: tiny to keep, a full pass to redo.
        aten.max.default,
    }
    flex = getattr(torch._higher_order_ops, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return ops


def _selective_op_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # We keep every matmul output rather than torchtitan's every other one: the point of `op` mode is
    # to recompute only the cheap element-wise work and never a matmul; when memory is tighter than
    # that, `full` or `selective = N` is the lever. The saved matmul outputs (q, k, v, attention, wo,
    # w1, w3, w2) are about half of what a block keeps without checkpointing, since the fp32 norm,
    # RoPE and SwiGLU intermediates are dropped.
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE = _ops_to_save()


def _selective_op_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_op_policy)


def wrap_block(block: nn.Module, *, selective_op: bool = False) -> nn.Module:
    """One block wrapped for non-reentrant checkpointing (recompute all, or only the cheap ops)."""
    if selective_op:
        return checkpoint_wrapper(
            block,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            context_fn=_selective_op_context,
            preserve_rng_state=False,
        )
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply_ac(model: nn.Module, *, mode: str, selective: str = "op") -> None:
    """Wrap the transformer blocks of `model.layers` for activation checkpointing, in place.

    Args:
        model: A model whose blocks live in the ModuleDict `model.layers`.
        mode: `none` (leave the model as it is), `full` (recompute every block in backward) or
            `selective` (see `selective`).
        selective: With mode `selective`: `op` keeps the outputs of matmuls and attention kernels and
            recomputes only the element-wise ops of every block; an integer N checkpoints blocks
            N-1, 2N-1, ... fully (every N-th block; N = 1 is `full`) and leaves the rest alone.

    Raises:
        ConfigError: An unknown mode, or a `selective` value that is neither `op` nor a positive integer.
    """
    if mode == "none":
        return
    if mode == "full":
        wrap: Callable[[int, nn.Module], nn.Module | None] = lambda i, b: wrap_block(b)
    elif mode == "selective" and selective == "op":
        wrap = lambda i, b: wrap_block(b, selective_op=True)
    elif mode == "selective" and selective.isdigit() and int(selective) > 0:
        every = int(selective)
        wrap = lambda i, b: wrap_block(b) if (i + 1) % every == 0 else None
    elif mode == "selective":
        raise ConfigError(
            f"activation_checkpoint.selective = {selective!r}: use 'op' or a positive integer N "
            "(checkpoint every N-th block)"
        )
    else:
        raise ConfigError(f"activation_checkpoint.mode = {mode!r}: use none, full or selective")
    for i, (name, block) in enumerate(list(model.layers.items())):
        wrapped = wrap(i, block)
        if wrapped is not None:
            model.layers.register_module(name, wrapped)
