"""Activation checkpointing of transformer blocks: full, every N-th block, or selective by op.

Each block of `model.layers` (a ModuleDict) is replaced by a `CheckpointedBlock` around it, which runs the
block under `torch.utils.checkpoint.checkpoint` (non-reentrant). Parameter names gain
`_checkpoint_wrapped_module.` (the name PyTorch's own wrapper uses, which distributed checkpointing and
weight init strip); the wrapper's state dict keys are the block's own, in both directions, so a
checkpoint does not depend on whether the run that wrote or reads it recomputes activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanrush.parallel.activation_offload import offloaded


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
    grouped = getattr(aten, "_grouped_mm", None)  # a mixture of experts' matmuls (torch >= 2.9)
    if grouped is not None:
        ops.add(grouped.default)
    return ops


# Operators of titanrush's own whose outputs are kept too, by name (registered where the model is built):
# flash-attn-4's attention (models/llama/attention.py).
_SAVE_BY_NAME = frozenset({"titanrush::flash_attn"})


def _kept(func: Any) -> bool:
    return func in _SAVE or (isinstance(func, torch._ops.OpOverload) and func.name() in _SAVE_BY_NAME)


# What each `op_matmuls` policy recomputes, by a matmul's 1-based position in the block's forward (a Llama
# block runs wq, wk, wv, wo, w1, w3, w2): `alternate` every even one (wk, wo, w3), `all_but_w3` the 6th
# (w3, the feed-forward's up projection, whose output is as large as w1's and 3.5x wq's).
OP_MATMULS: dict[str, Callable[[int], bool]] = {
    "all": lambda k: False,
    "alternate": lambda k: k % 2 == 0,
    "all_but_w3": lambda k: k == 6,
}


def _selective_op_context(op_matmuls: str = "all") -> Any:
    """Contexts for one checkpointed call of a block: keep the outputs of the ops in `_SAVE` (and of
    titanrush's operators named in `_SAVE_BY_NAME`).

    We keep every matmul output by default rather than torchtitan's every other one: the point of
    `op` mode is to recompute only the cheap element-wise work and never a matmul. `alternate` keeps
    the 1st, 3rd, ... matmul of the block (q, v, w1, w2 in a Llama block) and recomputes the others,
    for when memory is tighter; `all_but_w3` recomputes only w3's (between the two in memory, and one
    policy for every block where `alternate` with `op_all_last` needs two). The count restarts for each
    call and separately for the forward and the recomputation, so both make the same choice.
    """
    counts = {False: 0, True: 0}
    recompute = OP_MATMULS[op_matmuls]

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if not _kept(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func is torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            if recompute(counts[ctx.is_recompute]):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


_SAVE = _ops_to_save()


_WRAPPED = "_checkpoint_wrapped_module."


def _state_dict_without_wrapper(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any
) -> None:
    """State dict post-hook: `<prefix>_checkpoint_wrapped_module.<key>` is saved as `<prefix><key>`."""
    inner = prefix + _WRAPPED
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _load_state_dict_into_wrapper(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_rest: Any
) -> None:
    """Load pre-hook: the block's own keys (`<prefix><key>`) reach the wrapped block."""
    inner = prefix + _WRAPPED
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


class CheckpointedBlock(nn.Module):
    """A block recomputed in backward: its forward runs under non-reentrant `checkpoint`, nothing saved."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = block
        self.register_state_dict_post_hook(_state_dict_without_wrapper)
        self.register_load_state_dict_pre_hook(_load_state_dict_into_wrapper)

    def __getattr__(self, name: str) -> Any:
        """The block's own attributes (e.g. its init scale) read through the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_checkpoint_wrapped_module":  # (not set yet: no block to ask)
                raise
            return getattr(self._checkpoint_wrapped_module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            self._checkpoint_wrapped_module, *args, use_reentrant=False, preserve_rng_state=False, **kwargs
        )


class SelectiveOpCheckpoint(CheckpointedBlock):
    """A block under selective op checkpointing, its policy (`op_matmuls`) an attribute the forward reads.

    Every block runs the same forward code, so torch.compile keeps one cache of graphs for all of them and
    picks a graph by its guards. A policy hidden in a `context_fn` closure is invisible to them: every
    block would run the graph compiled for the first, whatever its own policy (measured: with op_all_last
    under compile all blocks recomputed as block 0 did). Reading the policy here makes dynamo guard on
    it: one graph per policy.
    """

    def __init__(self, block: nn.Module, op_matmuls: str) -> None:
        super().__init__(block)
        self.op_matmuls = op_matmuls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A branch on the attribute (an unused read would not be guarded), to module-level functions
        # (dynamo's checkpoint takes those, not a closure made while tracing).
        if self.op_matmuls == "all":
            context_fn = _keep_every_matmul
        elif self.op_matmuls == "alternate":
            context_fn = _keep_alternate_matmuls
        else:
            context_fn = _keep_all_but_w3
        return checkpoint(
            self._checkpoint_wrapped_module,
            *args,
            use_reentrant=False,
            preserve_rng_state=False,
            context_fn=context_fn,
            **kwargs,
        )


def _keep_every_matmul() -> Any:
    return _selective_op_context("all")


def _keep_alternate_matmuls() -> Any:
    return _selective_op_context("alternate")


def _keep_all_but_w3() -> Any:
    return _selective_op_context("all_but_w3")


def wrap_block(block: nn.Module, *, selective_op: bool = False, op_matmuls: str = "all") -> nn.Module:
    """One block wrapped for non-reentrant checkpointing (recompute all, or only the cheap ops)."""
    if selective_op:
        return SelectiveOpCheckpoint(block, op_matmuls)
    return CheckpointedBlock(block)


