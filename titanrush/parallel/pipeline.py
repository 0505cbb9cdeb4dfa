"""Pipeline parallel: balanced layer splits, stage placement per schedule, and the schedule itself.

Model-agnostic: the model-specific part (cutting a model into stage modules) lives with the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

# The schedules by name; torch's pipelining (which imports the compiler) is imported by `build_schedule`
# alone, so that the plan's splits cost no import.
SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank; the others (Interleaved1F1B, ...) several


def stages_per_rank(schedule: str, requested: int) -> int:
    """Virtual stages each rank holds: 1 for GPipe/1F1B, `requested` (default 2) for the others
    (`titanrush.run.validate` has checked `requested` against the schedule)."""
    if schedule in SINGLE_STAGE:
        return 1
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
    assert n_layers >= n_stages, f"{n_stages} pipeline stages need at least {n_stages} layers"

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

    Gradients are not rescaled by the schedule (`scale_grads=False`): the loss function divides each
    micro-batch's sum by the step's count of valid tokens itself, so gradient accumulation stays exact.
    """
    from torch.distributed.pipelining import PipelineStage, schedules

    group = pp_mesh.get_group()
    stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids)]
    cls = getattr(schedules, f"Schedule{schedule}")  # (the config schema's names: GPipe -> ScheduleGPipe)
    arg = stages[0] if schedule in SINGLE_STAGE else stages
    sched = cls(arg, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return sched, stages
