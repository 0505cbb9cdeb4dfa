"""torch.compile per transformer block.

Compiling each block rather than the whole model keeps compile time flat in the depth (all blocks have
the same code, so after the first one dynamo reuses the graph), and leaves FSDP's hooks and the
pipeline stage boundaries outside the compiled regions.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, *, fullgraph: bool = True) -> None:
    """Replace every block of `model.layers` by `torch.compile(block)`, in place.

    The entry in the ModuleDict becomes the compiled wrapper, so parameter names gain `_orig_mod.`
    (which checkpoint loading and weight init strip). The compiled wrapper is the module that FSDP then
    shards, which keeps FSDP's all-gather and reduce-scatter hooks outside the compiled graph.

    Args:
        model: A model whose blocks live in the ModuleDict `model.layers` (possibly already wrapped for
            activation checkpointing: the checkpoint is then traced into the graph).
        fullgraph: Compile each block as one graph, raising on a graph break instead of falling back.
    """
    # All blocks share one code object. Should dynamo's guards tell them apart (a per-block constant),
    # each needs its own cache entry, and validation's other shape one more: past the limit dynamo
    # would silently run the block eagerly.
    limit = 2 * len(model.layers) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
