"""Pipeline parallel: balanced layer splits, stage placement per schedule, and the schedule itself.

Model-agnostic: the model-specific part (cutting a model into stage modules) lives with the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from titanrush.config import ConfigError

SINGLE_STAGE = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
MULTI_STAGE = {
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
}


def stages_per_rank(schedule: str, requested: int) -> int:
    """Virtual stages each rank holds: 1 for GPipe/1F1B, `requested` (default 2) for the others."""
    if schedule in SINGLE_STAGE:
        if requested > 1:
            raise ConfigError(
                f"parallelism.pp_schedule = {schedule} runs one stage per rank; set pp_stages_per_rank = 1 "
                "or choose Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble"
            )
        return 1
    if schedule == "ZBVZeroBubble" and requested not in (0, 2):
        raise ConfigError("parallelism.pp_schedule = ZBVZeroBubble places exactly 2 stages per rank (a V)")
    return requested or 2


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """Which stages this rank runs: loop placement (i, i+pp, ...) or, for ZBV, a V (i, 2pp-1-i)."""
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(per_rank)]


def balanced_split(n_layers: int, n_stages: int, *, embed_cost: float, output_cost: float) -> list[int]:
    """Layers per stage, contiguous, minimizing the most expensive stage.

    Each transformer block costs 1; the first stage also pays `embed_cost` and the last `output_cost`
    (in block units: the output projection of a large vocabulary costs about a block or more).
    """
    if n_layers < n_stages:
        raise ConfigError(
            f"{n_stages} pipeline stages need at least {n_stages} layers, the model has {n_layers}"
        )

    def cost(stage: int, layers: int) -> float:
        extra = (embed_cost if stage == 0 else 0.0) + (output_cost if stage == n_stages - 1 else 0.0)
        return layers + extra

    # Exact dynamic programme: best[s][k] = minimal max-cost of placing the first k layers in s stages.
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for k in range(s, n_layers - (n_stages - s) + 1):
            for take in range(1, k - (s - 1) + 1):
                value = max(best[s - 1][k - take], cost(s - 1, take))
                if value < best[s][k] - 1e-12:
                    best[s][k], choice[s][k] = value, take
    sizes, k = [], n_layers
    for s in range(n_stages, 0, -1):
        sizes.append(choice[s][k])
        k -= choice[s][k]
    return sizes[::-1]


def check_explicit_split(layers_per_stage: list[int], n_layers: int, n_stages: int) -> list[int]:
    if len(layers_per_stage) != n_stages or sum(layers_per_stage) != n_layers or min(layers_per_stage) < 1:
        raise ConfigError(
            f"parallelism.pp_layers_per_stage = {layers_per_stage} must list {n_stages} positive counts "
            f"(pp x stages per rank) that add up to the model's {n_layers} layers"
        )
    return layers_per_stage


def build_schedule(
    modules: list[nn.Module],
    ids: list[int],
    n_stages: int,
    *,
    schedule: str,
    microbatches: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[object, list[PipelineStage]]:
    """PipelineStages for this rank's modules and the schedule that drives them.

    Gradients are not rescaled by the schedule (`scale_grads=False`): the loss function divides by the
    number of micro-batches itself, so gradient accumulation across steps stays exact.
    """
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids)]
    if schedule in SINGLE_STAGE:
        cls, arg = SINGLE_STAGE[schedule], stages[0]
    else:
        cls, arg = MULTI_STAGE[schedule], stages
    sched = cls(arg, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return sched, stages
