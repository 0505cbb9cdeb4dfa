"""Context parallel: the sequence split over the `cp` ranks, ring attention through SDPA.

`torch.distributed.tensor.experimental.context_parallel` shards the given buffers along their sequence
dimension for the duration of a forward and backward, with head-tail load balancing for causal
attention (rank i holds chunks i and 2*cp-1-i of 2*cp, so every rank has the same amount of attention
work), and replaces SDPA by ring attention that passes K/V shards between the ranks. Positions travel
as an explicit `position_ids` buffer sharded like the tokens, so RoPE rotates each token by its true
position on every shard. Ring attention assumes one K/V head per query head: the model is built with
its K/V heads repeated before SDPA (`ModelArgs.expand_kv`, set by the run's plan).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel


def set_rotate_method(method: str) -> None:
    """How K/V shards move between ranks: `allgather` (all at once) or `alltoall` (ring passes)."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method as _set

    _set(method)


@contextlib.contextmanager
def context_parallel_step(cp_mesh: DeviceMesh, buffers: list[torch.Tensor]) -> Iterator[None]:
    """Shard `buffers` (each (B, T, ...)) over cp_mesh along dim 1 in place for one forward/backward.

    The buffers stay sharded afterwards (they are this step's batch, not reused), and SDPA is limited to
    the kernels ring attention supports.
    """
    from torch.distributed.tensor.experimental import context_parallel

    with (
        context_parallel(
            cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        ),
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
    ):
        yield
