"""`titanrush sweep`: run every valid mesh shape (tp / pp / cp / ...) of a config on N GPUs and rank them.

  titanrush sweep --config FILE --ngpu N [--grid "tp=1,2,4 pp=1,2 cp=1,2"] [--steps S] [--warmup W]
                  [--output DIR] [--dry-run] [--skip-unfit] [--assume-cuda] [--gpu-mem GiB] [overrides]

The grid names the values of each dimension, `dim=v1,v2,...`, separated by spaces: the degrees
dp_replicate, dp_shard, tp, pp, cp, and the extras ep (expert parallel of the Llama 4 flavors, ranks
borrowed from dp_shard), reshard (always, never, default: FSDP's
reshard_after_forward), ac (none, selective, full: activation checkpointing) and batch (the local batch
size). dp_shard takes what the other degrees leave of N unless the grid names it; a degree the grid
does not name keeps the config's value. Every combination is checked by the trainer's own plan
(`titanrush.run.plan.build_plan`) at world size N; the invalid ones are listed with its reason, never dropped.
`--dry-run` prints the valid shapes, one per line, and runs nothing (on stderr: the command each would
run, and the shapes ranked before measuring). Otherwise each shape trains for --steps steps
(`NGPU=N ./run_train.sh`, one after another) and the output folder gets results.jsonl, results.md
(sorted by tokens/s, with the command that trains the config with the best shape), sweep.png and
TensorBoard hparams (tb/); an output folder that holds an earlier sweep's results is refused.
`titanrush rush dist --sweep-results <output>/results.jsonl` takes the fastest shape from it for its 8B run.

Each valid shape gets the memory estimator's verdict against one GPU memory (`titanrush estimate`'s rule:
--gpu-mem, else the GPU here, else 80 GiB, said so); --skip-unfit skips the shapes it says will not fit.
On a machine without CUDA a shape that needs GPUs (`titanrush.run.machine`: context parallel, or more
memory than this machine has) is invalid, and a config whose every valid shape needs them is refused;
--assume-cuda (with --dry-run) validates and plans as on a GPU machine, to plan a GPU sweep here.
Exit status: 0 when the sweep ran (whatever its shapes did), 1 when no shape is valid (or, in a dry
run with --skip-unfit, none would run), 2 on bad input (a config that needs GPUs, without them, too),
128 + N when signal N stopped it (passed on to the run in progress first: titanrush/tools/tool_signals.py).
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import shlex
import sys
from pathlib import Path
from typing import Any

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.run import mesh, validate
from titanrush.run.machine import NEEDS, Host, gpu_need, host_memory_gib
from titanrush.tools import rush_report, sweep_report
from titanrush.tools import rush_runner as runner
from titanrush.tools.estimate import gpu_memory
from titanrush.tools.rush_runner import SKIPPED, Ctx, Rung, base_settings, fit_text, to_args
from titanrush.tools.tool_signals import stops_on_signals

Shape = dict[str, Any]  # grid dimension -> value, in DIMS order

DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
# Each grid dimension: (config key, allowed values; None = positive integers).
DIMS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    **{d: (f"parallelism.{d}", None) for d in DEGREES},
    # expert parallel (Llama 4 flavors): borrowed from dp_shard, so not a factor of the world size
    "ep": ("parallelism.ep", None),
    "reshard": ("parallelism.fsdp_reshard_after_forward", ("always", "never", "default")),
    "ac": ("activation_checkpoint.mode", ("none", "selective", "full")),
    "batch": ("training.local_batch_size", None),
}
INVALID = "invalid"  # the status of a shape the trainer refuses (or that repeats an earlier run)
NO_GPUS_HERE = "this machine has none: --dry-run --assume-cuda plans the sweep as on the GPUs"
_NAME = {"dp_replicate": "rep", "dp_shard": "shard", "reshard": "reshard_", "ac": "ac_", "batch": "batch"}


class GridError(ValueError):
    """A malformed --grid: the message names the entry and the fix."""


# ----------------------------------------------------------------------------------------------
# Grid and shapes


def parse_grid(text: str) -> dict[str, list[Any]]:
    """Parse `"tp=1,2,4 pp=1,2 reshard=always,never"` into {dimension: values}, in DIMS order.

    Args:
        text: Space-separated `dim=v1,v2,...` entries.

    Returns:
        The values of each named dimension (integers for the degrees and batch), duplicates dropped.

    Raises:
        GridError: An entry without `=`, an unknown or repeated dimension, or a bad value.
    """
    grid: dict[str, list[Any]] = {}
    if not text.split():
        raise GridError(f"the grid is empty; give entries like tp=1,2,4 (dimensions: {', '.join(DIMS)})")
    for entry in text.split():
        dim, eq, values = entry.partition("=")
        if not eq:
            raise GridError(f"grid entry {entry!r} must look like dim=v1,v2 (e.g. tp=1,2,4)")
        if dim not in DIMS:
            near = difflib.get_close_matches(dim, list(DIMS), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise GridError(f"unknown grid dimension {dim!r}; {hint}dimensions: {', '.join(DIMS)}")
        if dim in grid:
            raise GridError(f"grid dimension {dim!r} is given twice; list all its values once: {dim}=1,2")
        items = [v for v in values.split(",") if v]
        if not items:
            raise GridError(f"grid entry {entry!r} has no values; e.g. {dim}=1,2")
        grid[dim] = list(dict.fromkeys(_grid_value(dim, v) for v in items))
    return {d: grid[d] for d in DIMS if d in grid}


def _grid_value(dim: str, value: str) -> Any:
    choices = DIMS[dim][1]
    if choices is not None:
        if value not in choices:
            raise GridError(f"{dim}={value!r} is not one of {', '.join(choices)}")
        return value
    if not value.isdigit() or int(value) < 1:
        raise GridError(f"{dim} values must be positive integers, got {value!r}")
    return int(value)


def default_grid(ngpu: int) -> str:
    """tp, pp and cp each over the divisors of N: with dp_shard taking what they leave, the grid holds
    every 4-D shape (tp x pp x cp x dp) of N GPUs, powers of two or not (N = 6: tp = 3)."""
    divisors = ",".join(str(d) for d in mesh.divisors(ngpu))  # (the mesh proposals' shapes too)
    return f"tp={divisors} pp={divisors} cp={divisors}"


def candidates(grid: dict[str, list[Any]], base: dict[str, int]) -> list[Shape]:
    """Every combination of the grid, in DIMS order (the last dimension varies fastest).

    Args:
        grid: parse_grid's output.
        base: The config's degrees, for those the grid does not name (dp_shard: -1, the rest).
    """
    axes = {d: grid.get(d, [base[d]]) for d in DEGREES} | {d: v for d, v in grid.items() if d not in DEGREES}
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def label(shape: Shape) -> str:
    """`dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1` (then the extras); an unresolved dp_shard reads `?`."""
    return " ".join(f"{d}={'?' if v == -1 else v}" for d, v in shape.items())


def name(shape: Shape) -> str:
    """A folder-safe name: `rep1-shard2-tp2-pp1-cp1-reshard_never-ac_full-batch2`."""
    return "-".join(f"{_NAME.get(d, d)}{v}" for d, v in shape.items())


def settings_of(shape: Shape) -> dict[str, str]:
    """The config overrides of a shape: {"parallelism.tp": "2", ...}."""
    return {DIMS[d][0]: str(v) for d, v in shape.items()}


def check_shape(
    config: str | None,
    base: dict[str, str],
    shape: Shape,
    ngpu: int,
    *,
    assume_cuda: bool = False,
    host: Host | None = None,
) -> tuple[Shape, Any, str]:
    """Validate one shape as the trainer would at world size N.

    Args:
        config: The TOML config.
        base: Overrides under the shape's own (the user's, and what the sweep fixes for every run).
        shape: The shape (dp_shard -1: the rest).
        ngpu: The world size.
        assume_cuda: Validate as if CUDA were available.
        host: The machine without CUDA that would run it: a shape that needs GPUs is refused
            (`titanrush.run.machine.gpu_need`); None: no such check (CUDA here, or --assume-cuda).

    Returns:
        (the shape with dp_shard resolved where possible, ParallelDims or None, "" or the reason).
    """
    from titanrush.run.autoplan import stand_in
    from titanrush.run.plan import build_plan

    try:
        cfg = cfgmod.load(config, to_args({**base, **settings_of(shape)}))
        if host is not None and (need := gpu_need(cfg, ngpu, host)):
            raise ConfigError(f"{need}; {NO_GPUS_HERE}")
        dims = build_plan(stand_in(cfg), ngpu, machine=not assume_cuda).dims  # (auto levers: not the mesh)
    except ConfigError as e:
        others = shape["dp_replicate"] * shape["cp"] * shape["tp"] * shape["pp"]
        if shape["dp_shard"] == -1 and ngpu % others == 0:  # the dp_shard it would have had
            shape = {**shape, "dp_shard": ngpu // others}
        return shape, None, str(e)
    return {**shape, "dp_shard": dims.dp_shard}, dims, ""


def plan(
    config: str | None,
    base: dict[str, str],
    grid: dict[str, list[Any]],
    ngpu: int,
    *,
    assume_cuda: bool = False,
    host: Host | None = None,
) -> tuple[list[Shape], list[tuple[Shape, str]]]:
    """The valid shapes of the grid on N GPUs, and the invalid ones with the reason.

    A shape that would run exactly as an earlier one is listed as invalid too: a reshard mode without
    FSDP (dp_shard x cp = 1), or reshard=default with pp > 1 (the trainer makes it `never`).

    Args:
        config: The TOML config.
        base: Overrides applied under every shape's own (user overrides, the sweep's fixed keys).
        grid: parse_grid's output.
        ngpu: The world size.
        assume_cuda: Validate as if CUDA were available.
        host: A machine without CUDA: the shapes that need GPUs are invalid there (`check_shape`).

    Returns:
        (valid shapes with dp_shard resolved, [(invalid shape, reason)]).
    """
    base_cfg = cfgmod.load(config, to_args(base))
    validate.check_values(base_cfg)  # (a bad value is the config's, not a shape's: exit 2)
    degrees = {d: getattr(base_cfg.parallelism, d) for d in DEGREES} | {"dp_shard": -1}
    valid: list[Shape] = []
    invalid: list[tuple[Shape, str]] = []
    seen: dict[tuple, Shape] = {}
    for shape in candidates(grid, degrees):
        shape, dims, reason = check_shape(config, base, shape, ngpu, assume_cuda=assume_cuda, host=host)
        if reason:
            invalid.append((shape, reason))
            continue
        effective, why = dict(shape), ""
        if "reshard" in shape and not dims.fsdp_enabled:
            effective["reshard"], why = None, "reshard has no effect without FSDP (dp_shard x cp = 1)"
        elif shape.get("reshard") == "default" and dims.pp > 1:
            effective["reshard"], why = "never", "with pp > 1 the trainer turns reshard=default into never"
        key = tuple(effective.items())
        if key in seen:
            invalid.append((shape, f"the same run as {label(seen[key])}: {why}"))
            continue
        seen[key] = shape
        valid.append(shape)
    return valid, invalid


# ----------------------------------------------------------------------------------------------
# Running


def run_shapes(
    ctx: Ctx,
    shapes: list[Shape],
    ngpu: int,
    base: dict[str, str],
    user: list[str],
    invalid: list[dict[str, Any]],
) -> None:
    """Run every shape one after another; results.jsonl is rewritten after each, so a crash keeps what ran.

    Args:
        ctx: The sweep (its rows collect the results).
        shapes: The valid shapes.
        ngpu: GPUs (processes) of each run.
        base: The user's overrides (under each shape's settings).
        user: The user's overrides as typed (recorded in each row).
        invalid: The invalid shapes' rows (written after the run rows).
    """
    for shape in shapes:
        rung = Rung(name(shape), label(shape), settings_of(shape), "sweep", ngpu=ngpu)
        row = runner.execute(ctx, rung, {**base, **settings_of(shape)}, None)
        ctx.rows.append(shape_row(row, shape, user))
        rush_report.write_jsonl(ctx.out / "results.jsonl", ctx.rows + invalid, ctx.env)


def shape_row(row: dict[str, Any], shape: Shape, user: list[str]) -> dict[str, Any]:
    """A result row as `rush dist --sweep-results` reads it: `overrides` = the shape's settings only (not
    the user's, which go to `base_overrides`), `mesh` = the five degrees, `tps` = tokens/s per GPU."""
    # execute's own keys that mean nothing here; its `overrides` hold the user's too
    for key in ("adds", "group", "parent", "strategy", "overrides"):
        row.pop(key, None)
    return {
        "index": row.pop("index", None),
        "name": name(shape),
        "shape": label(shape),
        **shape,
        "mesh": {d: shape[d] for d in DEGREES},
        "overrides": settings_of(shape),
        "base_overrides": user,
        **row,
    }


