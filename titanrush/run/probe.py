"""`plan.probe K`: the top K plans of the auto levers measured for a few steps each on the run's own GPUs,
the fastest kept, so that a mistake of the cost model costs seconds, not the run.

The candidates are the planner's chosen plan and the next ones that fit, in its order (`shortlist`). Each
trains `plan.probe_steps` steps after one warm-up step (compile, the allocator's first segments), in a
folder of its own beside the run's (`<job.dump_folder>/.<job.name>.probe/`, removed afterwards), without
checkpoints, validation, profiling or TensorBoard; its tokens/s per GPU is the trainer's own figure
(metrics.jsonl), averaged over the measured steps. The fastest is written into the run's config (its
config.toml holds it), and the run itself then starts from step 0 with the same seed: nothing of a probe
reaches the run's weights, data order, checkpoints or metrics.

Every rank runs the same candidates in the same order (every rank resolves the same plan from the same
config); rank 0's measurements decide, and its decision reaches every rank (`distributed.from_rank0`). The
time budget (`plan.probe_seconds`) is checked by rank 0 before each candidate after the first. A
candidate that runs out of memory is recorded so and left out (a failure on some ranks only stops the
job, as in a run). The measuring itself (building a trainer) is the entry point's: `run` takes it as a
function, so that this module stays below the trainer.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from titanrush.config import JobConfig
from titanrush.distributed import from_rank0
from titanrush.run.autoplan import Candidate, Choice, toml_value, with_settings
from titanrush.run.plan import RunPlan, build_plan

logger = logging.getLogger("titanrush")
WARMUP_STEPS = 1  # left out of the mean: compile, the allocator's first segments


@dataclass
class Measured:
    """One probed plan: its tokens/s per GPU (None: not measured) and what became of it."""

    candidate: Candidate
    tps: float | None = None
    status: str = "not measured (plan.probe_seconds spent)"


def shortlist(choice: Choice, k: int) -> list[Candidate]:
    """The chosen plan and the next ones that fit, in the planner's order: `k` at most."""
    if choice.chosen is None:
        return []
    limit = choice.limit
    fitting = [c for c in choice.ranked if limit is None or c.total <= limit]
    rest = [c for c in fitting if c is not choice.chosen]
    return [choice.chosen, *rest][:k]


def folder(cfg: JobConfig) -> Path:
    """Where the probes run: beside the run's folder, never in it."""
    return Path(cfg.job.dump_folder) / f".{cfg.job.name}.probe"


def probe_config(choice: Choice, candidate: Candidate, index: int) -> JobConfig:
    """The run's config with the candidate's levers, trimmed to a measurement: warm-up and measured steps
    only, a metrics row per step, no checkpoint (none loaded or saved), validation, profiling or
    TensorBoard, in the probe's folder."""
    cfg = choice.given
    steps = WARMUP_STEPS + cfg.plan.probe_steps
    return with_settings(
        cfg,
        candidate.settings
        | {
            "training.steps": steps,
            "metrics.log_freq": 1,
            "metrics.tensorboard": False,
            "metrics.all_ranks": False,
            "checkpoint.enable": False,
            "checkpoint.load_path": "",
            "checkpoint.load_model_only": False,
            "validation.freq": 0,
            "profiling.enable": False,
            "job.dump_folder": str(folder(cfg)),
            "job.name": str(index),
            "job.overwrite": True,
        },
    )


def tokens_per_s(run_dir: Path) -> float:
    """The mean tokens/s per GPU of a probe's steps after the warm-up (rank 0's metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    tps = [r["tps"] for r in rows if r.get("step", 0) > WARMUP_STEPS and r.get("tps") is not None]
    return statistics.fmean(tps) if tps else 0.0


def run(
    choice: Choice,
    measure: Callable[[JobConfig, RunPlan], tuple[float | None, str]],
    *,
    rank: int,
) -> tuple[Choice, list[Measured]]:
    """Probe the shortlist of `choice` (`plan.probe` of its config) and keep the fastest.

    Args:
        choice: The planner's choice (`memory_check.plan_run`).
        measure: Trains one probe config with its plan on every rank; returns (rank 0's tokens/s per GPU,
            "ok"), or (None, why) where it failed (out of memory).
        rank: This process's rank (rank 0 decides).

    Returns:
        The choice with the fastest candidate (its config and plan), and every candidate's measurement;
        the choice as it was where fewer than two candidates fit.
    """
    given = choice.given
    candidates = shortlist(choice, given.plan.probe)
    if len(candidates) < 2:
        return choice, []
    measured = [Measured(c) for c in candidates]
    start = time.monotonic()
    if rank == 0:  # (a probe killed earlier may have left its folder)
        shutil.rmtree(folder(given), ignore_errors=True)
    try:
        for i, m in enumerate(measured):
            if i and from_rank0(time.monotonic() - start > given.plan.probe_seconds):
                break
            cfg = probe_config(choice, m.candidate, i)
            logger.info(f"probe {i + 1}/{len(measured)}: {m.candidate.label()}")
            m.tps, m.status = measure(cfg, build_plan(cfg, choice.plan.world_size))
    finally:
        if rank == 0:
            shutil.rmtree(folder(given), ignore_errors=True)
    ok = [i for i, m in enumerate(measured) if m.tps is not None]
    best = max(ok, key=lambda i: measured[i].tps or 0.0) if ok else 0
    best = from_rank0(best)
    return chosen(choice, measured[best].candidate), measured


def chosen(choice: Choice, candidate: Candidate) -> Choice:
    """`choice` with `candidate` chosen: its config resolved with the candidate's values, its plan."""
    cfg = with_settings(choice.given, candidate.settings)
    plan = build_plan(cfg, choice.plan.world_size)
    assert plan == candidate.plan, (plan, candidate.plan)
    return Choice(
        choice.given,
        cfg,
        plan,
        choice.levers,
        choice.gpu_mem_gib,
        choice.gpu_note,
        choice.margin,
        ranked=choice.ranked,
        chosen=candidate,
        note=choice.note,
    )


def report(measured: list[Measured], kept: Candidate, steps: int) -> list[str]:
    """The probe's table: each plan with its estimate and its measured tokens/s, the one kept marked."""
    width = max(len(m.candidate.label()) for m in measured)
    lines = [
        f"probe (plan.probe {len(measured)}): {steps} step{'s' if steps > 1 else ''} each after "
        f"{WARMUP_STEPS} warm-up step, the fastest kept",
        f"    {'plan':<{width}} {'GiB':>7} {'est. step':>10} {'tokens/s/GPU':>13}",
    ]
    for m in measured:
        mark = "*" if m.candidate is kept else " "
        rate = f"{m.tps:13,.0f}" if m.tps is not None else f"{'':13}  {m.status}"
        c = m.candidate
        lines.append(f"  {mark} {c.label():<{width}} {c.gib:7.1f} {100 * c.cost.relative:+9.1f}% {rate}")
    lines.append("resolved: " + ", ".join(f"{k} = {toml_value(v)}" for k, v in kept.settings.items()))
    return lines
