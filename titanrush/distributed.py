"""The process group and the launch environment: ranks, init, barriers, rank 0's word to every rank.

The ranks come from the launcher's environment (`titanrush.launch_env`). Everything here is a no-op
without a process group, so single-process code calls it unconditionally.
"""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from titanrush.errors import RunError
from titanrush.launch_env import ranks_from_env  # (also the trainer's: distributed.ranks_from_env)

logger = logging.getLogger("titanrush")

T = TypeVar("T")


def init_device(local_rank: int, *, expandable: bool) -> torch.device:
    """This process's device: CUDA device `local_rank` (made current, the allocator's expandable_segments
    set before its first allocation, see `set_allocator_env`), or the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    if not set_allocator_env(os.environ, expandable=expandable):
        logger.warning("CUDA started before the trainer: training.expandable_segments not applied")
    torch.cuda.set_device(device)
    return device


def init(device: torch.device, *, nccl_max_ctas: int = 0, timeout_s: float = 1800.0) -> None:
    """Start the default process group (NCCL on GPUs, gloo on CPU) when the job has several processes.

    No device is bound at init: each group's NCCL communicator starts at its first collective, so the
    mesh's groups that nothing uses (size-1 dimensions, flattened views of the same ranks) never start
    one. `nccl_max_ctas` > 0 caps the thread blocks of one NCCL collective (NCCL_MAX_CTAS, read when a
    communicator starts; a value already in the environment wins).

    `timeout_s` (`job.collective_timeout`) is the default group's (the mesh's groups get it from
    `ParallelDims.build_mesh`): a collective that waits longer fails on the ranks that wait. The flight
    recorder keeps each group's last `TRACE_ENTRIES` collectives (what the step watchdog names when a
    step hangs, `titanrush.run.watchdog`), and under NCCL dumps them when a collective times out; values
    already in the environment win.
    """
    if dist.is_initialized() or ranks_from_env().world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    for key, value in trace_env(backend).items():
        os.environ.setdefault(key, value)
    if backend == "nccl" and nccl_max_ctas > 0:
        os.environ.setdefault("NCCL_MAX_CTAS", str(nccl_max_ctas))
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:  # (the rendezvous waits on the store for every rank, at most timeout_s)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(
            f"the job's {ranks_from_env().world_size} processes did not all connect within "
            f"job.collective_timeout = {timeout_s:g} s ({first}): raise job.collective_timeout, or look in "
            "the launcher's lines for a process that failed to start"
        ) from None


TRACE_ENTRIES = 2000


def trace_env(backend: str) -> dict[str, str]:
    """The flight recorder's settings for `backend` (environment variables read when a group starts)."""
    env = {"TORCH_FR_BUFFER_SIZE": str(TRACE_ENTRIES)}  # (NCCL's older name warns that it is deprecated)
    if backend == "nccl":
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    return env


def backend() -> str:
    """The default process group's backend ("gloo", "nccl"), or "" without one."""
    return dist.get_backend() if dist.is_initialized() else ""


def barrier() -> None:
    """All ranks meet (a no-op without a process group). NCCL's barrier is given this rank's device:
    communicators start lazily, and NCCL would otherwise guess the device from the global rank."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def from_rank0(value: T) -> T:
    """Rank 0's `value` (any picklable object) on every rank (every rank calls it; the others' values
    are ignored)."""
    if not dist.is_initialized():
        return value
    box = [value]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def all_sum(value: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    """`value` summed in place over each process group of `groups` in turn (None entries: skipped, as is
    everything without a process group); returns `value`."""
    for group in groups:
        if group is not None and dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def destroy() -> None:
    """End the process group, and free the groups that the mesh and DTensors still reference now: left to
    interpreter shutdown, gloo's aborts the process now and then ("terminate called without an active
    exception", seen in about 1 run in 10 on CPU with a DeviceMesh)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def set_allocator_env(environ: dict[str, str] | os._Environ, *, expandable: bool) -> bool:
    """The CUDA caching allocator's `expandable_segments` setting, through the environment variable the
    allocator reads when CUDA starts in this process (`titanrush.train` sets it before anything does); a
    setting already in the environment wins. Returns False where CUDA has started already (too late: the
    allocator runs with what it read)."""
    if any(environ.get(k) for k in ALLOC_VARS):  # (set before CUDA started: by titanrush.train or the user)
        return True
    environ["PYTORCH_ALLOC_CONF"] = f"expandable_segments:{expandable}"
    return not torch.cuda.is_initialized()


def set_determinism(seed: int, *, deterministic: bool) -> None:
    """Seed torch's generators; with `deterministic`, deterministic algorithms only (slower). TF32 stays
    off: fp32 runs are measured against the fp32 peak."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def all_ranks(value: list[str]) -> list[str]:
    """Every rank's `value` lists joined in rank order, duplicates dropped (every rank calls it): findings
    that each rank makes on its share of the work, so that every rank can raise the same error."""
    if not dist.is_initialized():
        return list(dict.fromkeys(value))
    out: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)  # NCCL: through the current device, which the trainer has set
    return list(dict.fromkeys(item for items in out for item in items or []))
