"""Context parallel: the sequence split over the `cp` ranks, ring attention through SDPA.

`torch.distributed.tensor.experimental.context_parallel` shards the given buffers along their sequence
dimension for the duration of a forward and backward, with head-tail load balancing for causal
attention (rank i holds chunks i and 2*cp-1-i of 2*cp, so every rank has the same amount of attention
work), and replaces SDPA by ring attention that passes K/V shards between the ranks. In bf16 the ring
moves the grouped K/V heads (cuDNN and flash take them); in fp32 its memory-efficient kernel takes one
K/V head per query head, and the plan builds the model with its K/V heads repeated before SDPA
(`ModelArgs.expand_kv`).

Positions: the model's RoPE table (one row per position of the sequence) is sharded with the batch, in
the same layout, so that row j of a rank's table is the position of its token j. Every module that holds
a table (every pipeline stage of this rank) gets its shard, and no position tensor has to travel with
the micro-batches through the pipeline: a stage of any schedule rotates its tokens by their true
positions from its own table. The tables are restored when the step ends (validation and checkpoints see
the whole table); the batch stays sharded (it is this step's, not reused).

Under pipeline parallel the schedule's step runs inside the context, so every stage's attention of
every micro-batch (forward, backward, and the stages' shape inference at the first step) is ring
attention over the same cp group; the micro-batches are cut along the batch dimension, so each holds
the same positions as the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass(frozen=True)
class CPPlan:
    """Context parallel's settings for the run ([parallelism]; the degree is `ParallelDims.cp`)."""

    rotate: str = "allgather"  # how ring attention exchanges K/V: allgather or alltoall (`set_rotate_method`)


def set_rotate_method(method: str) -> None:
    """How K/V shards move between ranks: `allgather` (all at once) or `alltoall` (ring passes)."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method as _set

    _set(method)


def unique_tables(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tables, each tensor once (a table shared by two modules must be sharded once)."""
    return list({id(t): t for t in tables}.values())


def check_tables(seq_len: int, tables: list[torch.Tensor]) -> None:
    """Each RoPE table must hold exactly one row per position of the sequence to shard with it."""
    for table in tables:
        if table.shape[0] != seq_len:
            raise ValueError(
                f"context parallel shards the RoPE table with the sequence: it needs {seq_len} rows (one "
                f"per position), it has {table.shape[0]}; build the model with ModelArgs.rope_positions = "
                "the sequence length (the run plan does)"
            )


@contextlib.contextmanager
def context_parallel_step(
    cp_mesh: DeviceMesh, batch: list[torch.Tensor], tables: list[torch.Tensor]
) -> Iterator[None]:
    """One forward/backward (or one pipeline step) with the sequence sharded over `cp_mesh`.

    Args:
        cp_mesh: The context-parallel mesh dimension.
        batch: The step's tensors (B, T, ...) (tokens, labels): sharded along dim 1 in place, for good.
        tables: The RoPE tables (T, ...) of this rank's model parts: sharded along dim 0 in place, in the
            batch's layout, and restored when the step ends.

    Raises:
        ValueError: A table whose rows are not the batch's sequence length.

    Inside, SDPA is ring attention over `cp_mesh`, limited to the kernels ring attention supports.
    """
    from torch.distributed.tensor.experimental import context_parallel

    tables = unique_tables(tables)
    check_tables(batch[0].shape[1], tables)
    with (
        context_parallel(
            cp_mesh,
            buffers=[*batch, *tables],
            buffer_seq_dims=[1] * len(batch) + [0] * len(tables),
            no_restore_buffers=set(batch),
        ),
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
    ):
        yield


def cp_step_context(
    cp_mesh: DeviceMesh | None, batch: list[torch.Tensor], tables: list[torch.Tensor]
) -> contextlib.AbstractContextManager:
    """`context_parallel_step` where there is a cp mesh (cp > 1), else a context that does nothing."""
    if cp_mesh is None:
        return contextlib.nullcontext()
    return context_parallel_step(cp_mesh, batch, tables)
