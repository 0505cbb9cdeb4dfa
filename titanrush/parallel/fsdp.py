"""FSDP2 (`fully_shard`) per transformer block, with mixed precision, CPU offload and explicit prefetch.

Units, in execution order: `tok_embeddings`, each block of `layers`, then `[norm, output]` together,
and the root (whatever is left: the tied embedding table, buffers). Each unit all-gathers its parameters
before its forward, frees them after (unless told to keep them), all-gathers again in backward and
reduce-scatters the gradients. A 2-D mesh (dp_replicate x dp_shard) gives HSDP: parameters are sharded
within each replica group and gradients are also all-reduced across the groups.

Only FSDP2's public API is used: `fully_shard`, its mixed-precision and offload policies, and the
explicit prefetch lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

ReshardPolicy = Literal["default", "always", "never"]


@dataclass(frozen=True)
class FSDPPlan:
    """FSDP's settings for the run ([parallelism] fsdp_*), as in effect.

    reshard: `always` frees every unit's gathered parameters after its forward (ZeRO-3, least memory);
        `never` keeps them until backward (ZeRO-2 like, no second all-gather); `default` frees them except
        for the units backward needs first: the last block and `[norm, output]`, whose all-gathers backward
        would otherwise wait on right away. (Pipelined stages run `never`: `titanrush.run.plan`.)
    keep_gathered_last: With `default`: the last N blocks keep their gathered parameters until backward
        too (ZeRO-2 for them), for their gathered weights held at the end of forward.
    cpu_offload: Keep the sharded parameters, gradients and optimizer states in host memory; each unit is
        copied to the device for its all-gather (and its gradients back after the reduce-scatter). The
        optimizer step then runs on the CPU.
    """

    reshard: ReshardPolicy = "default"
    keep_gathered_last: int = 0
    cpu_offload: bool = False


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: FSDPPlan,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    inner_units: dict[str, list[nn.Module]] | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard `model` with FSDP2 over `mesh`, in place.

    Args:
        model: A Llama-shaped model: `tok_embeddings`, `layers` (ModuleDict), `norm`, `output`; any of
            the first, third and fourth may be None (pipeline stages). May already be tensor-parallel
            (its parameters DTensors on a `tp` mesh of the same root mesh).
        mesh: The data-parallel mesh: 1-D (`dp_shard_cp`) for FSDP, 2-D (`dp_replicate`, `dp_shard_cp`)
            for HSDP.
        plan: When units free their gathered parameters, and where the sharded ones live (`FSDPPlan`).
        param_dtype: dtype of the all-gathered parameters, i.e. of the compute (bf16 for mixed precision).
            The sharded master weights and the optimizer stay in their own dtype (fp32). The root and the
            embedding and output units cast their floating-point forward inputs to it; the blocks do not
            (their residual input is in it already, and the RoPE table stays fp32).
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce (fp32 keeps the sum exact enough).
        inner_units: Block key -> the modules inside that block already sharded as units of their own
            (expert parallel's experts; MoE layers under TP), in the order they run after the block's
            own unit starts: they join the prefetch chain there.
        ignored: Parameters no unit manages (expert parallel's experts where EP spans every data-parallel
            rank: `expert_parallel.local_experts`); they keep their own placement and gradients.
    """
    assert plan.reshard in ("default", "always", "never"), plan.reshard
    common: dict = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if plan.cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if ignored:  # (expert parallel's experts where they take no unit: `expert_parallel.local_experts`)
        common["ignored_params"] = ignored
    # A block's inputs are the residual stream, already in param_dtype (the output of the embedding or
    # of the previous block, whose weights are gathered in it; a later pipeline stage's root casts what
    # it receives), and the RoPE table, which must stay fp32: cast, every block would rotate with a
    # rounded table and keep its own bf16 copy of it for backward. So block units cast nothing; the
    # root (token ids, or a stage's received activations) and the other units keep FSDP's cast.
    block_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    never = plan.reshard == "never"
    always = plan.reshard == "always"

    emb, norm, out = model.tok_embeddings, model.norm, model.output
    # A tied table is one parameter in two modules: both must then live in the same unit (the root).
    tied = emb is not None and out is not None and emb.weight is out.weight
    units: list[nn.Module] = []  # each unit's first module (which runs its hooks), in forward order
    if emb is not None and not tied:
        fully_shard(emb, reshard_after_forward=not never, **common)
        units.append(emb)
    blocks = list(model.layers.items())
    keep_from = len(blocks) - max(1, plan.keep_gathered_last)
    for i, (key, block) in enumerate(blocks):
        kept = i >= keep_from  # backward needs it early (the last block), or asked for (ZeRO-2 blocks)
        fully_shard(
            block,
            reshard_after_forward=always or (not never and not kept),
            **{**common, "mp_policy": block_policy},
        )
        units.append(block)
        if inner_units and key in inner_units:
            units.extend(inner_units[key])
    if out is not None and not tied:
        head = [m for m in (norm, out) if m is not None]
        fully_shard(head, reshard_after_forward=always, **common)
        units.append(head[0])
    # The root gathers what no unit claimed; FSDP never frees the root after forward.
    fully_shard(model, **common)
    _set_prefetch(model, units)


def _set_prefetch(root: nn.Module, units: list[nn.Module]) -> None:
    """Explicit prefetch, one unit ahead in forward and one behind in backward.

    Implicit forward prefetch only happens when the CPU runs ahead of the GPU: each all-gather is issued
    when the unit's forward starts. Asking unit i to start unit i+1's all-gather when it starts its own
    forward overlaps that communication with unit i's compute even when the CPU is the bottleneck,
    for the price of one more unit's gathered parameters held at a time. Backward mirrors it (which is
    also FSDP's implicit backward behaviour, made explicit so it follows the same unit list).
    """
    if not units:
        return
    assert isinstance(root, FSDPModule)
    root.set_modules_to_forward_prefetch([units[0]])
    for cur, nxt in zip(units[:-1], units[1:]):
        assert isinstance(cur, FSDPModule) and isinstance(nxt, FSDPModule)
        cur.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([cur])
