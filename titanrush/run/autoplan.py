"""The fastest plan that fits: the levers a config leaves to the planner ("auto"), chosen before anything is
built, and the memory check of the plan a run is about to build.

The levers change how a step is computed, never what it computes: activation checkpointing
(`activation_checkpoint.mode` and its policy keys), FSDP's reshard after forward (ZeRO-2 or ZeRO-3) and the
chunked loss; where `plan.offload` allows, activation offload and FSDP's CPU offload, only when nothing
fits without them. Each candidate is the run's plan with those per-feature plans replaced; the analytic
memory model (`memory_fit`) says whether it fits the GPU with `plan.margin` to spare, and the cost model
(`plan_cost`) ranks those that fit. The chosen values are written into the config (the run folder's
config.toml holds them: a rerun is the same run); an explicit value is never changed.

`resolve` makes the choice; `memory_check.check_memory` is the verdict before the build (a plan that does
not fit stops with the estimate and the nearest plan that fits: `nearest.fixes`); `memory_check.plan_run`
is both, for the trainer.
docs/auto_plan.md is the user's manual.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from titanrush.config import ConfigError, JobConfig
from titanrush.run import validate
from titanrush.run.memory_fit import GIB, fit, unmodelled
from titanrush.run.memory_moe import DEFAULT_IMBALANCE
from titanrush.run.plan import RunPlan, build_plan
from titanrush.run.plan_cost import Cost, step_cost

AC = "activation_checkpoint."
RESHARD = "parallelism.fsdp_reshard_after_forward"
KEEP = "parallelism.fsdp_keep_gathered_last"
CPU_OFFLOAD = "parallelism.fsdp_cpu_offload"
LOSS = "training.loss"
AC_POLICY_KEYS = ("mode", "selective", "op_matmuls", "op_all_last")  # what mode = auto decides
EVERY_NTH = (2, 4)  # selective N: every N-th block recomputed in full
RUNNERS_UP = 4  # rows of the table besides the chosen plan


@dataclass
class Candidate:
    """One plan the planner weighs: the config values it sets, its plan, memory and cost."""

    settings: dict[str, Any]  # config key -> value, e.g. {"activation_checkpoint.mode": "full"}
    plan: RunPlan
    total: int  # bytes per GPU: peak allocated + allocator slack + CUDA context (`memory_fit`)
    cost: Cost

    @property
    def gib(self) -> float:
        return self.total / GIB

    @property
    def offloads(self) -> bool:
        return self.plan.ac.offload_first > 0 or self.plan.fsdp_plan.cpu_offload

    def label(self) -> str:
        """The plan's levers in words: `AC op alternate, last 8 all; ZeRO-2 (never); chunked loss`."""
        s, parts = self.plan, []
        if any(k.startswith(AC) for k in self.settings):
            parts.append(ac_words(s))
        if RESHARD in self.settings:
            reshard = s.fsdp_plan.reshard
            parts.append(f"ZeRO-{2 if reshard == 'never' else 3} ({reshard})" if s.fsdp else "no FSDP")
        if CPU_OFFLOAD in self.settings:
            parts.append("FSDP CPU offload")
        if LOSS in self.settings:
            parts.append(f"{s.loss} loss")
        return "; ".join(parts)

    def flags(self, cfg: JobConfig) -> str:
        """The settings as command-line overrides: those that differ from `cfg`'s, but for the levers `cfg`
        leaves to the planner (it picks them again)."""
        auto = validate.auto_levers(cfg)
        owned = {k for k in self.settings if k.startswith(AC) and k[len(AC) :] in AC_POLICY_KEYS}
        owned = (owned if AC + "mode" in auto else set()) | ({RESHARD, KEEP} if RESHARD in auto else set())
        owned |= {LOSS} if LOSS in auto else set()
        return " ".join(
            f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
            for k, v in self.settings.items()
            if k not in owned and _get(cfg, k) != v
        )


def ac_words(s: RunPlan) -> str:
    """A plan's activation checkpointing (and activation offload) in a few words."""
    ac = s.ac
    if ac.mode == "selective" and ac.selective == "op":
        words = {"all": "AC op all", "all_but_w3": "AC op all but w3", "alternate": "AC op alternate"}
        text = words[ac.op_matmuls] + (f", last {ac.op_all_last} all" if ac.op_all_last else "")
    elif ac.mode == "selective":
        n = int(ac.selective)
        nth = {1: "st", 2: "nd", 3: "rd"}.get(n % 10 if n % 100 not in (11, 12, 13) else 0, "th")
        text = f"AC every {n}{nth} block"
    else:
        text = f"AC {ac.mode}"
    if ac.offload_first:
        every = f"every {ac.offload_every} of " if ac.offload_every > 1 else ""
        text += f", offload {every}first {ac.offload_first}"
    return text


