"""Gradient clipping by the true global norm over DTensor shards and pipeline stages."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most max_norm (0 = no clipping); return the norm.

    Sharded gradients (FSDP, TP) contribute their shard's squares and are summed over their mesh by
    DTensor; with pipeline parallelism each stage holds different parameters, so the squares are
    also summed over the pipeline ranks. Every rank returns the same total.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    # Sum the local squares of gradients that share a mesh and placements, then reduce each group once
    # over the mesh dimensions it is sharded (or partial) on.
    groups: dict[tuple, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):  # pending sums: settle them first
                g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(g.to_local())
        else:
            plain.append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=_first_local_device(grads))
    for (mesh, placements), locals_ in groups.items():
        # Reduce on the mesh's device: with FSDP's CPU offload the gradients live on the host, but an
        # NCCL group only takes CUDA tensors.
        sq = _sum_sq(locals_).to(_mesh_device(mesh))
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():
                dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total_sq = total_sq + sq.to(total_sq.device)
    if plain:
        total_sq = total_sq + _sum_sq(plain).to(total_sq.device)
    if pp_mesh is not None and pp_mesh.size() > 1:
        total_sq = total_sq.to(_mesh_device(pp_mesh))
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    total = total_sq.sqrt()
    if max_norm > 0 and params:
        # One call per mesh: the multi-tensor kernels take DTensors of one mesh at a time (expert
        # parallel's experts live on their own mesh).
        by_mesh: dict[object, list[torch.nn.Parameter]] = {}
        for p in params:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        for same_mesh in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total)
    return total


def _sum_sq(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].device.type == "cpu":
        # The CPU kernel accumulates fp32 norms with a relative error near 1e-4 on million-element tensors
        # (enough to tell a sharded norm from an unsharded one); accumulate in fp64 there.
        norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
        return torch.stack(norms).square().sum().float()
    return torch.nn.utils.get_total_norm(tensors, 2.0).square()


def _first_local_device(grads: list[torch.Tensor]) -> torch.device:
    for g in grads:
        return g.to_local().device if isinstance(g, DTensor) else g.device
    return torch.device("cpu")


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())
