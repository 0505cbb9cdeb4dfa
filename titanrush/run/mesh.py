"""Mesh proposals: where the levers cannot fit a run at its mesh (data parallel alone, for the 70B on one
8-GPU node or the 405B), the tensor, pipeline and context parallel degrees that do, the fastest first.

The shapes are the sweep's (`titanrush sweep`'s default grid, `shapes`): tp, pp and cp over the divisors of
the GPU count, dp_shard taking the rest, tensor parallel within a node. Each shape keeps the run's global
batch (a smaller data-parallel degree accumulates more micro-batches, a larger one takes a smaller local
batch) and leaves its levers to the planner: the cheapest plan of the shape that fits (`autoplan`). Among
the shapes that fit, the cost model ranks them (`plan_cost`: tensor parallel's collectives, the pipeline's
bubble, context parallel's ring, FSDP's gathers, on top of what the levers add). A mesh changes how the
work is split, so it is only ever proposed: the user writes the degrees into the config.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from titanrush.config import ConfigError, JobConfig
from titanrush.run.autoplan import AC, KEEP, LOSS, RESHARD, Candidate, with_settings
from titanrush.run.memory_fit import fit
from titanrush.run.plan import RunPlan, build_plan
from titanrush.run.plan_cost import GPUS_PER_NODE, step_cost
from titanrush.run.validate import AUTO_AC_KEYS

DEGREES = ("dp_shard", "tp", "pp", "cp")


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (the sweep's default grid takes each degree over them)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes(ngpu: int) -> list[dict[str, int]]:
    """Every tp x pp x cp of `ngpu` GPUs with dp_shard taking the rest (dp_replicate 1), tensor parallel
    within a node (`GPUS_PER_NODE`: across nodes its collectives would cross the network each block)."""
    out = []
    for tp, pp, cp in itertools.product(divisors(ngpu), repeat=3):
        if ngpu % (tp * pp * cp) == 0 and tp <= GPUS_PER_NODE:
            out.append({"dp_shard": ngpu // (tp * pp * cp), "tp": tp, "pp": pp, "cp": cp})
    return out


def describe(shape: dict[str, int]) -> str:
    """`tp 8, dp_shard 2`: the degrees above 1 (`dp_shard 1` where all are 1)."""
    return ", ".join(f"{d} {shape[d]}" for d in DEGREES if shape[d] > 1) or "dp_shard 1"


def settings(
    cfg: JobConfig, plan: RunPlan, shape: dict[str, int], *, keep_global: bool
) -> dict[str, Any] | None:
    """The config values of `shape` for `cfg` (its degrees, dp_replicate 1). `keep_global`: with the
    global batch of `plan` kept, the largest local batch up to its own that gives it (None where none
    does: the global batch is not a multiple of the shape's data-parallel degree); else the local batch
    as it is (the global batch follows the data-parallel degree, or stays the config's)."""
    out: dict[str, Any] = {f"parallelism.{d}": shape[d] for d in DEGREES}
    out["parallelism.dp_replicate"] = 1
    if not keep_global:
        return out
    global_batch = plan.local_batch * plan.dp * plan.accum
    if global_batch % shape["dp_shard"]:
        return None
    per_rank = global_batch // shape["dp_shard"]
    local = max(k for k in divisors(per_rank) if k <= plan.local_batch)
    if local != plan.local_batch:
        out["training.local_batch_size"] = local
    if cfg.training.global_batch_size == -1:
        out["training.global_batch_size"] = global_batch
    return out


def least_memory_floor(cfg: JobConfig, world_size: int, *, machine: bool, moe_imbalance: float) -> int | None:
    """The least memory of `cfg`'s plans without offload (bytes per GPU), as a bound to skip what cannot
    fit: the two policies that keep least (full checkpointing, which recomputes a block whole at a time,
    and per-op keeping every other matmul output), the weights resharded after every forward, either loss;
    None: the config is refused. (`cfg` leaves checkpointing's policy keys at their defaults: the
    planner's.)"""
    frugal = {RESHARD: "always", KEEP: 0}
    policies = [{AC + "mode": "full"}, {AC + "mode": "selective", AC + "op_matmuls": "alternate"}]
    totals = []
    for policy in policies:
        for loss in ("chunked", "plain"):
            try:
                s = build_plan(
                    with_settings(cfg, frugal | policy | {LOSS: loss}), world_size, machine=machine
                )
            except ConfigError:
                continue
            totals.append(fit(s, moe_imbalance=moe_imbalance).total)
    return min(totals, default=None)


def bounds(
    cfg: JobConfig,
    plan: RunPlan,
    world_size: int,
    limit: float,
    *,
    keep_global: bool,
    machine: bool,
    moe_imbalance: float,
) -> list[tuple[float, dict[str, int], dict[str, Any]]]:
    """(a lower bound of its cost, the shape, its config values) of every shape of `world_size` GPUs but
    `plan`'s whose least memory (`least_memory_floor`) may fit `limit` bytes per GPU, the cheapest bound
    first. The bound is what the mesh alone adds to the step (`plan_cost`'s `mesh_s` with nothing
    recomputed): the levers only add to it."""
    current = {d: getattr(plan, d) for d in DEGREES} if plan.world_size == world_size else None
    out = []
    for shape in shapes(world_size):
        if shape == current and plan.dp_replicate == 1:
            continue
        values = settings(cfg, plan, shape, keep_global=keep_global)
        if values is None:
            continue
        frugal = with_settings(cfg, values | {AC + k: v for k, v in AUTO_AC_KEYS.items()})
        floor = least_memory_floor(frugal, world_size, machine=machine, moe_imbalance=moe_imbalance)
        if floor is None or (cfg.plan.offload == "none" and floor > limit):
            continue
        lean = {AC + "mode": "none", RESHARD: "never", KEEP: 0, LOSS: "plain"}
        try:
            s = build_plan(with_settings(frugal, lean), world_size, machine=machine)
        except ConfigError:
            continue
        out.append((step_cost(s).mesh_s, shape, values))
    return sorted(out, key=lambda b: b[0])


@dataclass
class Proposal:
    """The fastest mesh of the GPUs that fits."""

    shape: dict[str, int]
    settings: dict[str, Any]  # the config values to write (degrees, and the batch that keeps the global one)
    found: Candidate  # its levers' cheapest plan that fits

    def why(self, world_size: int) -> str:
        """What this mesh needs, and what it and its levers add to the step by the cost model."""
        cost = self.found.cost
        mesh = cost.mesh_s / cost.compute_s if cost.compute_s else 0.0
        return (
            f"{describe(self.shape)}: {self.found.gib:.1f} GiB, the fastest mesh of {world_size} GPUs that "
            f"fits by the cost model (the mesh adds {100 * mesh:.0f}% to the step, the levers "
            f"{100 * (cost.relative - mesh):.0f}%)"
        )
