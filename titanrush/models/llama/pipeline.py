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
from torch.distributed.device_mesh import DeviceMesh

from titanrush.models.llama.args import ModelArgs
from titanrush.models.llama.model import Llama, TransformerBlock
from titanrush.parallel.pipeline import build_schedule


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
    microbatches: int


def stage_costs(args: ModelArgs) -> tuple[float, float]:
    """(embedding, output projection) cost in units of one transformer block, from parameter counts.

    The output projection is a matmul as large as its parameters (plus the loss); the embedding is a
    lookup whose cost is its gradient, optimizer step and memory, counted at a third of its size.
    """
    with torch.device("meta"):
        block = sum(p.numel() for p in TransformerBlock(0, args).parameters())
    embed = args.vocab_size * args.dim
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
    stage_layers: dict[int, range],
    n_stages: int,
    schedule: str,
    microbatches: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parallelize: Callable[[nn.Module], nn.Module],
) -> PipelinedLlama:
    """Cut the meta model into this rank's stages, parallelize each, and build the schedule.

    Args:
        model: The whole model on the meta device (untied, plain loss: the plan has checked both).
        stage_layers: This rank's stages (ids) and the layers of each (the run plan's split).
        n_stages: Stages of the whole pipeline.
        schedule: The `torch.distributed.pipelining` schedule's name.
        microbatches: Micro-batches per local batch.
        pp_mesh: The pipeline's mesh dimension.
        device: This rank's device.
        loss_fn: The last stage's loss of one micro-batch.
        parallelize: Applied to each stage (TP, AC, compile, FSDP: `parallelize_llama`).
    """
    assert not model.args.tie_embeddings and model.args.loss_chunk_size == 0
    ids = list(stage_layers)
    parts = [
        parallelize(
            prune_to_stage(
                model, stage_layers[s].start, len(stage_layers[s]), first=s == 0, last=s == n_stages - 1
            )
        )
        for s in ids
    ]
    sched, _ = build_schedule(
        parts,
        ids,
        n_stages,
        schedule=schedule,
        microbatches=microbatches,
        pp_mesh=pp_mesh,
        device=device,
        loss_fn=loss_fn,
    )
    return PipelinedLlama(
        schedule=sched,
        parts=parts,
        view=ModelView(parts),
        has_first=0 in ids,
        has_last=n_stages - 1 in ids,
        microbatches=microbatches,
    )
