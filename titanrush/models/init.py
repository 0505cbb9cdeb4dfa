"""Mesh-invariant parameter initialization."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_parameters(
    model: nn.Module, inits: dict[str, Callable[[torch.Tensor, torch.Generator], None]], seed: int
) -> None:
    """Initialize each parameter from a generator seeded by (seed, its name).

    A sharded (DTensor) parameter is drawn over its full global shape and each rank keeps its own
    shard, so a model gets the same weights on one device or on any mesh. Parameters the model
    dropped (pipeline stages) are simply absent from `named_parameters`.
    """
    for name, param in model.named_parameters():
        name = _canonical(name)
        if name not in inits:
            raise KeyError(f"no initializer for parameter {name}")
        is_dt = isinstance(param, DTensor)
        device = param.to_local().device if is_dt else param.device
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        inits[name](full, gen)
        if is_dt:
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def _canonical(name: str) -> str:
    """Strip wrapper prefixes (torch.compile, activation checkpointing) from a parameter name."""
    for prefix in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name
