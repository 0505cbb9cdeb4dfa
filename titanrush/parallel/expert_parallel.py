"""Expert parallel: the routed experts split over the `ep` mesh dimension, tokens exchanged by all-to-all.

An experts module takes `(x, counts)`: rows sorted by expert, `counts[e]` rows for expert e of all E,
and returns one output row per input row, in the same order. `apply_ep` leaves that contract unchanged
and makes the module compute only with the E / ep experts of this rank (its weights become DTensors
sharded over the experts dimension), by wrapping its forward:

- dispatch: the counts are exchanged first (an all-to-all of E integers), so every rank knows how many
  rows it sends to and receives from each peer (variable splits; one host sync); then the rows go to the
  rank that holds their expert (all-to-all). They arrive grouped by source rank, then by expert; a
  permutation regroups them by local expert (source ranks in order within each expert), computed on the
  device from the count matrix (no Python loop over experts or ranks);
- the local experts run on their groups; a rank that receives fewer than `MIN_ROWS` rows gives them
  zero rows up to that count, in its last expert's group (a zero row's output and gradients are zero);
- combine: the padding dropped, the inverse permutation, and the reverse all-to-all back to the tokens'
  ranks.

Both all-to-alls are autograd functions whose backward is the reverse exchange. Dispatch and combine
run eagerly even inside a compiled block (`torch.compiler.disable`), so every rank issues the same
collectives whatever rows it receives. Traced, the exchange lands in graphs that each rank specializes on
its own row counts: a rank that receives no rows recompiles alone, and on two GPUs the ranks then hung in
the next exchange. The experts between them are compiled for a dynamic row count from the second step on;
dynamo specializes a size of 0 or 1, hence the padding: without it each rank compiles the experts twice
more, mid-run, at the first step it receives no rows and at the first it receives one.

Each rank's expert gradients are then the sums over every token any EP peer sent them, so FSDP, which
shards the experts over the data-parallel ranks outside the EP group, must divide the experts' gradient
sum by the whole data-parallel degree, as it does for the other weights (`shard_experts`). Generic: no
model import.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor


class _AllToAll(torch.autograd.Function):
    """Rows of x: input_splits[r] of them go to rank r, output_splits[r] arrive from rank r."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> torch.Tensor:
    """Autograd-aware `all_to_all_single` with variable splits (backward: the reverse exchange)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def regroup_index(counts: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The permutation taking rows ordered (source rank, expert) to (expert, source rank).

    counts: (ranks, experts), counts[r, e] rows from rank r for local expert e, laid out rank-major;
    rows: their sum where the caller knows it (else it is read from the device: a host sync).
    Returns idx with regrouped = rows[idx]: a stable sort of each row's expert-major key.
    """
    ranks, experts = counts.shape
    key = torch.arange(experts, device=counts.device).repeat(ranks) * ranks
    key = key + torch.arange(ranks, device=counts.device).repeat_interleave(experts)
    row_keys = torch.repeat_interleave(key, counts.reshape(-1), output_size=rows)
    return torch.argsort(row_keys, stable=True)


