"""torch.compile per transformer block.

Compiling each block rather than the whole model keeps compile time flat in the depth (all blocks have
the same code, so after the first one dynamo reuses the graph), and leaves FSDP's hooks and the
pipeline stage boundaries outside the compiled regions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Inductor's passes that move a compiled graph's collectives and their waits, in the order its config
# recommends: none raises the graph's peak memory.
OVERLAP_PASSES = (
    "reorder_communication_preserving_peak_memory",
    "sink_waits_iterative",
    "reorder_communication_preserving_peak_memory",
)


@dataclass(frozen=True)
class CompilePlan:
    """torch.compile of the blocks ([compile], experimental.async_tp), as in effect for the run."""

    enable: bool = False
    fullgraph: bool = True  # each block one graph (a graph break raises instead of falling back)
    overlap_collectives: bool = False  # Inductor reorders the collectives in compiled blocks (under TP)
    async_tp: bool = False  # Inductor's micro-pipelined TP (experimental.async_tp)

    def inductor_options(self) -> dict[str, Any]:
        """torch.compile's `options` for the blocks: collectives moved to overlap compute, async TP.

        Under async TP Inductor fuses each all-gather + matmul and matmul + reduce-scatter into chunked
        kernels over symmetric memory, leaving the collectives that reordering already hides alone.
        """
        options: dict[str, Any] = {}
        if self.overlap_collectives:
            options["reorder_for_compute_comm_overlap"] = True
            options["reorder_for_compute_comm_overlap_passes"] = list(OVERLAP_PASSES)
        if self.async_tp:
            options["_micro_pipeline_tp"] = True
        return options


def apply_compile(model: nn.Module, plan: CompilePlan = CompilePlan(enable=True)) -> None:
    """Replace every block of `model.layers` by `torch.compile(block)`, in place.

    The entry in the ModuleDict becomes the compiled wrapper, so parameter names gain `_orig_mod.`
    (which checkpoint loading and weight init strip). The compiled wrapper is the module that FSDP then
    shards, which keeps FSDP's all-gather and reduce-scatter hooks outside the compiled graph.

    Args:
        model: A model whose blocks live in the ModuleDict `model.layers` (possibly already wrapped for
            activation checkpointing: the checkpoint is then traced into the graph).
        plan: `fullgraph` and the Inductor options (`CompilePlan.inductor_options`; none: the defaults).
    """
    # All blocks share one code object. Should dynamo's guards tell them apart (a per-block constant),
    # each needs its own cache entry, and validation's other shape one more: past the limit dynamo
    # would silently run the block eagerly.
    limit = 2 * len(model.layers) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    options = plan.inductor_options() or None
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=plan.fullgraph, options=options))
