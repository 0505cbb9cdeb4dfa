"""The process group and the launch environment: ranks, init, barriers, rank 0's word to every rank.

torchrun (or `run_train.sh`) sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; a process started
without them is rank 0 of 1. Everything here is a no-op without a process group, so single-process code
calls it unconditionally.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, from torchrun's environment variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def ranks_from_env(environ: dict[str, str] | os._Environ = os.environ) -> Ranks:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (defaults: one process)."""
    return Ranks(
        rank=int(environ.get("RANK", "0")),
        world_size=int(environ.get("WORLD_SIZE", "1")),
        local_rank=int(environ.get("LOCAL_RANK", "0")),
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
    )


def init(device: torch.device, *, nccl_max_ctas: int = 0) -> None:
    """Start the default process group (NCCL on GPUs, gloo on CPU) when the job has several processes.

    No device is bound at init: each group's NCCL communicator starts at its first collective, so the
    mesh's groups that nothing uses (size-1 dimensions, flattened views of the same ranks) never start
    one. `nccl_max_ctas` > 0 caps the thread blocks of one NCCL collective (NCCL_MAX_CTAS, read when a
    communicator starts; a value already in the environment wins).
    """
    if dist.is_initialized() or ranks_from_env().world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and nccl_max_ctas > 0:
        os.environ.setdefault("NCCL_MAX_CTAS", str(nccl_max_ctas))
    dist.init_process_group(backend)


def barrier() -> None:
    """All ranks meet (a no-op without a process group). NCCL's barrier is given this rank's device:
    communicators start lazily, and NCCL would otherwise guess the device from the global rank."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def from_rank0(value: str = "") -> str:
    """Rank 0's `value` on every rank (every rank calls it; the others' values are ignored)."""
    if not dist.is_initialized():
        return value
    box = [value]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def destroy() -> None:
    """End the process group, and free the groups that the mesh and DTensors still reference now: left to
    interpreter shutdown, gloo's aborts the process now and then ("terminate called without an active
    exception", seen in about 1 run in 10 on CPU with a DeviceMesh)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def set_allocator_env(environ: dict[str, str] | os._Environ, *, expandable: bool) -> None:
    """The CUDA caching allocator's `expandable_segments` setting, through the environment variable the
    allocator reads when it starts (so before this process's first CUDA allocation); a setting already in
    the environment wins."""
    if not any(environ.get(k) for k in ALLOC_VARS):
        environ["PYTORCH_ALLOC_CONF"] = f"expandable_segments:{expandable}"


def all_ranks(value: list[str]) -> list[str]:
    """Every rank's `value` lists joined in rank order, duplicates dropped (every rank calls it): findings
    that each rank makes on its share of the work, so that every rank can raise the same error."""
    if not dist.is_initialized():
        return list(value)
    out: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)  # NCCL: through the current device, which the trainer has set
    return list(dict.fromkeys(item for items in out for item in items or []))
