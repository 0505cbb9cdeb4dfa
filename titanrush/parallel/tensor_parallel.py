"""Tensor parallel helpers: applying a plan, the styles the Llama's plan adds to torch's, async TP.

The plan itself (which module is column-wise, row-wise, sequence-parallel) belongs to the model: see
`titanrush/models/llama/parallelize.py`. Terms:
- column-wise linear: the weight's output features are split over the TP ranks; a replicated input
  gives each rank its slice of the output features (heads, FFN hidden units). No communication.
- row-wise linear: the input features are split; each rank's product is a partial sum, reduced over
  the ranks (all-reduce, or reduce-scatter over the sequence under sequence parallel).
- sequence parallel: between a row-wise and the next column-wise layer the activations are sharded
  over the sequence, so the norms and residual adds run on 1/tp of the tokens; the all-reduce becomes a
  reduce-scatter plus an all-gather (same volume, less memory and compute).
- loss parallel: the output projection keeps its logits sharded over the vocabulary and the
  cross-entropy is computed on the shards, never all-gathering the (tokens, vocab) logits
  (`titanrush.models.llama.loss.vocab_parallel_cross_entropy_sum`).
- async TP: inside the compiled blocks Inductor splits each sequence-parallel all-gather + matmul (and
  matmul + reduce-scatter) into chunks whose exchange over symmetric memory overlaps the partial
  matmuls (`enable_async_tp` here, the option in `titanrush.parallel.compile.CompilePlan`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module


@dataclass(frozen=True)
class TPPlan:
    """Tensor parallel's settings for the run ([parallelism]; the degree is `ParallelDims.tp`). The module
    -> style plan they select is the model's (`titanrush.models.llama.parallelize.llama_tp_plan`)."""

    sequence_parallel: bool = True  # the residual stream between blocks sharded over the sequence
    loss_parallel: bool = True  # the output's logits stay sharded over the vocabulary for the loss


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters over the TP mesh; it computes on a replicated (plain) input.

    For the modules that TP does not split when sequence parallel is off (the norms): their parameters
    become replicated DTensors like every other parameter, so the optimizer sees one kind of tensor
    (fused and foreach kernels refuse a mix of DTensors and plain tensors) and the gradient-norm
    reduction counts them once. Input and output stay plain local tensors for the caller.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_input, output_fn=_local_output)


def _replicated_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


class SyncRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` whose output reduction has completed when the module returns.

    The stock style redistributes its partial output asynchronously and hands on an
    AsyncCollectiveTensor. When that tensor enters a compiled block from eager code (the embedding
    feeding block 0 under per-block compile), torch 2.13 routes the gradient back to the collective
    with the global shape and without its DTensor wrapper, and backward fails. Nothing runs between the
    embedding and block 0 anyway, so waiting here costs no overlap.
    """

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> Any:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Register the TP group with symmetric memory, where async TP's fused kernels exchange the shards.

    Inductor's async TP pass (`compile.CompilePlan.async_tp`) fuses only over registered groups and
    skips the others without a word; torch 2.11 marks the registration deprecated ("no need to
    call") while its pass still requires it, so the deprecation warning is silenced here.
    """
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def sum_output_over(module: nn.Module, mesh: DeviceMesh, field: str) -> None:
    """After each forward of `module`, sum its output's `field` over the ranks of `mesh`, in place.

    For a statistic of whole sequences computed by a module that sees only this rank's shard of each
    (sequence parallel's tp ranks, context parallel's cp ranks): Llama 4's router counts each sequence's
    choices per expert, which its balance loss needs whole. The output is a dataclass and `field` a
    tensor without gradient; a functional all-reduce, so that compile can trace it.
    """

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        return dataclasses.replace(out, **{field: funcol.all_reduce(getattr(out, field), "sum", mesh)})

    module.register_forward_hook(hook)


def apply_tp_plan(module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """`parallelize_module` over the entries of `plan` whose submodule exists (is not None), in place.

    Pipeline stages drop `tok_embeddings`, `norm` or `output` (set to None); their plan entries are
    skipped instead of failing.
    """
    present = {name: style for name, style in plan.items() if _get(module, name) is not None}
    if present:
        parallelize_module(module, tp_mesh, present)


def _get(module: nn.Module, name: str) -> nn.Module | None:
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
