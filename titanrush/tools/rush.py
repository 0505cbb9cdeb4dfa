"""`titanrush rush`: measure what each optimization buys on this machine, reproducibly.

  titanrush rush ladder [--config FILE] [--steps S] [--warmup W] [--output DIR] [--dry-run]
                        [--skip-unfit] [--gpu-mem GiB] [overrides]
  titanrush rush dist --ngpu N [--config FILE] [--steps S] [--output DIR] [--dry-run] [--skip-unfit]
                      [--gpu-mem GiB] [overrides]
  titanrush rush moe [--config FILE] [--steps S] [--warmup W] [--output DIR] [--dry-run] [overrides]

`ladder` climbs the single-GPU rungs, each adding to the last one that ran: fp32 with unfused attention
and for-loop AdamW, bf16, fused AdamW, fused attention (SDPA; the flash-attn package as a side rung),
torch.compile, the batch size doubled until it no longer fits, activation checkpointing (selective,
then full) at the batch (or 2x sequence) that did not fit, and float8. `dist` compares DDP, FSDP
ZeRO-2/ZeRO-3 and HSDP at 1, 2, 4 ... N GPUs, then the 8B with the sweep's best mesh. Every run is its
own child process; the output folder gets results.jsonl, report.md, PNG charts and TensorBoard events
(tb/), and one that holds an earlier rush's results is refused. Overrides (`--section.key value`) apply
to every run; the rungs' own settings win over them.
Base: the 1B flavor on synthetic data, seq 2048, batch 1 (dist: batch 4, bf16, fused AdamW, SDPA,
compile on GPU; moe: the same on llama4_1Bx8E and the embedded corpus); what a --config file sets wins
over the base.

Every run gets the memory estimator's verdict against one GPU memory (`titanrush estimate`'s rule:
--gpu-mem, else the GPU here, else 80 GiB, said so); --skip-unfit skips the runs it says will not fit. A
dry run prints each run's command and verdict; the ladder's batch doubling then stops where the estimator
says the batch no longer fits, and the AC rungs take that batch. Exit status: 0 when the rush ran
(whatever its rungs did), 2 on bad input, 128 + N when signal N stopped it (passed on to the run in
progress first: titanrush/tools/tool_signals.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.run import validate
from titanrush.tools import rush_moe
from titanrush.tools import rush_report as report
from titanrush.tools import rush_runner as runner
from titanrush.tools.estimate import gpu_memory
from titanrush.tools.rush_runner import (
    NEEDS_GPU,
    NOT_AVAILABLE,
    OK,
    OOM,
    PLANNED,
    SKIPPED,
    Ctx,
    Rung,
    base_settings,
    fit_text,
    to_args,
)
from titanrush.tools.tool_signals import stops_on_signals

LADDER_BASE = {
    "model.flavor": "1B",
    "data.dataset": "synthetic",
    "training.seq_len": "2048",
    "training.local_batch_size": "1",
}
DIST_BASE = {
    **LADDER_BASE,
    "training.local_batch_size": "4",
    "training.precision": "bf16",
    "optimizer.implementation": "fused",
    "model.attn_backend": "sdpa",
}
# lr 3e-4, as train_configs/llama4_1Bx8E.toml: at the schema's 3e-3 (the debug models' rate) the 1B
# MoE's routing collapsed onto one expert in a layer within 200 steps on an H200, balancing on.
MOE_BASE = {
    **DIST_BASE,
    "model.flavor": "llama4_1Bx8E",
    "data.dataset": "embedded",
    "optimizer.lr": "3e-4",
}
# The single-GPU rungs: (name, what it adds, group, settings). The `batch` entry expands to batch-2,
# batch-4 ...; the `ac` rungs get the batch (or sequence length) that did not fit.
LADDER = [
    (
        "fp32",
        "fp32, unfused attention (math), for-loop AdamW",
        "main",
        "training.precision=fp32 model.attn_backend=math optimizer.implementation=for-loop "
        "compile.enable=false activation_checkpoint.mode=none float8.enable=false",
    ),
    ("bf16", "bf16 mixed precision", "main", "training.precision=bf16"),
    ("fused-adamw", "fused AdamW", "main", "optimizer.implementation=fused"),
    ("sdpa", "fused attention (SDPA)", "main", "model.attn_backend=sdpa"),
    ("flash-attn", "flash-attn package attention (side rung)", "side", "model.attn_backend=flash"),
    ("compile", "torch.compile per block", "main", "compile.enable=true"),
    ("batch", "", "batch", ""),
    (
        "ac-selective",
        "selective (op) activation checkpointing",
        "ac",
        "activation_checkpoint.mode=selective activation_checkpoint.selective=op",
    ),
    ("ac-full", "full activation checkpointing", "ac", "activation_checkpoint.mode=full"),
    ("float8", "float8 linears (tensorwise)", "main", "float8.enable=true float8.recipe=tensorwise"),
]
# The data-parallel strategies at k GPUs: (name, strategy, settings; {k} and {half} = k // 2 filled in).
STRATEGIES = [
    ("ddp", "DDP", "parallelism.dp_replicate={k} parallelism.dp_shard=1"),
    (
        "zero2",
        "FSDP ZeRO-2",
        "parallelism.dp_replicate=1 parallelism.dp_shard={k} parallelism.fsdp_reshard_after_forward=never",
    ),
    (
        "zero3",
        "FSDP ZeRO-3",
        "parallelism.dp_replicate=1 parallelism.dp_shard={k} parallelism.fsdp_reshard_after_forward=always",
    ),
    ("hsdp", "HSDP", "parallelism.dp_replicate=2 parallelism.dp_shard={half}"),
]
BATCH, SEQ = "training.local_batch_size", "training.seq_len"


def record(ctx: Ctx, row: dict[str, Any]) -> None:
    """Keep a finished row; results.jsonl is rewritten after each, so a crash keeps what ran."""
    ctx.rows.append(row)
    if not ctx.dry_run:
        report.write_jsonl(ctx.out / "results.jsonl", ctx.rows, ctx.env)


# ----------------------------------------------------------------------------------------------
# The single-GPU ladder


def _unavailable(name: str, dev: dict[str, Any], cpu_compile: bool) -> tuple[str | None, str]:
    """(status, reason) when rung `name` cannot run on this device, else (None, "")."""
    gpu = bool(dev.get("cuda"))
    cap = tuple(dev.get("capability") or (0, 0))
    if name in ("sdpa", "flash-attn") and not gpu:
        return NEEDS_GPU, "the fused attention kernels (flash, cuDNN) are CUDA kernels"
    if name == "flash-attn" and not dev.get("flash_attn"):
        return NOT_AVAILABLE, "the flash-attn package is not installed (pip install flash-attn)"
    if name == "compile" and not gpu and not cpu_compile:
        return NEEDS_GPU, "compiling on CPU takes minutes: pass --cpu-compile to run it"
    if name == "float8" and not gpu:
        return NEEDS_GPU, "float8 matmuls need a GPU with compute capability >= 8.9"
    if name == "float8" and cap < (8, 9):
        return NOT_AVAILABLE, f"float8 matmuls need compute capability >= 8.9 (this GPU: {cap[0]}.{cap[1]})"
    if name == "float8" and not dev.get("torchao"):
        return NOT_AVAILABLE, "float8 needs torchao (pip install torchao)"
    return None, ""


def ladder_plan(
    dev: dict[str, Any], *, base_batch: int, max_batch: int, max_doublings: int, cpu_compile: bool
) -> list[Rung]:
    """The single-GPU rungs for this device; the batch rungs go up to the caps (they stop at the first
    that does not fit)."""
    kernels = [k for k, on in (("flash", dev.get("flash_sdp")), ("cuDNN", dev.get("cudnn_sdp"))) if on]
    rungs = []
    for name, adds, group, spec in LADDER:
        if group == "batch":
            batches = [
                base_batch * 2**i for i in range(1, max_doublings + 1) if base_batch * 2**i <= max_batch
            ]
            rungs += [Rung(f"batch-{b}", f"local batch {b}", {BATCH: str(b)}, group="batch") for b in batches]
            continue
        if name == "sdpa" and dev.get("cuda"):
            adds = f"fused attention (SDPA: {' / '.join(kernels) or 'no flash/cuDNN kernel here'})"
        status, reason = _unavailable(name, dev, cpu_compile)
        delta = dict(kv.split("=", 1) for kv in spec.split())
        rungs.append(Rung(name, adds, delta, group=group, status=status, reason=reason))
    return rungs


def run_ladder(ctx: Ctx, plan: list[Rung], base: dict[str, str], ac_target: str) -> list[str]:
    """Climb the ladder; returns notes for the report.

    Each rung's settings are those of the last rung that ran plus its own (an OOM rung, and the first
    rung whatever happened to it, still count); a rung that failed, or cannot run here, is left out
    of what follows. Side and AC rungs are measured but not built on, so float8 builds on the largest
    batch that fitted. Speedups are against the last rung that ran OK, and against the first. A dry run
    takes the estimator's verdict for the batch rungs' outcome: the doubling stops at the first batch it
    says will not fit.
    """
    chain, prev, first, target, notes = dict(base), None, None, None, []
    kept = cfgmod.load(ctx.config, to_args(chain)).training.local_batch_size
    for rung in plan:
        if rung.group == "batch" and target is not None:
            ctx.progress.shrink(1)
            continue
        settings = {**chain, **rung.delta}
        if rung.group == "ac" and ac_target == "seq":
            settings[SEQ] = str(2 * cfgmod.load(ctx.config, to_args(chain)).training.seq_len)
            rung.adds += f" at seq {settings[SEQ]}"
        elif rung.group == "ac":
            settings[BATCH] = target or str(2 * kept)
            rung.adds += f" at batch {settings[BATCH]}"
        row = execute_and_compare(ctx, rung, settings, prev, first)
        ok = row["status"] in (OK, PLANNED)
        predicted_oom = ctx.dry_run and (row.get("estimate") or {}).get("fits") is False
        if rung.group == "batch" and predicted_oom:
            ok = False
        # The first rung defines the baseline; an OOM main rung's change stays (the next may make it fit).
        if (
            rung is plan[0]
            or (rung.group in ("main", "batch") and ok)
            or (rung.group, row["status"]) == ("main", OOM)
        ):
            chain = settings
        if rung.group in ("main", "batch") and ok:
            prev, first = row, first or (row if row.get("tps") is not None else None)
            kept = int(settings.get(BATCH, kept))
        if rung.group == "batch" and not ok:
            target = settings[BATCH]
            why = f"estimate {fit_text(row['estimate'])}" if predicted_oom else row["status"]
            stops = "would stop" if ctx.dry_run else "stopped"
            notes.append(f"the batch doubling {stops} at {target} ({why}); batch {kept} is kept")
    if target is None:
        fitted = "the estimator says every batch tried fits" if ctx.dry_run else "every batch tried fitted"
        at = f"; AC at batch {2 * kept}" if ac_target == "batch" else ""
        notes.append(f"{fitted} (the doubling is capped){at}")
    return notes


def execute_and_compare(
    ctx: Ctx, rung: Rung, settings: dict[str, str], prev: dict | None, first: dict | None
) -> dict[str, Any]:
    """Run a ladder rung, add its speedups over `prev` and `first`, record it."""
    row = runner.execute(ctx, rung, settings, prev)
    row["speedup_prev"] = runner.speedup(row.get("tps"), prev.get("tps") if prev else None)
    own = row.get("tps") if rung.group in ("main", "batch") else None  # the first measured rung: 1.00x
    row["speedup_first"] = runner.speedup(row.get("tps"), first.get("tps") if first else own)
    record(ctx, row)
    return row


# ----------------------------------------------------------------------------------------------
# The distributed ladder


def read_sweep_best(path: str) -> dict[str, str]:
    """The overrides of the fastest OK run in a sweep results file (JSON lines or a JSON list).

    A row names its mesh as `overrides` (a dict, or a list of `--section.key value`) or `mesh` (a dict of
    parallelism keys), and its speed as `tps` or `tokens_per_s`.
    """
    text = Path(path).read_text()
    rows = (
        json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]
    )
    speed = lambda r: r.get("tps") or r.get("tokens_per_s") or 0.0
    ok = [r for r in rows if isinstance(r, dict) and r.get("status", OK) == OK and speed(r) > 0]
    if not ok:
        raise ValueError(f"{path}: no OK row with tps")
    best = max(ok, key=speed)
    over = best.get("overrides") or {}
    if isinstance(over, list):
        over = {
            f"{s}.{k}": str(v).lower() if isinstance(v, bool) else v
            for s, k, v in cfgmod.parse_overrides(over)
        }
    mesh = {k if "." in k else f"parallelism.{k}": v for k, v in (best.get("mesh") or {}).items()}
    if not over and not mesh:
        raise ValueError(f"{path}: the best row names no mesh (`overrides` or `mesh`)")
    return {str(k): str(v) for k, v in {**over, **mesh}.items()}


def _eight_b(dev: dict[str, Any], ngpu: int, sweep_mesh: dict[str, str] | None) -> Rung:
    """The 8B on N GPUs with FSDP and the sweep's best mesh (`read_sweep_best`), or why it cannot run."""
    adds = f"8B, FSDP on {ngpu} GPUs, the sweep's best mesh"
    rung = Rung(f"8b-fsdp-{ngpu}", adds, {"model.flavor": "8B"}, "8b", ngpu=ngpu, strategy="8B FSDP")
    if sweep_mesh is None:
        rung.status, rung.reason = (
            NOT_AVAILABLE,
            "pass --sweep-results FILE (from titanrush sweep) for the mesh",
        )
        return rung
    rung.delta.update(sweep_mesh)
    if not dev.get("cuda"):
        rung.status, rung.reason = NEEDS_GPU, "the 8B does not train on CPU"
    return rung