def invalid_row(
    ctx: Ctx, shape: Shape, reason: str, ngpu: int, base: dict[str, str], user: list[str]
) -> dict[str, Any]:
    """The row of a shape that is not run, with the command that would show the trainer's refusal."""
    rung = Rung(name(shape), label(shape), settings_of(shape), "sweep", ngpu=ngpu)
    _, shown, _ = runner.command(ctx, rung, {**base, **settings_of(shape)})
    row = {"status": INVALID, "reason": reason, "command": shown, "ngpu": rung.ngpu}
    return shape_row(row, shape, user)


# ----------------------------------------------------------------------------------------------
# CLI


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split argv into the sweep's own options and config overrides (`--section.key value`)."""
    ap = argparse.ArgumentParser(
        prog="titanrush sweep",
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = ap.add_argument
    add("--config", required=True, help="TOML config of the job to sweep")
    add("--ngpu", type=int, required=True, help="GPUs (processes) of every run: the world size")
    add("--grid", help='e.g. "tp=1,2,4 pp=1,2 cp=1,2" (default: tp, pp, cp over the divisors of N)')
    add("--steps", type=int, default=30, help="training steps per shape")
    add("--warmup", type=int, default=10, help="steps left out of the means (clamped below --steps)")
    add("--output", type=Path, default=Path("outputs/sweep"), help="output folder")
    add("--dry-run", action="store_true", help="print the valid shapes and run nothing")
    add("--skip-unfit", action="store_true", help="skip shapes the memory estimator says won't fit")
    add(
        "--assume-cuda",
        action="store_true",
        help="dry run: validate and plan as on GPUs (from a CPU machine)",
    )
    add("--gpu-mem", type=float, help="GiB per GPU for the estimator (default: the GPU here, else 80 GiB)")
    add("--timeout", type=float, default=1800, help="seconds per shape before it is killed")
    return runner.parse_with_overrides(ap, argv)


def print_plan(ctx: Ctx, shapes: list[Shape], user: dict[str, str], ngpu: int) -> int:
    """The dry run: each valid shape on stdout, one per line, in run order (with --skip-unfit, a shape the
    estimator says won't fit goes to stderr only); on stderr the estimator's verdict on each with the
    command the sweep would run for it, then the shapes ranked before measuring
    (`sweep_report.rank_planned`). Returns how many would run."""
    kept: list[tuple[Shape, dict[str, Any]]] = []
    for shape in shapes:
        est = runner.estimate_fit(ctx, {**user, **settings_of(shape)}, ngpu)
        skip = ctx.skip_unfit and est.get("fits") is False
        verdict = f"estimate: {label(shape)}: {fit_text(est)}"
        print(verdict + (" (skipped: --skip-unfit)" if skip else ""), file=sys.stderr)
        if not skip:
            rung = Rung(name(shape), label(shape), settings_of(shape), "sweep", ngpu=ngpu)
            print(f"  $ {runner.command(ctx, rung, {**user, **settings_of(shape)})[1]}", file=sys.stderr)
            print(label(shape), flush=True)
            kept.append((shape, est))
    if kept:
        order = sweep_report.rank_planned(kept)
        print(
            "ranked before measuring (a guess: what the estimator says fits first, then the fewest GPUs in "
            "tp x pp x cp, whose communication is on each step's critical path, then the least memory; "
            "the run measures):",
            file=sys.stderr,
        )
        for place, i in enumerate(order, 1):
            shape, est = kept[i]
            print(f"  {place}. {label(shape)}  ({fit_text(est)})", file=sys.stderr)
    return len(kept)


def _fail(message: str) -> int:
    print(f"titanrush sweep: {message}", file=sys.stderr)
    return 2


@stops_on_signals("titanrush sweep")
def main(argv: list[str] | None = None) -> int:
    """`titanrush sweep ...`: 0 when the sweep ran, 1 when no shape is valid, 2 on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.ngpu < 1 or args.steps < 2:
        return _fail("--ngpu must be >= 1 and --steps >= 2")
    if args.warmup < 0:
        return _fail("--warmup must be >= 0")
    if problems := runner.option_problems(args.timeout, args.output):
        return _fail("; ".join(problems))
    if not args.dry_run and (problem := runner.earlier_results(args.output)):
        return _fail(problem)  # (before any run: a dry run writes nothing)
    if args.assume_cuda and not args.dry_run:
        return _fail("--assume-cuda only plans (a run needs real GPUs): use it with --dry-run")
    try:
        grid = parse_grid(args.grid if args.grid is not None else default_grid(args.ngpu))
    except GridError as e:
        return _fail(f"bad --grid: {e}")
    config = str(Path(args.config).resolve())
    dev = runner.probe_device()
    if not args.dry_run and dev.get("cuda") and args.ngpu > (dev.get("count") or 0):
        return _fail(f"--ngpu {args.ngpu}, but only {dev.get('count')} GPUs are visible")
    warmup = min(args.warmup, args.steps - 1)
    try:
        gpu_mem_gib, gpu_mem_note = gpu_memory(args.gpu_mem, dev)
    except ConfigError as e:
        return _fail(str(e))
    ctx = Ctx(
        config=config,
        out=args.output.resolve(),
        steps=args.steps,
        warmup=warmup,
        timeout=args.timeout,
        dry_run=args.dry_run,
        skip_unfit=args.skip_unfit,
        device=dev,
        launcher="torchrun",
        progress=sweep_report.Progress(0),
        gpu_mem_gib=gpu_mem_gib,
        gpu_mem_note=gpu_mem_note,
    )
    # Without CUDA here the shapes that need GPUs are refused (--assume-cuda: planned as on the GPUs).
    cpu = not dev.get("cuda") and not args.assume_cuda
    host = Host(args.ngpu, dev.get("host_mem_gib") or host_memory_gib()) if cpu else None
    try:
        user = base_settings(config, {}, overrides)
        fixed = {k: v for k, v in runner.forced(ctx, "check").items() if not k.startswith("job.")}
        shapes, invalid = plan(
            config, {**user, **fixed}, grid, args.ngpu, assume_cuda=args.assume_cuda, host=host
        )
    except ConfigError as e:
        return _fail(f"config error: {e}")
    needs_gpus = [reason for _, reason in invalid if reason.startswith(NEEDS)]
    if needs_gpus and not shapes:  # the config itself needs GPUs: one line, as `titanrush train` says it
        return _fail(needs_gpus[0])
    grid_text = " ".join(f"{d}={','.join(map(str, v))}" for d, v in grid.items())
    notes: list[str] = []
    if warmup != args.warmup:
        notes.append(f"--warmup {args.warmup} clamped to {warmup} (below --steps {args.steps})")
    if needs_gpus or any("needs CUDA" in reason for _, reason in invalid):
        notes.append("shapes that need GPUs are invalid here: --dry-run --assume-cuda plans them as on GPUs")
    what = "dry run: nothing runs" if args.dry_run else f"output {ctx.out}"
    head = (
        f"titanrush sweep on {dev.get('name')} (torch {dev.get('torch')}): {args.ngpu} GPUs, grid "
        f"{grid_text}: {len(shapes)} valid shapes, {len(invalid)} invalid; {what}"
    )
    # A dry run keeps stdout to the shapes (one per line, for scripts); the rest goes to stderr.
    info = sys.stderr if args.dry_run else sys.stdout
    print(head, file=info)
    print(f"GPU memory: {gpu_mem_note}", file=info)
    for shape, reason in invalid:
        print(f"invalid: {label(shape)}: {reason}", file=info)
    if args.dry_run:
        would_run = print_plan(ctx, shapes, user, args.ngpu)
        for note in notes:
            print(f"note: {note}", file=info)
        return 0 if would_run else 1
    if not shapes:
        print("titanrush sweep: no valid shape in the grid; nothing to run", file=sys.stderr)
        return 1
    ctx.progress.total = len(shapes)
    ctx.env = rush_report.environment(dev, "titanrush sweep " + shlex.join(argv), gpu_mem_note)
    rejected = [invalid_row(ctx, s, r, args.ngpu, user, overrides) for s, r in invalid]
    run_shapes(ctx, shapes, args.ngpu, user, overrides, rejected)
    flavor = cfgmod.load(config, to_args(user)).model.flavor
    sweep_report.write_all(
        ctx.out,
        ctx.rows,
        rejected,
        ctx.env,
        dims=list(DIMS),
        steps=ctx.steps,
        warmup=warmup,
        notes=notes,
        config=config,
        flavor=flavor,
    )
    skipped = sum(r["status"] == SKIPPED for r in ctx.rows)
    print(
        f"titanrush sweep: wrote {ctx.out / 'results.md'}, results.jsonl, sweep.png and tb/"
        + (f" ({skipped} skipped by the estimator)" if skipped else "")
    )
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
