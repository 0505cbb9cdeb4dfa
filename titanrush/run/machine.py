"""Which machine a config needs: a GPU config on a machine without CUDA is refused before anything is built,
instead of running until the kernel kills it.

A config is a *GPU config* when either

- it asks for something that runs on CUDA GPUs only (`cuda_features`): context parallel, the flash, flex or
  cuDNN attention kernels, activation offload, float8 on tensor cores (not emulated), float8 experts, async
  tensor parallel; or
- its plan that needs least memory (its auto levers at their most frugal) does not fit this machine: the
  analytic estimate's peak allocated of one process, times the processes on this machine, is above its
  memory (the cgroup's limit where lower). The 8B at seq 8192 is one; the debug model is not.
  `plan.memory_check = false` leaves this test out, as it leaves out the GPU's.

`titanrush train` (a run or `--check`) and `titanrush sweep` refuse a GPU config where no CUDA device is
visible (exit status 2, one line: `gpu_need`'s sentence and the tool's way out); `--assume-cuda` (with
`--check`, or a sweep's `--dry-run`) checks it as on the GPUs instead. docs/auto_plan.md is the manual.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from titanrush.config import ConfigError, JobConfig
from titanrush.launch_env import whole_number
from titanrush.run import autoplan, validate
from titanrush.run.memory_fit import GIB, fit, unmodelled
from titanrush.run.memory_moe import DEFAULT_IMBALANCE
from titanrush.run.plan import build_plan

NEEDS = "this config needs "  # (how `gpu_need`'s sentence starts)
CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # (cgroup v2: a container's memory limit, or "max")


@dataclass(frozen=True)
class Host:
    """The machine a CPU run would use: its processes of the job, and its memory (GiB)."""

    processes: int
    mem_gib: float


def host_memory_gib() -> float:
    """This machine's memory: the physical RAM, or the cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = CGROUP_LIMIT.read_text().strip()
    except OSError:
        limit = ""
    if limit.isdigit():
        total = min(total, int(limit))
    return total / GIB


def this_host(world_size: int) -> Host:
    """The processes of a `world_size` job on this machine (LOCAL_WORLD_SIZE, which torchrun sets and
    run_train.sh's check passes; else all of them) and this machine's memory."""
    local = whole_number(os.environ, "LOCAL_WORLD_SIZE", world_size, 1)
    return Host(min(local, world_size), host_memory_gib())


def cuda_features(cfg: JobConfig) -> list[str]:
    """What the config asks for that runs on CUDA GPUs only, each with why (`validate.check_machine`
    refuses each on a machine without CUDA)."""
    p, m, f8 = cfg.parallelism, cfg.model, cfg.float8
    kernels = {
        "flash": "flash-attn's kernels run on CUDA GPUs",
        "flex": "FlexAttention has no backward on CPU",
        "cudnn": "cuDNN attention is a GPU kernel",
    }
    asked = [
        (p.cp > 1, "parallelism.cp > 1: ring attention runs on SDPA's GPU kernels"),
        (
            m.attn_backend in kernels,
            f"model.attn_backend = {m.attn_backend!r}: {kernels.get(m.attn_backend)}",
        ),
        (
            cfg.activation_checkpoint.offload_first > 0,
            "activation_checkpoint.offload_first: activation offload moves a GPU's activations to the host",
        ),
        (f8.enable and not f8.emulate, "float8.enable without float8.emulate: float8 tensor cores"),
        (f8.experts, "float8.experts: float8 grouped GEMMs"),
        (cfg.experimental.async_tp, "experimental.async_tp: symmetric memory over NVLink"),
    ]
    return [words for on, words in asked if on]


def _least_memory(cfg: JobConfig, world_size: int, moe_imbalance: float) -> tuple[int, int] | None:
    """(peak allocated, total) in bytes per GPU of the config's plan that needs least memory (its auto
    levers at their most frugal, without offload); None where the analytic model cannot count it."""
    if validate.auto_levers(cfg):
        try:
            plain, _ = autoplan.candidates(
                cfg, world_size, offload="none", machine=False, moe_imbalance=moe_imbalance
            )
        except ConfigError:
            if unmodelled(build_plan(autoplan.stand_in(cfg), world_size, machine=False)):
                return None
            raise
        plan = min(plain, key=lambda c: c.total).plan
    else:
        plan = build_plan(cfg, world_size, machine=False)
        if unmodelled(plan):
            return None
    need = fit(plan, moe_imbalance=moe_imbalance)
    return need.breakdown.peak, need.total


def gpu_need(
    cfg: JobConfig,
    world_size: int,
    host: Host,
    *,
    memory: bool = True,
    moe_imbalance: float = DEFAULT_IMBALANCE,
) -> str:
    """'' where `cfg` on `world_size` processes can run on this machine without GPUs; else the sentence
    `this config needs N CUDA GPUs of ~X GiB (why)`, X the estimate per GPU of its plan that needs least
    memory. `memory` false (`plan.memory_check = false`): CUDA-only features alone make a GPU config.

    Raises:
        ConfigError: the config is invalid (as `build_plan` says, the machine's own checks aside).
    """
    features = cuda_features(cfg)
    least = _least_memory(cfg, world_size, moe_imbalance) if memory else None
    why = list(features)
    if least is not None:
        peak, _ = least
        if peak * host.processes > host.mem_gib * GIB:
            times = f" x {host.processes} processes" if host.processes > 1 else ""
            why.append(
                f"its plan that needs least memory takes about {peak / GIB:.0f} GiB per process{times}, "
                f"beyond this machine's {host.mem_gib:.0f} GiB"
            )
    if not why:
        return ""
    gpus = f"{world_size} CUDA GPU{'s' if world_size > 1 else ''}"
    size = "" if least is None else f" of ~{_gib(least[1])} GiB"
    return f"{NEEDS}{gpus}{size} ({'; '.join(why)})"


def _gib(n: int) -> str:
    x = n / GIB
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"
