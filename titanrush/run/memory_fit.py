"""What must fit in one GPU's memory, and which memory: the analytic peak (`memory_model`) plus the caching
allocator's slack and the CUDA context, held against the GPU memory of one rule.

`titanrush estimate` reports these figures; the run's planner (`autoplan`) chooses by them and checks the
run before the model is built, so the two cannot disagree. docs/estimator.md describes the terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from titanrush.config import ConfigError
from titanrush.run import memory_model as mm
from titanrush.run.memory_moe import DEFAULT_IMBALANCE
from titanrush.run.plan import RunPlan

GIB = mm.GIB
CUDA_CONTEXT_GIB = 0.75  # CUDA context, kernels and cuBLAS workspace: outside PyTorch's allocator
NCCL_GIB = 0.5  # NCCL communicators' buffers with more than one GPU
ASSUMED_GPU_MEM_GIB = 80.0  # without --gpu-mem and without a CUDA device: an 80 GiB GPU (H100, A100 80GB)


def gpu_memory(
    given_gib: float | None, device: dict[str, Any] | None = None, *, given_by: str = "--gpu-mem"
) -> tuple[float, str]:
    """The memory of one GPU that an estimate is held against, and the sentence that says where it came
    from: the one rule of `titanrush estimate`, `sweep` and `rush`, dry run or not, on a CPU machine or a
    GPU one.

    1. `--gpu-mem` (or the config's `plan.gpu_mem_gib`) when given (planning for another GPU);
    2. else the CUDA device's memory, where there is one;
    3. else 80 GiB, said so (the host's RAM says nothing about the GPUs the job will run on).

    Args:
        given_gib: `--gpu-mem`, or None.
        device: What the jobs will see: `cuda`, `name` and `mem_gib` (the rush's device probe, run in a
            child so that the tool's own process makes no CUDA context); None: ask torch here.
        given_by: How `given_gib` was given, for the sentence.

    Returns:
        (GiB per GPU, the sentence every report prints).

    Raises:
        ConfigError: `given_gib` is not a positive number.
    """
    if given_gib is not None:
        if not math.isfinite(given_gib) or given_gib <= 0:
            raise ConfigError(f"{given_by} must be a positive number of GiB, got {given_gib}")
        return given_gib, f"{given_gib:g} GiB per GPU ({given_by})"
    if device is None:
        device = this_device()
    if device.get("cuda") and device.get("mem_gib"):
        mem = float(device["mem_gib"])
        return mem, f"{mem:.1f} GiB per GPU (this machine's {device.get('name')}; --gpu-mem for another GPU)"
    return ASSUMED_GPU_MEM_GIB, (
        f"assuming {ASSUMED_GPU_MEM_GIB:g} GiB per GPU (no CUDA device here; pass --gpu-mem)"
    )


def this_device(index: int = 0) -> dict[str, Any]:
    """`cuda`, and with a CUDA device its `name` and `mem_gib` (device `index` of those visible, modulo
    their count: a launcher may show each process its own GPU only)."""
    device: dict[str, Any] = {"cuda": torch.cuda.is_available()}
    if device["cuda"]:
        props = torch.cuda.get_device_properties(index % torch.cuda.device_count())
        device.update(name=props.name, mem_gib=props.total_memory / GIB)
    return device


def context_bytes(ngpu: int) -> int:
    """The CUDA context (and NCCL's buffers with more than one GPU): outside PyTorch's allocator."""
    return int((CUDA_CONTEXT_GIB + (NCCL_GIB if ngpu > 1 else 0.0)) * GIB)


def slack(s: RunPlan, b: mm.Breakdown) -> int:
    """Caching-allocator slack (reserved minus allocated at the peak): a heuristic fitted to H200 runs
    (docs/estimator.md): 5% of the peak, 10% more with collectives (their streams keep their own blocks:
    TP's, PP's, CP's, and FSDP's sharded gradients; not DDP's, which all-reduces in place in gradient
    buckets allocated once: two H200 runs reserved 0.3-0.5% above their allocated peak), 10% more under
    context parallel (ring attention's buffers, a set per attention: three H200 runs at the current trainer
    reserved 27% above their allocated peak), 8% more with fully checkpointed blocks (recomputation
    churns block-sized temporaries); with local experts (`RunPlan.local_experts`, no pipeline) 3% rather
    than 10% for the collectives, which then carry the dense weights alone (three compiled EP2 runs of
    `llama4_1Bx16E` on H200s reserved 6.9-8.8% above their allocated peak);
    under pipeline parallel with FSDP, at a later micro-batch's backward, the first backward's
    activations stranded in the cache (`memory_model.stranded_after_first_backward`)."""
    frac = 0.05
    if s.fsdp or s.tp > 1 or s.pp > 1 or s.cp > 1:
        frac += 0.03 if s.local_experts and s.pp == 1 else 0.10
    if s.cp > 1:
        frac += 0.10
    if s.ac.mode == "full" or (s.ac.mode == "selective" and s.ac.selective != "op"):
        frac += 0.08
    return int(frac * b.peak) + mm.stranded_after_first_backward(b)


@dataclass
class Fit:
    """One plan's memory per GPU, on the pipeline rank that peaks highest: bytes."""

    breakdown: mm.Breakdown  # that rank's
    ranks: list[mm.Breakdown]  # every pipeline rank's
    slack: int
    context: int

    @property
    def total(self) -> int:
        """What must fit in the GPU's memory."""
        return self.breakdown.peak + self.slack + self.context


def fit(s: RunPlan, *, moe_imbalance: float = DEFAULT_IMBALANCE) -> Fit:
    """The analytic model's peak of plan `s` with the allocator's slack and the CUDA context."""
    ranks = [mm.analyze_rank(s, p, moe_imbalance=moe_imbalance) for p in mm.rank_plans(s)]
    b = max(ranks, key=lambda r: r.peak)  # as mm.analyze
    return Fit(b, ranks, slack(s, b), context_bytes(s.world_size))


def unmodelled(s: RunPlan) -> str:
    """Why the analytic model cannot count plan `s` ('' when it can)."""
    if s.moe and (s.float8.enable or s.float8.experts):  # (its float8 terms follow the dense FFN's shapes)
        return (
            "titanrush estimate does not count float8 with mixture-of-experts layers yet; estimate the run "
            "with float8.enable = false and float8.experts = false (float8 converts only the dense linears "
            "and the shared expert; the experts' float8 copies and padded rows are not modelled)"
        )
    return ""