def checkpointed(block: nn.Module) -> bool:
    """Whether `apply_ac` wrapped the block whole (full, or selective per op), so that its backward
    recomputes its forward's cheap ops anyway; blocks checkpointed by parts are not. A compiled block is
    looked at inside `torch.compile`'s wrapper."""
    return isinstance(getattr(block, "_orig_mod", block), CheckpointedBlock)


def wrap_moe_parts(block: nn.Module, op_matmuls: str) -> None:
    """Selective op checkpointing of a mixture-of-experts block by parts, in place: its `attention` per
    `op_matmuls`, its MoE layer's `router` and `shared_expert` keeping every matmul output; the rest of
    the MoE layer (the permutation, the experts and, under expert parallel, their exchange) and the norms
    are not checkpointed.

    For MoE layers that hold FSDP units of their own (the experts under expert parallel, the whole layer
    under tensor parallel): a unit's hooks inside a per-op checkpointed region run differently when it
    is recomputed (the unit is already gathered for its backward), and per-op checkpointing requires the
    recomputation to repeat the forward's operations one for one (torch raises). No region here holds a
    unit's hooks, and the experts' all-to-alls are never repeated.
    """
    block.register_module("attention", wrap_block(block.attention, selective_op=True, op_matmuls=op_matmuls))
    moe = block.moe
    for name in ("router", "shared_expert"):
        if getattr(moe, name) is not None:
            moe.register_module(name, wrap_block(getattr(moe, name), selective_op=True, op_matmuls="all"))


@dataclass(frozen=True)
class ACPlan:
    """Activation checkpointing and offload of the run ([activation_checkpoint]).

    mode: `none` (leave the model as it is), `full` (recompute every block in backward) or `selective`
        (see `selective`).
    selective: With mode `selective`: `op` keeps the outputs of matmuls and attention kernels and
        recomputes only the element-wise ops of every block; an integer N checkpoints blocks
        N-1, 2N-1, ... fully (every N-th block; N = 1 is `full`) and leaves the rest alone.
    op_matmuls: With `op`: `all` keeps every matmul output, `alternate` every other one, `all_but_w3`
        all but w3's (`OP_MATMULS`).
    op_all_last: With `op` and `alternate`: the last N blocks of the whole model (by their global
        index, the key in `model.layers`; `model.args.n_layers` blocks in all) keep every matmul output.
    offload_first, offload_every: Every `offload_every`-th of the model's first `offload_first` blocks
        (global indices), whose saved tensors activation offload moves to the host
        (`activation_offload.apply_offload`), whatever `mode` says (see `apply_ac`).
    moe_by_parts: With `op`: the blocks with a mixture-of-experts layer (`block.moe`) are checkpointed
        by parts (`wrap_moe_parts`), for MoE layers with FSDP units of their own (expert or tensor
        parallel).
    """

    mode: str = "none"
    selective: str = "op"
    op_matmuls: str = "all"
    op_all_last: int = 0
    offload_first: int = 0
    offload_every: int = 1
    moe_by_parts: bool = False


def apply_ac(model: nn.Module, plan: ACPlan, *, compiled: bool = False) -> None:
    """Wrap the transformer blocks of `model.layers` for activation checkpointing, in place.

    Args:
        model: A model whose blocks live in the ModuleDict `model.layers`.
        plan: What to recompute (`ACPlan`). The blocks activation offload moves (`plan.offload_first`) are
            wrapped whatever `plan.mode` says: with `compiled`, selective `op` keeping every matmul output
            (the compiled block's saved tensors are what the policy keeps, so the offload moves those and
            the block recomputes no matmul); in eager left unwrapped (the checkpoint keeps its tensors
            out of reach of the offload's hooks).
        compiled: Whether the blocks will be compiled (see `plan`).
    """
    if plan.mode in ("none", "full"):
        wrap: Callable[[int, str, nn.Module], nn.Module | None] = lambda i, name, b: (
            wrap_block(b) if plan.mode == "full" else None
        )
    elif plan.mode == "selective" and plan.selective == "op":
        last = plan.op_all_last
        keep_all = _last_blocks(model, last) if last and plan.op_matmuls == "alternate" else set()

        def wrap(i: int, name: str, b: nn.Module) -> nn.Module | None:
            op_matmuls = "all" if name in keep_all else plan.op_matmuls
            if plan.moe_by_parts and getattr(b, "moe", None) is not None:
                wrap_moe_parts(b, op_matmuls)  # (in place: the block itself stays as it is)
                return None
            return wrap_block(b, selective_op=True, op_matmuls=op_matmuls)

    else:  # (titanrush.run.validate: mode is none, full or selective; selective is op or a positive N)
        assert plan.mode == "selective" and int(plan.selective) > 0, plan
        every = int(plan.selective)
        wrap = lambda i, name, b: wrap_block(b) if (i + 1) % every == 0 else None
    for i, (name, block) in enumerate(list(model.layers.items())):
        if offloaded(int(name), plan.offload_first, plan.offload_every):
            wrapped = wrap_block(block, selective_op=True, op_matmuls="all") if compiled else None
        else:
            wrapped = wrap(i, name, block)
        if wrapped is not None:
            model.layers.register_module(name, wrapped)


def _last_blocks(model: nn.Module, last: int) -> set[str]:
    """The `model.layers` keys of the model's last `last` blocks (global indices: a pipeline stage holds
    only some of them)."""
    n_layers = model.args.n_layers
    assert 0 <= last <= n_layers, (last, n_layers)
    return {str(j) for j in range(n_layers - last, n_layers)}