def dist_plan(dev: dict[str, Any], ngpu: int, sweep_mesh: dict[str, str] | None) -> list[Rung]:
    """The 1-GPU baseline, then DDP, ZeRO-2, ZeRO-3 and HSDP at 2, 4 ... N GPUs, then the 8B."""
    sizes = sorted({2**i for i in range(ngpu.bit_length()) if 2**i <= ngpu} | {ngpu})
    one = {"parallelism.dp_replicate": "1", "parallelism.dp_shard": "1"}
    rungs = [
        Rung("1gpu", "one GPU, no data-parallel wrapper: the baseline", one, "scaling", strategy="1 GPU")
    ]
    for k in sizes[1:]:
        for short, strategy, spec in STRATEGIES:
            delta = dict(kv.format(k=k, half=k // 2).split("=", 1) for kv in spec.split())
            reason = ""
            if short == "hsdp" and (k < 4 or k % 2):
                reason = (
                    f"HSDP needs an even count >= 4 GPUs (2 replicas x 2 shards); at {k} GPUs it is not HSDP"
                )
            elif dev.get("cuda") and k > (dev.get("count") or 0):
                reason = f"only {dev.get('count')} GPUs are visible"
            status = SKIPPED if reason else None
            rungs.append(
                Rung(f"{short}-{k}", f"{strategy} on {k} GPUs", delta, "scaling", status, reason, k, strategy)
            )
    return rungs + [_eight_b(dev, ngpu, sweep_mesh)]


def run_dist(ctx: Ctx, plan: list[Rung], base: dict[str, str]) -> list[str]:
    """Run every dist rung from the same base; efficiency = tokens/s per GPU / the 1-GPU baseline's."""
    baseline = None
    for rung in plan:
        settings = {**base, **rung.delta}
        row = runner.execute(ctx, rung, settings, baseline if rung.group == "scaling" else None)
        row["scaling"] = rung.group == "scaling"
        row["mesh"] = " x ".join(settings.get(f"parallelism.{k}", "-") for k in ("dp_replicate", "dp_shard"))
        # Only the 1B scaling rungs have a 1-GPU baseline; the 8B row is another model.
        scaling = rung.group == "scaling" and baseline is not None
        row["efficiency"] = runner.speedup(row.get("tps"), baseline.get("tps")) if scaling else None
        if rung.name == "1gpu" and row["status"] == OK:
            baseline, row["efficiency"] = row, 1.0
        record(ctx, row)
    return [
        "mesh = dp_replicate x dp_shard; efficiency = tokens/s per GPU / the 1-GPU baseline's (weak scaling: "
        "the same local batch at every size)"
    ]


# ----------------------------------------------------------------------------------------------
# Dense vs MoE


def run_moe(ctx: Ctx, plan: list[Rung], base: dict[str, str]) -> list[str]:
    """Run the dense twin, then the MoE from the same base; the MoE row gets its tokens/s ratio and loss
    difference to the dense (`rush_moe.compare`) and its routing balance (`rush_moe.routing`), each row
    its loss curve."""
    dense = None
    for rung in plan:
        row = runner.execute(ctx, rung, {**base, **rung.delta}, dense)
        if row["status"] == OK:
            metrics = runner.read_metrics(ctx.out / "runs" / rung.name / "metrics.jsonl")
            steps = [r for r in metrics if "loss" in r]  # (validation rows carry val_loss)
            row["loss_curve"] = [[r["step"], r["loss"]] for r in steps if r["loss"] is not None]
            if steps and steps[-1].get("moe_imbalance") is not None:
                row["moe_imbalance"] = steps[-1]["moe_imbalance"]
                row.update(rush_moe.routing(steps, ctx.warmup))
        if rung.name == "moe" and dense is not None:
            row.update(rush_moe.compare(dense, row))
        dense = dense or row
        record(ctx, row)
    return []


# ----------------------------------------------------------------------------------------------
# CLI


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split `ladder|dist ...` into the rush's own options and config overrides (`--section.key ...`)."""
    sub = argv[0]
    ap = argparse.ArgumentParser(
        prog=f"titanrush rush {sub}",
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="TOML config: wins over the built-in base, loses to the overrides")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument(
        "--warmup", type=int, default=10, help="steps left out of the means (clamped below --steps)"
    )
    ap.add_argument("--output", type=Path, default=Path(f"outputs/rush/{sub}"), help="output folder")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    ap.add_argument("--skip-unfit", action="store_true", help="skip runs the memory estimator says won't fit")
    ap.add_argument(
        "--gpu-mem", type=float, help="GiB per GPU for the estimator (default: the GPU here, else 80 GiB)"
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    if sub == "ladder":
        ap.add_argument("--max-batch", type=int, default=256, help="largest local batch the doubling tries")
        ap.add_argument(
            "--max-doublings", type=int, default=None, help="batch doublings (default GPU 8, CPU 2)"
        )
        ap.add_argument(
            "--ac-target",
            choices=["batch", "seq"],
            default="batch",
            help="AC rungs at the batch that did not fit, or at 2x seq_len with the kept batch",
        )
        ap.add_argument("--cpu-compile", action="store_true", help="run the compile rung on CPU too (slow)")
    elif sub == "dist":
        ap.add_argument(
            "--ngpu", type=int, required=True, help="the largest GPU count (powers of two up to it)"
        )
        ap.add_argument("--sweep-results", help="`titanrush sweep` results: the 8B run takes the best mesh")
    return runner.parse_with_overrides(ap, argv[1:])


# The CPU smoke runs of docs/rush.md, which a CPU machine is pointed to.
CPU_SMOKE = {
    kind: f"titanrush rush {kind} --config train_configs/debug.toml --steps 3 --training.seq_len 64 "
    "--training.local_batch_size 1 --data.dataset synthetic"
    for kind in ("ladder", "moe")
}


@stops_on_signals("titanrush rush")
def main(argv: list[str] | None = None) -> int:
    """`titanrush rush ladder|dist|moe ...`: 0 when the rush ran (whatever its rungs did), 2 on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("ladder", "dist", "moe"):
        print(__doc__)
        if argv and argv[0] in ("-h", "--help"):
            return 0
        given = f"unknown command {argv[0]!r}" if argv else "no command"
        print(f"titanrush rush: {given}; choose ladder, dist or moe (usage above)", file=sys.stderr)
        return 2
    kind = argv[0]
    try:
        args, overrides = parse(argv)
    except SystemExit as e:  # argparse has said what is wrong (or printed --help)
        return int(e.code or 0)
    ladder = kind == "ladder"
    checks = [
        (args.steps < 2, "--steps must be >= 2"),
        (args.warmup < 0, "--warmup must be >= 0"),
        (kind == "dist" and args.ngpu < 1, "--ngpu must be >= 1"),
        (ladder and args.max_batch < 1, "--max-batch must be >= 1"),
        (ladder and (args.max_doublings or 0) < 0, "--max-doublings must be >= 0"),
    ]
    bad = [message for failed, message in checks if failed] + runner.option_problems(
        args.timeout, args.output
    )
    if not args.dry_run and (problem := runner.earlier_results(args.output)):
        bad.append(problem)  # (a dry run writes nothing)
    sweep_mesh = None
    if kind == "dist" and args.sweep_results is not None:
        try:
            sweep_mesh = read_sweep_best(args.sweep_results)
        except (OSError, ValueError, ConfigError) as e:
            bad.append(f"--sweep-results: {e} (pass the results.jsonl that `titanrush sweep` wrote)")
    if bad:
        print(f"titanrush rush: {'; '.join(bad)}", file=sys.stderr)
        return 2
    config = str(Path(args.config).resolve()) if args.config else None
    dev = runner.probe_device()
    code_base = dict({"ladder": LADDER_BASE, "dist": DIST_BASE, "moe": MOE_BASE}[kind])
    if kind != "ladder" and dev.get("cuda"):
        code_base["compile.enable"] = "true"
    try:
        base = base_settings(config, code_base, overrides)
        base_cfg = cfgmod.load(config, to_args(base))
        validate.check_values(base_cfg)  # (each rung's degrees and machine are checked per rung)
        gpu_mem_gib, gpu_mem_note = gpu_memory(args.gpu_mem, dev)
        plan = rush_moe.moe_plan(config, base) if kind == "moe" else []
    except ConfigError as e:
        print(f"titanrush rush: config error: {e}", file=sys.stderr)
        return 2
    flavor = base_cfg.model.flavor
    gpu_base = not config and flavor == code_base["model.flavor"]  # (a step takes minutes on a CPU)
    if kind != "dist" and gpu_base and not dev.get("cuda") and not args.dry_run:
        print(
            f"titanrush rush: the built-in {kind} rush trains the {flavor} model at seq 2048, a GPU's "
            f"work (minutes a step on a CPU): on this machine without CUDA run the CPU smoke version, "
            f"`{CPU_SMOKE[kind]}`, or choose the model with --config FILE (--dry-run shows the GPU plan)",
            file=sys.stderr,
        )
        return 2
    warmup = min(args.warmup, args.steps - 1)
    notes: list[str] = []
    if warmup != args.warmup:
        notes.append(f"--warmup {args.warmup} clamped to {warmup} (below --steps {args.steps})")
    if kind == "ladder":
        doublings = args.max_doublings if args.max_doublings is not None else (8 if dev.get("cuda") else 2)
        plan = ladder_plan(
            dev,
            base_batch=base_cfg.training.local_batch_size,
            max_batch=args.max_batch,
            max_doublings=doublings,
            cpu_compile=args.cpu_compile,
        )
        if not dev.get("cuda"):
            notes.append(
                f"CPU: MFU is null (no peak to divide by), peak memory is the process's peak RSS, and the "
                f"batch doubling stops after {doublings} doublings (--max-doublings)"
            )
    elif kind == "dist":
        plan = dist_plan(dev, args.ngpu, sweep_mesh)
    elif not dev.get("cuda"):
        notes.append("CPU: MFU is null (no peak to divide by), peak memory is the process's peak RSS")
    ctx = Ctx(
        config=config,
        out=args.output.resolve(),
        steps=args.steps,
        warmup=warmup,
        timeout=args.timeout,
        dry_run=args.dry_run,
        skip_unfit=args.skip_unfit,
        device=dev,
        launcher="torchrun" if kind == "dist" else "python",
        progress=report.Progress(len(plan)),
        gpu_mem_gib=gpu_mem_gib,
        gpu_mem_note=gpu_mem_note,
    )
    if not args.dry_run:
        ctx.env = report.environment(dev, "titanrush rush " + shlex.join(argv), gpu_mem_note)
    what = "dry run: the plan, nothing runs" if args.dry_run else f"output {ctx.out}"
    print(f"titanrush rush {kind} on {dev.get('name')} (torch {dev.get('torch')}): {len(plan)} runs; {what}")
    print(f"GPU memory: {gpu_mem_note}")
    if kind == "ladder":
        notes += run_ladder(ctx, plan, base, args.ac_target)
    else:
        notes += run_dist(ctx, plan, base) if kind == "dist" else run_moe(ctx, plan, base)
    if args.dry_run:
        print("\n".join(f"note: {n}" for n in notes))
        return 0
    if kind == "moe":
        rush_moe.write_all(ctx.out, ctx.rows, ctx.env, steps=ctx.steps, warmup=ctx.warmup, notes=notes)
    else:
        report.write_all(ctx.out, kind, ctx.rows, ctx.env, steps=ctx.steps, warmup=ctx.warmup, notes=notes)
    print(f"titanrush rush: wrote {ctx.out / 'report.md'}, results.jsonl, the charts and tb/")
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