@dataclass
class Choice:
    """What the planner chose (or, without auto levers, the config's own plan) and what it weighed."""

    given: JobConfig  # as the user gave it
    cfg: JobConfig  # resolved: no "auto" left
    plan: RunPlan
    levers: list[str]  # the config's auto keys
    gpu_mem_gib: float | None  # None: no GPU memory to fit
    gpu_note: str
    margin: float
    ranked: list[Candidate] = field(default_factory=list)  # every candidate weighed, cheapest first
    chosen: Candidate | None = None
    note: str = ""

    @property
    def limit(self) -> float | None:
        """Bytes an auto plan must fit in."""
        return None if self.gpu_mem_gib is None else self.gpu_mem_gib * (1 - self.margin) * GIB

    def report(self) -> list[str]:
        """The table: the chosen plan first, then the runners-up, each with its estimate and cost."""
        if self.chosen is None:
            return []
        if self.limit is None:
            head = f"auto plan ({', '.join(self.levers)}): {self.gpu_note}"
        else:
            head = (
                f"auto plan ({', '.join(self.levers)}) for {self.plan.world_size} GPU(s) of {self.gpu_note}, "
                f"{self.margin:.0%} kept free: a plan must fit {self.limit / GIB:.1f} GiB"
            )
        others = [c for c in self.ranked if c is not self.chosen]
        if self.limit is not None:
            fitting = [c for c in others if c.total <= self.limit][: RUNNERS_UP - 1]
            cost = self.chosen.cost.extra_s
            cheaper = [c for c in others if c.total > self.limit and c.cost.extra_s < cost]
            others = fitting + cheaper[: RUNNERS_UP - len(fitting)]
        rows = [self.chosen, *others[:RUNNERS_UP]]
        width = max(len(c.label()) for c in rows)
        lines = [head, f"    {'plan':<{width}} {'GiB':>7} {'step time':>10}"]
        for c in rows:
            mark = "*" if c is self.chosen else " "
            fits = "" if self.limit is None or c.total <= self.limit else "  does not fit"
            lines.append(f"  {mark} {c.label():<{width}} {c.gib:7.1f} {100 * c.cost.relative:+9.1f}%{fits}")
        lines.append(
            "resolved: " + ", ".join(f"{k} = {toml_value(v)}" for k, v in self.chosen.settings.items())
        )
        if self.note:
            lines.append(f"note: {self.note}")
        return lines


