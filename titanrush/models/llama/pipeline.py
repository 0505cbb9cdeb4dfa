"""Cutting the Llama into pipeline stages; each stage then goes through `parallelize_llama`.

A stage is a pruned copy of the meta-device model: it keeps its blocks under their original keys
(`layers.<i>`), the first stage keeps `tok_embeddings`, the last keeps `norm` and `output`, and the
others are None. Parameter names therefore stay the full model's, so weights initialize identically
and checkpoints reshard between pipelined and non-pipelined meshes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanrush.config import Parallelism
from titanrush.models.llama.model import Llama
from titanrush.parallel.pipeline import (
    balanced_split,
    build_schedule,
    check_explicit_split,
    stage_ids,
    stages_per_rank,
)


class ModelView(nn.Module):
    """This rank's stages seen as one module with the full model's parameter names.

    The optimizer, gradient clipping and checkpoints work on it as on an unpipelined model.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings is not None), None)
        self.layers = nn.ModuleDict({k: v for p in parts for k, v in p.layers.items()})
        self.norm = next((p.norm for p in parts if p.norm is not None), None)
        self.output = next((p.output for p in parts if p.output is not None), None)


@dataclass
class PipelinedLlama:
    schedule: object
    parts: list[nn.Module]
    view: ModelView
    has_first: bool
    has_last: bool
    layers_per_stage: list[int]
    microbatches: int


def stage_costs(model: Llama) -> tuple[float, float]:
    """(embedding, output projection) cost in units of one transformer block, from parameter counts.

    The output projection is a matmul as large as its parameters (plus the loss); the embedding is a
    lookup whose cost is its gradient, optimizer step and memory, counted at a third of its size.
    """
    block = sum(p.numel() for p in model.layers["0"].parameters())
    embed = model.tok_embeddings.weight.numel()
    return embed / block / 3, embed / block


def prune_to_stage(model: Llama, first_layer: int, n: int, *, first: bool, last: bool) -> Llama:
    """A copy of the (meta) model holding layers [first_layer, first_layer + n) and its ends."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in range(first_layer, first_layer + n)}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


def pipeline_llama(
    model: Llama,
    *,
    pp_rank: int,
    pp_mesh: object,
    parallelism: Parallelism,
    local_batch_size: int,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parallelize: Callable[[nn.Module], nn.Module],
) -> PipelinedLlama:
    """Split the meta model into this rank's stages, parallelize each, and build the schedule.

    The combinations it cannot build (tied embeddings, a chunked loss, a batch the micro-batches do not
    divide) are rejected by the trainer's `check_config` before this runs.
    """
    assert not model.args.tie_embeddings and model.args.loss_chunk_size == 0
    pp, schedule = parallelism.pp, parallelism.pp_schedule
    per_rank = stages_per_rank(schedule, parallelism.pp_stages_per_rank)
    n_stages = pp * per_rank
    n_layers = model.args.n_layers
    if parallelism.pp_layers_per_stage:
        sizes = check_explicit_split(parallelism.pp_layers_per_stage, n_layers, n_stages)
    else:
        embed_cost, output_cost = stage_costs(model)
        sizes = balanced_split(n_layers, n_stages, embed_cost=embed_cost, output_cost=output_cost)
    microbatches = parallelism.pp_microbatches or n_stages
    assert local_batch_size % microbatches == 0 and microbatches >= pp
    ids = stage_ids(schedule, pp_rank, pp, per_rank)
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    parts = [
        parallelize(prune_to_stage(model, starts[s], sizes[s], first=s == 0, last=s == n_stages - 1))
        for s in ids
    ]
    sched, _ = build_schedule(parts, ids, n_stages, schedule=schedule, microbatches=microbatches,
                              pp_mesh=pp_mesh, device=device, loss_fn=loss_fn)  # fmt: skip
    return PipelinedLlama(
        schedule=sched,
        parts=parts,
        view=ModelView(parts),
        has_first=0 in ids,
        has_last=n_stages - 1 in ids,
        layers_per_stage=sizes,
        microbatches=microbatches,
    )
