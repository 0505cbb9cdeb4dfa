"""The memory check before the model is built: a run whose plan the estimate says does not fit the GPU stops
with the estimate and the nearest plan that fits, instead of running out of memory after its first step.

`plan_run` is what `titanrush train` (and `--check`) runs before building anything: on a machine without
CUDA, the refusal of a GPU config (`machine.gpu_need`; `--assume-cuda` checks it as on the GPUs instead);
the GPU memory of the run (`gpu_target`), the auto levers resolved (`autoplan.resolve`), then the check
(`check_memory`), which `plan.memory_check = false` skips. Without a GPU memory to hold the plan against
(no CUDA device, no `plan.gpu_mem_gib`) there is nothing to check.
"""

from __future__ import annotations

from titanrush.config import ConfigError, JobConfig
from titanrush.run import autoplan
from titanrush.run.autoplan import Choice, resolve
from titanrush.run.machine import gpu_need, this_host
from titanrush.run.memory_fit import ASSUMED_GPU_MEM_GIB, GIB, fit, gpu_memory, this_device, unmodelled
from titanrush.run.memory_moe import DEFAULT_IMBALANCE
from titanrush.run.nearest import MORE_GPUS, Fix, fixes
from titanrush.run.plan import RunPlan

NO_GPU = "no CUDA device here and no plan.gpu_mem_gib: no GPU memory to fit"
ASSUMED_NOTE = f"{ASSUMED_GPU_MEM_GIB:g} GiB per GPU (assumed by --assume-cuda; plan.gpu_mem_gib sets it)"
ASSUME_CUDA_FIX = (
    "this machine has none: --check --assume-cuda checks it as on the GPUs (--plan.gpu_mem_gib for their "
    "memory, NGPU for their number)"
)


def gpu_target(cfg: JobConfig, local_rank: int = 0, *, assume_cuda: bool = False) -> tuple[float | None, str]:
    """The GPU memory a run's plan is held against (GiB, or None: none) and the sentence saying whence:
    `plan.gpu_mem_gib`, else this process's CUDA device; with `assume_cuda` and no CUDA device, the
    estimator's assumed GPU."""
    if cfg.plan.gpu_mem_gib:
        return gpu_memory(cfg.plan.gpu_mem_gib, given_by="plan.gpu_mem_gib")
    device = this_device(local_rank)
    if not device["cuda"]:
        if assume_cuda:
            return ASSUMED_GPU_MEM_GIB, ASSUMED_NOTE
        return None, NO_GPU
    return gpu_memory(None, device)


def plan_words(s: RunPlan) -> str:
    """A plan's levers in words, as the planner's table names them."""
    reshard = f"ZeRO-{2 if s.fsdp_plan.reshard == 'never' else 3} ({s.fsdp_plan.reshard})" if s.fsdp else ""
    offload = "FSDP CPU offload" if s.fsdp_plan.cpu_offload else ""
    return "; ".join(w for w in (autoplan.ac_words(s), reshard, offload, f"{s.loss} loss") if w)


def check_memory(choice: Choice, *, machine: bool = True, moe_imbalance: float = DEFAULT_IMBALANCE) -> str:
    """Raise a ConfigError, with the estimate and the nearest plan that fits, when the chosen (or explicit)
    plan does not fit the GPU's memory; return a note ('' or why nothing was checked).

    An auto plan must fit with `plan.margin` to spare (as the planner chose it); an explicit one the whole
    memory (a plan known to run close to it is not refused). The plans suggested fit with the margin.
    """
    assert choice.gpu_mem_gib is not None
    s = choice.plan
    if why := unmodelled(s):
        return f"memory not checked: {why}"
    total = choice.chosen.total if choice.chosen is not None else fit(s, moe_imbalance=moe_imbalance).total
    limit = choice.gpu_mem_gib * (1 - choice.margin) * GIB
    if total <= (limit if choice.levers else choice.gpu_mem_gib * GIB):
        return ""
    near = fixes(choice.given, s, limit, machine=machine, moe_imbalance=moe_imbalance)
    fix = verdict_fixes(near, choice.given, s.world_size)
    if choice.levers:
        what = (
            f"no plan of the auto levers fits the GPU with {choice.margin:.0%} to spare (plan.margin): the "
            f"one that needs least memory ({plan_words(s)}) is"
        )
    else:
        what = f"the run does not fit the GPU: its plan ({plan_words(s)}) is"
    raise ConfigError(
        f"{what} estimated at {total / GIB:.1f} GiB per GPU against {choice.gpu_note}; {fix}. `titanrush "
        "estimate` with the same config shows where the memory goes; --plan.memory_check false starts the "
        "run anyway"
    )


def verdict_fixes(near: list[Fix], cfg: JobConfig, world_size: int) -> str:
    """The nearest plan that fits (`nearest.fixes`), and the fastest mesh beside it where there is one, as
    the verdict words them."""
    if not near:
        return f"no plan fits, not even on {MORE_GPUS[-1]}x the GPUs"
    first, *rest = near
    what = "the nearest plan that fits" + (", a mesh" if first.kind == "mesh" else "")
    text = f"{what} ({first.gib:.1f} GiB): {first.text(cfg, world_size)}"
    for mesh in rest:  # (the mesh where the levers cannot fit at this one, after a smaller batch)
        text += f"; or the fastest mesh of these GPUs that fits ({mesh.gib:.1f} GiB): "
        text += mesh.text(cfg, world_size)
    return text


def plan_run(
    cfg: JobConfig, world_size: int, *, local_rank: int = 0, machine: bool = True, assume_cuda: bool = False
) -> Choice:
    """The run's plan: auto levers resolved for this GPU's memory, then held to it (`check_memory`).

    Args:
        cfg: The job config.
        world_size: The job's processes (GPUs).
        local_rank: This process's GPU (its memory, where plan.gpu_mem_gib is not set).
        machine: Check what this machine must provide (False: plan for another machine).
        assume_cuda: On a machine without CUDA, plan and check as on the GPUs (`--check --assume-cuda`):
            no refusal of a GPU config, no check of this machine, plan.gpu_mem_gib else 80 GiB per GPU.

    Raises:
        ConfigError: the config is invalid, a GPU config meets a machine without CUDA (`machine.gpu_need`),
            or the plan does not fit (naming the nearest that does).
    """
    if machine and not this_device(local_rank)["cuda"]:
        if assume_cuda:
            machine = False  # (what the GPU machine must provide is its own: flash-attn, torchao, ...)
        elif need := gpu_need(cfg, world_size, this_host(world_size), memory=cfg.plan.memory_check):
            raise ConfigError(f"{need}; {ASSUME_CUDA_FIX}")
    gpu, note = gpu_target(cfg, local_rank, assume_cuda=assume_cuda)
    choice = resolve(cfg, world_size, gpu, note, machine=machine)
    if gpu is not None and cfg.plan.memory_check:
        checked = check_memory(choice, machine=machine)
        choice.note = "; ".join(n for n in (choice.note, checked) if n)
    return choice