def _get(cfg: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def toml_value(value: Any) -> str:
    """A config value as TOML writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else str(value)


def with_settings(cfg: JobConfig, settings: dict[str, Any]) -> JobConfig:
    """A copy of `cfg` with these config values."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def _ac_options(base: RunPlan, *, offloading: bool) -> list[dict[str, Any]]:
    """The checkpointing policies to weigh: none, selective op (every matmul kept, all but w3, alternate
    with the last N blocks keeping all; a MoE block under EP or TP by parts, which the estimator and the
    cost model both follow), every N-th block, full. Beside offload, fewer."""
    n = base.args.n_layers
    step = max(n // 8, 1)  # alternate, with the last k blocks keeping every matmul output
    op = [("all", 0), ("all_but_w3", 0)] + [("alternate", k) for k in range(0, n, step)]
    if offloading:
        op = op[:1]
    out = [{"mode": "none", "selective": "op", "op_matmuls": "all", "op_all_last": 0}]
    out += [{"mode": "selective", "selective": "op", "op_matmuls": m, "op_all_last": k} for m, k in op]
    if not offloading:
        out += [
            {"mode": "selective", "selective": str(k), "op_matmuls": "all", "op_all_last": 0}
            for k in EVERY_NTH
            if k < n
        ]
    out.append({"mode": "full", "selective": "op", "op_matmuls": "all", "op_all_last": 0})
    return [{AC + k: v for k, v in o.items()} for o in out]


def _variant(base: RunPlan, settings: dict[str, Any]) -> RunPlan:
    """`base` with the per-feature plans these settings change (as `build_plan` would make them)."""
    ac, fsdp = base.ac, base.fsdp_plan
    changes = {k.split(".")[1]: v for k, v in settings.items() if k.startswith(AC)}
    if changes:
        ac = dataclasses.replace(ac, **changes)
    if RESHARD in settings:
        reshard = settings[RESHARD]
        reshard = "never" if base.pp > 1 and reshard == "default" else reshard  # (as build_plan)
        keep = settings.get(KEEP, fsdp.keep_gathered_last)
        fsdp = dataclasses.replace(fsdp, reshard=reshard, keep_gathered_last=keep)
    if CPU_OFFLOAD in settings:
        fsdp = dataclasses.replace(fsdp, cpu_offload=settings[CPU_OFFLOAD])
    return dataclasses.replace(base, ac=ac, fsdp_plan=fsdp)


def _options(
    cfg: JobConfig, base: RunPlan, levers: list[str], offload: str, machine: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(settings without offload, settings with offload) of every candidate over one base plan."""
    n = base.args.n_layers
    reshard: list[dict[str, Any]] = [{}]
    if RESHARD in levers:
        keep = cfg.parallelism.fsdp_keep_gathered_last
        zero3 = "always" if base.pp > 1 else "default"
        never = {RESHARD: "never"} | ({KEEP: 0} if keep else {})
        reshard = [never, {RESHARD: zero3}] if base.fsdp else [{RESHARD: "default"}]
    acs = _ac_options(base, offloading=False) if AC + "mode" in levers else [{}]
    plain = [a | r for a in acs for r in reshard]
    extra: list[dict[str, Any]] = []
    cuda_ok = not machine or torch.cuda.is_available()
    if offload != "none" and cfg.activation_checkpoint.offload_first == 0 and cuda_ok:
        acs = _ac_options(base, offloading=True) if AC + "mode" in levers else [{}]
        for first, every in ((n, 1), (n, 2), (max(n // 2, 1), 1)):
            spread = {AC + "offload_first": first, AC + "offload_every": every}
            extra += [a | r | spread for a in acs for r in reshard]
    if offload == "all" and base.fsdp and not cfg.parallelism.fsdp_cpu_offload:
        extra += [s | {CPU_OFFLOAD: True} for s in plain + extra]
    return plain, extra


def stand_in(cfg: JobConfig) -> JobConfig:
    """`cfg` with its auto levers set to values every config accepts (no checkpointing, the default
    reshard, the plain loss): for what the levers do not change (the mesh, the model, the batch)."""
    values = {AC + "mode": "none", RESHARD: "default", LOSS: "plain"}
    return with_settings(cfg, {k: values[k] for k in validate.auto_levers(cfg)})


def _bases(
    cfg: JobConfig, world_size: int, levers: list[str], machine: bool
) -> list[tuple[dict[str, Any], RunPlan]]:
    """The plans the candidates vary: the config with stand-ins for its auto levers, one per loss."""
    losses = ["plain", "chunked"] if LOSS in levers else [cfg.training.loss]
    out = []
    for loss in losses:
        chosen = {LOSS: loss} if LOSS in levers else {}
        try:
            plan = build_plan(with_settings(stand_in(cfg), chosen), world_size, machine=machine)
        except ConfigError:
            if loss == losses[0]:  # (the chunked loss may be refused: tp or pp > 1)
                raise
            continue
        out.append((chosen, plan))
    return out


def candidates(
    cfg: JobConfig, world_size: int, *, offload: str, machine: bool, moe_imbalance: float = DEFAULT_IMBALANCE
) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates without offload, those with), each with its memory and cost, cheapest first."""
    levers = validate.auto_levers(cfg)
    plain: list[Candidate] = []
    extra: list[Candidate] = []
    for loss_setting, base in _bases(cfg, world_size, levers, machine):
        if why := unmodelled(base):
            raise ConfigError(f"{', '.join(levers)} = 'auto' needs the memory estimate: {why}")
        without, with_offload = _options(cfg, base, levers, offload, machine)
        for out, options in ((plain, without), (extra, with_offload)):
            for settings in options:
                s = _variant(base, settings)
                total = fit(s, moe_imbalance=moe_imbalance).total
                out.append(Candidate(settings | loss_setting, s, total, step_cost(s)))
    key = lambda c: (round(c.cost.relative, 4), c.total)  # noqa: E731  (ties go to less memory)
    return sorted(plain, key=key), sorted(extra, key=key)


def resolve(
    cfg: JobConfig,
    world_size: int,
    gpu_mem_gib: float | None,
    gpu_note: str = "",
    *,
    machine: bool = True,
    moe_imbalance: float = DEFAULT_IMBALANCE,
) -> Choice:
    """Choose the config's auto levers: the cheapest candidate that fits `gpu_mem_gib` x (1 - plan.margin);
    without a GPU memory (None) the cheapest; where none fits, the one that needs least memory.

    Returns:
        The choice, its config resolved and its plan built (`build_plan`); a config without auto levers
        comes back as it is, with its plan.

    Raises:
        ConfigError: the config is invalid (as `build_plan` says), or its auto levers need an estimate
            the analytic model cannot make.
    """
    levers = validate.auto_levers(cfg)
    margin = cfg.plan.margin
    if not levers:
        plan = build_plan(cfg, world_size, machine=machine)
        return Choice(cfg, cfg, plan, [], gpu_mem_gib, gpu_note, margin)
    plain, extra = candidates(
        cfg, world_size, offload=cfg.plan.offload, machine=machine, moe_imbalance=moe_imbalance
    )
    choice = Choice(cfg, cfg, plain[0].plan, levers, gpu_mem_gib, gpu_note, margin, ranked=plain)
    limit = choice.limit
    if limit is None:
        choice.chosen = plain[0]
        choice.note = "nothing to fit: the plan that computes least"
    else:
        fitting = [c for c in plain if c.total <= limit]
        if not fitting and (fitting := [c for c in extra if c.total <= limit]):
            choice.ranked = extra
            choice.note = "no plan fits without offload (plan.offload allows it)"
        choice.chosen = fitting[0] if fitting else min(plain + extra, key=lambda c: c.total)
        if not fitting:
            choice.note = f"no plan fits {limit / GIB:.1f} GiB: the one that needs least memory"
    choice.cfg = with_settings(cfg, choice.chosen.settings)
    choice.plan = build_plan(choice.cfg, world_size, machine=machine)
    assert choice.plan == choice.chosen.plan, (choice.plan, choice.chosen.plan)  # (_variant as build_plan)
    return choice
