"""The nearest plan that fits: the one place that decides it, for the run's verdict before the build
(`memory_check.check_memory`: the nearest, and the fastest mesh where the levers cannot fit) and for
`titanrush estimate`'s report of what would fit (one of each kind).

A plan that does not fit `limit` bytes per GPU (the GPU's memory less `plan.margin`) is answered with the
plans one change away that do, each with every lever left to the planner (the cheapest that fits), in
this order, the nearest first:

1. `levers`: checkpointing, reshard and the loss, which keep the update;
2. `batch`: the largest smaller local batch with the global batch kept (gradient accumulation);
3. `mesh`: where the levers cannot fit at this mesh, the fastest tensor / pipeline / context parallel
   degrees of the same GPUs that fit (`mesh`), the global batch kept;
4. `offload`: activation offload, then FSDP's CPU offload, beyond what `plan.offload` allows;
5. `bf16`: an fp32 run in bf16;
6. `gpus`: 2, 4 or 8 times the GPUs, data parallel, else the fastest mesh of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titanrush.config import ConfigError, JobConfig
from titanrush.run import autoplan, mesh
from titanrush.run.autoplan import AC, LOSS, RESHARD, Candidate, with_settings
from titanrush.run.memory_fit import GIB
from titanrush.run.memory_moe import DEFAULT_IMBALANCE
from titanrush.run.plan import RunPlan, describe_mesh
from titanrush.run.validate import AUTO_AC_KEYS

KINDS = ("levers", "batch", "mesh", "offload", "bf16", "gpus")
MORE_GPUS = (2, 4, 8)  # the nearest plan may take this many times the GPUs
OFFLOADS = ("none", "activations", "all")


@dataclass
class Fix:
    """A plan that fits, one change away: the change's kind, its config values, its levers' plan."""

    kind: str  # one of KINDS
    settings: dict[str, Any]  # the config values the change sets (the levers' are in `found`)
    found: Candidate  # the cheapest plan of the changed config that fits: its levers, memory and cost
    ngpu: int  # the GPUs it runs on
    note: str = ""  # why (a mesh), or what else changes (the global batch with more GPUs)

    @property
    def gib(self) -> float:
        return self.found.gib

    def flags(self, cfg: JobConfig, world_size: int, gpus: str = "NGPU={}") -> str:
        """What to add to `cfg`'s command: `gpus` (the GPU count's spelling, `NGPU={}` or `--ngpu {}`)
        where the GPUs change, the change's values (those `cfg` does not have already), then the levers `cfg`
        does not leave to the planner."""
        more = [gpus.format(self.ngpu)] if self.ngpu != world_size else []
        own = [
            f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
            for k, v in self.settings.items()
            if _get(cfg, k) != v
        ]
        return " ".join([*more, *own, self.found.flags(cfg)]).strip()

    def text(self, cfg: JobConfig, world_size: int, gpus: str = "NGPU={}") -> str:
        """The flags, then the note in parentheses."""
        flags = self.flags(cfg, world_size, gpus)
        return f"{flags} ({self.note})" if self.note else flags


def _get(cfg: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def search(
    cfg: JobConfig, world_size: int, limit: float, offload: str, *, machine: bool, moe_imbalance: float
) -> tuple[Candidate | None, float | None]:
    """(the cheapest plan of `cfg` with every lever left to the planner that fits `limit` bytes, or None;
    the least memory of its plans in bytes, or None where the config is refused)."""
    levers = {AC + "mode": "auto", RESHARD: "auto", LOSS: "auto", "plan.offload": offload}
    auto = with_settings(cfg, levers | {AC + k: v for k, v in AUTO_AC_KEYS.items()})
    if offload == "none":  # (a lower bound first: most meshes and batches of a large model fit nowhere)
        floor = mesh.least_memory_floor(auto, world_size, machine=machine, moe_imbalance=moe_imbalance)
        if floor is None or floor > limit:
            return None, floor
    try:
        plain, extra = autoplan.candidates(
            auto, world_size, offload=offload, machine=machine, moe_imbalance=moe_imbalance
        )
    except ConfigError:  # (a batch, mesh or GPU count this config refuses)
        return None, None
    fitting = [c for c in plain if c.total <= limit] or [c for c in extra if c.total <= limit]
    return (fitting[0] if fitting else None), min(c.total for c in plain + extra)


def best_mesh(
    cfg: JobConfig,
    plan: RunPlan,
    world_size: int,
    limit: float,
    *,
    keep_global: bool,
    machine: bool,
    moe_imbalance: float,
) -> mesh.Proposal | None:
    """The fastest mesh of `world_size` GPUs (other than `plan`'s) on which `cfg` fits `limit` bytes per
    GPU, its levers left to the planner; `keep_global`: the global batch of `plan` kept, else the local
    batch (the global batch follows the data-parallel degree, or the config's).

    The shapes are weighed in the order of what their mesh alone adds to the step (a lower bound of their
    cost: `mesh.bounds`), and the search stops where the next one cannot beat the best found."""
    bounds = mesh.bounds(
        cfg, plan, world_size, limit, keep_global=keep_global, machine=machine, moe_imbalance=moe_imbalance
    )
    best: tuple[float, dict[str, int], dict[str, Any], Candidate] | None = None
    for bound, shape, values in bounds:
        if best is not None and bound >= best[0]:
            break
        found, _ = search(
            with_settings(cfg, values),
            world_size,
            limit,
            cfg.plan.offload,
            machine=machine,
            moe_imbalance=moe_imbalance,
        )
        if found is not None and (best is None or found.cost.extra_s < best[0]):
            best = (found.cost.extra_s, shape, values, found)
    return None if best is None else mesh.Proposal(best[1], best[2], best[3])


def fixes(
    cfg: JobConfig,
    plan: RunPlan,
    limit: float,
    *,
    machine: bool = True,
    moe_imbalance: float = DEFAULT_IMBALANCE,
    every: bool = False,
) -> list[Fix]:
    """The plans nearest to `cfg`'s (whose plan on its GPUs is `plan`) that fit `limit` bytes per GPU,
    nearest first (the module docstring's order).

    Args:
        cfg: The config as the user gave it (levers `auto` or not).
        plan: Its plan (any of its levers' values: the batch, the mesh and the GPUs are read).
        limit: Bytes per GPU a plan must fit in.
        machine: Check what this machine must provide (False: plan for another machine).
        moe_imbalance: The busiest expert-parallel rank's load (`memory_moe`).
        every: One fix of each kind that has one (the estimator's list); else the nearest, and the mesh
            beside it where the levers cannot fit at this mesh (the run's verdict).
    """
    world, allowed = plan.world_size, cfg.plan.offload
    out: list[Fix] = []

    def best(c: JobConfig, offload: str = allowed, n: int = world) -> Candidate | None:
        return search(c, n, limit, offload, machine=machine, moe_imbalance=moe_imbalance)[0]

    levers, least = search(cfg, world, limit, allowed, machine=machine, moe_imbalance=moe_imbalance)
    if levers is not None:
        out.append(Fix("levers", {}, levers, world))
        if not every:
            return out
    global_batch = plan.local_batch * plan.dp * plan.accum
    for k in sorted(mesh.divisors(plan.local_batch * plan.accum), reverse=True):
        smaller = {"training.local_batch_size": k, "training.global_batch_size": global_batch}
        if k < plan.local_batch and (found := best(with_settings(cfg, smaller))):
            out.append(Fix("batch", smaller, found, world))
            break
    if levers is None and world > 1:
        p = best_mesh(cfg, plan, world, limit, keep_global=True, machine=machine, moe_imbalance=moe_imbalance)
        if p is not None:
            at = f"at {describe_mesh(plan)} every plan needs {least / GIB:.1f} GiB or more; " if least else ""
            out.append(Fix("mesh", p.settings, p.found, world, at + p.why(world)))
    if out and not every:
        return out
    for offload in OFFLOADS[OFFLOADS.index(allowed) + 1 :]:
        if (found := best(cfg, offload)) and found.offloads:
            out.append(Fix("offload", {"plan.offload": offload}, found, world))
            break
    if cfg.training.precision == "fp32" and (
        found := best(with_settings(cfg, {"training.precision": "bf16"}))
    ):
        out.append(Fix("bf16", {"training.precision": "bf16"}, found, world))
    if out and not every:
        return out
    if more := _more_gpus(cfg, plan, limit, machine=machine, moe_imbalance=moe_imbalance):
        out.append(more)
    return out


def _more_gpus(
    cfg: JobConfig, plan: RunPlan, limit: float, *, machine: bool, moe_imbalance: float
) -> Fix | None:
    """The fewest of 2, 4 or 8 times the GPUs that fit: data parallel (FSDP over the GPUs the other degrees
    leave), else the fastest mesh of them."""
    world, shard = plan.world_size, cfg.parallelism.dp_shard
    grows = "the global batch grows with the GPUs" if cfg.training.global_batch_size == -1 else ""
    for times in MORE_GPUS:
        n = world * times
        wider = {"parallelism.dp_shard": shard * times} if shard != -1 else {}
        found, _ = search(
            with_settings(cfg, wider),
            n,
            limit,
            cfg.plan.offload,
            machine=machine,
            moe_imbalance=moe_imbalance,
        )
        if found is not None:
            return Fix("gpus", wider, found, n, grows)
        p = best_mesh(cfg, plan, n, limit, keep_global=False, machine=machine, moe_imbalance=moe_imbalance)
        if p is not None:
            why = f"data parallel alone does not fit them; {p.why(n)}"
            return Fix("gpus", p.settings, p.found, n, "; ".join(w for w in (why, grows) if w))
    return None