class _Permute(torch.autograd.Function):
    """rows[index], whose backward is the gather by the inverse permutation (the generic indexing
    backward zero-fills, sorts the index and scatter-adds)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.inverse = inverse
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.index_select(0, ctx.inverse), None, None


MIN_ROWS = 2  # the fewest rows the experts are given: dynamo compiles sizes 0 and 1 apart from the rest


class ExpertParallel:
    """The dispatch and combine around one experts module (state of the forward in flight)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.ep = mesh.size()

    def partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        """Shard the module's own parameters over their first (experts) dimension."""
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def dispatch(
        self, module: nn.Module, inputs: tuple, mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, counts = inputs
        if x.device.type == "meta":  # a pipeline's shape inference: rows in = rows out, nothing to send
            return x, counts
        local = counts.numel() // self.ep
        with torch.no_grad():
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)  # (ep x local): [source][expert]
            matrix = received.reshape(self.ep, local)
            # The one host sync of the exchange: the splits are sizes.
            splits = torch.stack([counts.reshape(self.ep, local).sum(1), matrix.sum(1)]).tolist()
            self.input_splits, self.output_splits = splits
            rows = sum(self.output_splits)
            self.index = regroup_index(matrix, rows)
            self.inverse = torch.empty_like(self.index).scatter_(
                0, self.index, torch.arange(rows, device=x.device)
            )
        x = all_to_all(x, self.output_splits, self.input_splits, self.group)
        x = _Permute.apply(x, self.index, self.inverse)
        counts = matrix.sum(0)
        self.pad = max(0, MIN_ROWS - x.shape[0])
        if self.pad:
            x = torch.cat([x, x.new_zeros(self.pad, *x.shape[1:])])
            counts[-1] += self.pad
        return x, counts

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if out.device.type == "meta":
            return out
        if self.pad:
            out = out[: out.shape[0] - self.pad]
        out = _Permute.apply(out, self.inverse, self.index)
        return all_to_all(out, self.input_splits, self.output_splits, self.group)


def apply_ep(experts: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Split each experts module over `ep_mesh` (1-D), in place (on the meta device is fine)."""
    for module in experts:
        style = ExpertParallel(ep_mesh)
        distribute_module(
            module,
            ep_mesh,
            partition_fn=style.partition,
            # Wrapped here, not as decorators: torch.compiler.disable imports dynamo, which the trainer's
            # import otherwise avoids.
            input_fn=torch.compiler.disable(style.dispatch),
            output_fn=torch.compiler.disable(style.combine),
        )


def local_experts(
    experts: list[nn.Module], *, compute_dtype: torch.dtype | None, grad_divisor: float, recast: list[bool]
) -> set[nn.Parameter]:
    """Experts that no data-parallel rank outside the EP group shares (expert parallel over all of them:
    `efsdp` of one rank) need no FSDP unit, which would only cast, copy and reduce over one rank (hooks
    and copies twice a layer). Each module casts its weights to `compute_dtype` itself (None: as stored)
    and divides its gradients by `grad_divisor` (`shard_experts`'s `divide_factor`): FSDP's mixed precision
    and gradient division, without the unit. `recast[i]`: module i casts again in backward rather than
    keep its casts (where its block is not checkpointed, which recomputes them anyway). Returns their
    parameters, for FSDP's other units to ignore.
    """
    for module, again in zip(experts, recast, strict=True):
        module.compute_dtype, module.grad_divisor, module.recast = compute_dtype, grad_divisor, again
    return {p for module in experts for p in module.parameters()}


def shard_experts(
    experts: list[nn.Module],
    mesh: DeviceMesh,
    *,
    divide_factor: float,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    """FSDP units of their own for the experts modules, over `mesh` (the data-parallel ranks outside EP),
    or for whole MoE layers under tensor parallel (over the data-parallel and the tp ranks).

    Sharded on the experts dimension where each rank can hold whole experts, else on the next one.
    `divide_factor`: the data-parallel degree the gradient sum is divided by (FSDP's default, the size of
    `mesh`, would leave expert gradients ep times larger than the others', and sum over tp ranks that
    computed the same tokens). The other arguments are `titanrush.parallel.fsdp.apply_fsdp`'s: gathered
    in `param_dtype` (None: as stored, where autocast casts), reduced in fp32.
    """
    size = mesh.size()

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        return Shard(0) if local % size == 0 else Shard(1)

    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for module in experts:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=placement,
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
            offload_policy=offload,
        )
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(divide_factor)
        if mesh.device_type == "cpu" and mesh.size(mesh.ndim - 1) > 1:
            # gloo has no pre-multiplied sum: sum, then divide. (Not without a reduce-scatter: FSDP then
            # divides the copy it makes, and would divide a second time.)
            module.set_force_sum_reduction_for_comms(True)
