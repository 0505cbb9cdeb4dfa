"""torch.compile per transformer block.

Compiling each block rather than the whole model keeps compile time flat in the depth (all blocks have
the same code, so after the first one dynamo reuses the graph), and leaves FSDP's hooks and the
pipeline stage boundaries outside the compiled regions.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)


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


def start_compile_workers(workers: int, *, ranks_per_host: int) -> int | None:
    """Size inductor's pool of compile worker processes for this rank and start it now.

    Inductor starts its pool at the first compile, with up to 32 workers per process whatever the number
    of ranks on the machine (four ranks on 64 cores: 128 processes importing torch at once, while each
    rank waits for its first kernels). Started at launch, the pool comes up beside model build and
    data loading instead, one share of the cores per rank.

    Args:
        workers: Workers per rank; 0 for this rank's share of the CPU cores (at most 32); -1 to leave
            inductor's own choice and timing.
        ranks_per_host: Ranks on this machine (torchrun's LOCAL_WORLD_SIZE).

    Returns:
        The workers per rank, or None where inductor keeps its own choice.
    """
    if workers == -1:
        return None
    from torch._inductor import async_compile, config
    from torch.utils._triton import has_triton_package

    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:  # the user's count, which inductor read at import
        n = config.compile_threads or 1
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n = workers or max(1, min(32, cores // max(1, ranks_per_host)))
        config.compile_threads = n
    # The pool compiles Triton kernels (without Triton, a CPU build, inductor compiles in process);
    # TORCH_WARM_POOL=0 is inductor's own switch for not starting it early.
    started = n > 1 and has_triton_package() and os.environ.get("TORCH_WARM_POOL", "1") == "1"
    if started:
        async_compile.AsyncCompile.warm_pool()  # the pool's sidecar process
        wakeup = getattr(async_compile.AsyncCompile, "wakeup", None)
        if wakeup is not None:  # ... and its workers, which otherwise start at the first kernel
            wakeup()
    started_note = ", started at launch" if started else ""
    logger.info(f"compile: {n} inductor compile worker(s) per rank{started_note}")
    return n
