"""The rush's child runs: launch one training run, read its metrics.jsonl, classify how it ended.

Every rung runs in its own process (`python -m titanrush.train`, or `./run_train.sh` under torchrun for
several GPUs) so that an out-of-memory error, a CUDA context or a compile cache cannot leak into the
next rung. The pure functions here (OOM detection, the last error line, the figures of a metrics file,
speedups) are what the unit tests exercise with fake child output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.launch_env import gpu_device_files
from titanrush.tools import tool_signals
from titanrush.tools.device_probe import device_facts

ROOT = Path(__file__).resolve().parents[2]

# Statuses a row can have. Only OK rows carry figures.
OK, OOM, FAILED, TIMEOUT = "ok", "OOM", "failed", "timeout"
NEEDS_GPU, NOT_AVAILABLE, SKIPPED, PLANNED = "needs GPU", "not available", "skipped", "planned"

# Lower-cased fragments that only an allocation failure prints (CUDA, ROCm, cuBLAS, NCCL, the host).
_OOM_MARKERS = (
    "outofmemoryerror",  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError
    "cuda out of memory",
    "cuda error: out of memory",
    "hip out of memory",
    "cublas_status_alloc_failed",
    "cudaerrormemoryallocation",
    "failed to cuda calloc",
    "cudnn_status_alloc_failed",
    "memoryerror",  # Python's own, on the host
    "titanrush: error: out of memory",  # the trainer's one line for any of them (titanrush.train)
)
_ERROR_LINE = re.compile(
    r"^(?:\[(?:rank|default)\d+\]:\s*)*"  # torchrun's per-rank prefixes
    r"((?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)|(?:titanrush: (?:config )?error: .*))$"
)
_CONFIG_ERROR = re.compile(r"titanrush: config error: (.*)")

# The figures averaged over the steady steps (after the warm-up).
_MEAN_KEYS = ("tps", "tflops", "mfu", "step_time", "data_wait_pct")

# ----------------------------------------------------------------------------------------------
# Pure functions: classification and figures


def detect_oom(output: str) -> bool:
    """Whether a child's output shows an out-of-memory failure.

    Args:
        output: The child's stdout and stderr together.

    Returns:
        True when any allocator's out-of-memory message appears.
    """
    low = output.lower()
    return any(marker in low for marker in _OOM_MARKERS)


def last_error_line(output: str, limit: int = 300) -> str:
    """The last line that names an error (`SomeError: ...`), without torchrun's rank prefixes.

    torchrun's closing `ChildFailedError` summary is skipped: it names no cause. Falls back to the last
    non-empty line.

    Args:
        output: The child's stdout and stderr together.
        limit: Truncate the line to this many characters.

    Returns:
        The line, or "" for an empty output.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m and "ChildFailedError" not in line:
            return m.group(1)[:limit]
    return lines[-1][:limit] if lines else ""


def classify(returncode: int | None, output: str, timed_out: bool = False) -> tuple[str, str]:
    """How a child ended: (status, reason).

    Args:
        returncode: The exit status (negative: killed by that signal); None when it never ran.
        output: The child's stdout and stderr together.
        timed_out: The rush killed it at its time limit.

    Returns:
        (`ok`, ""), (`OOM`, error line), (`not available`, config error: a feature this version lacks
        or a combination it refuses), (`timeout`, ...) or (`failed`, the last error line).
    """
    if timed_out:
        return TIMEOUT, "killed at the time limit (--timeout)"
    if returncode == 0:
        return OK, ""
    if detect_oom(output):
        return OOM, last_error_line(output)
    m = _CONFIG_ERROR.search(output)
    if m:
        return NOT_AVAILABLE, m.group(1).strip()[:300]
    if returncode is not None and returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return FAILED, "killed by SIGKILL (the host may have run out of memory)"
    return FAILED, last_error_line(output) or f"exit status {returncode}"


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The rung's figures from its metrics.jsonl rows.

    Throughput figures are means over the steps after `warmup` (compilation and allocator warm-up
    excluded); peak memory is the maximum over all steps (what decides whether a run fits); the
    first-step time is step 1's step_time (compilation, cuDNN autotuning and allocation).

    Args:
        records: metrics.jsonl rows (training rows carry `loss`; validation rows are ignored).
        warmup: Steps excluded from the means.

    Returns:
        tps, tflops, mfu, step_time, data_wait_pct, mem_active_gib, mem_reserved_gib, first_step_s,
        final_loss and steps_measured; a figure is None where no step reported it.
    """
    rows = [r for r in records if "loss" in r]
    steady = [r for r in rows if r["step"] > warmup]
    out: dict[str, Any] = {"steps_measured": len(steady)}
    for key in _MEAN_KEYS:
        vals = [r[key] for r in steady if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    for key in ("mem_active_gib", "mem_reserved_gib"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = max(vals) if vals else None
    first = next((r for r in rows if r["step"] == 1), None)
    out["first_step_s"] = first.get("step_time") if first else None
    out["final_loss"] = rows[-1]["loss"] if rows else None
    return out


def speedup(value: float | None, base: float | None) -> float | None:
    """value / base, or None when either is missing or the base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file ([] when it is missing); a torn last line is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


# ----------------------------------------------------------------------------------------------
# Child processes


def run_child(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float
) -> tuple[int | None, bool]:
    """Run one command in its own process group, its output to `log_path`.

    Args:
        cmd: The command.
        env: Its environment.
        log_path: Where its stdout and stderr go.
        timeout_s: Kill it (its whole process group: torchrun and its ranks) after this many seconds.

    Returns:
        (exit status, timed out).

    Raises:
        tool_signals.Stopped: SIGTERM or SIGINT came meanwhile: passed on to the command, which has ended.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            with tool_signals.passed_on(proc):
                try:
                    return proc.wait(timeout=timeout_s), False
                except subprocess.TimeoutExpired:
                    kill_group(proc)
                    return proc.returncode, True
        except BaseException:  # (whatever is left of the child's group goes down with us)
            kill_group(proc)
            raise


def kill_group(proc: subprocess.Popen) -> None:
    """Stop a child started in its own session, and everything it started (torchrun and its ranks)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def run_training(
    cmd: list[str],
    *,
    env: dict[str, str],
    run_dir: Path,
    log_path: Path,
    warmup: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Run one training child and return its row: status, reason, figures, wall time, log path.

    Args:
        cmd: The training command (its `--job.dump_folder/--job.name` must point at `run_dir`).
        env: The child's environment.
        run_dir: The run folder; emptied first, since metrics.jsonl and console.log are appended to.
        log_path: Where the child's output goes.
        warmup: Steps excluded from the means.
        timeout_s: The child's time limit.
    """
    if run_dir.exists():
        for f in ("metrics.jsonl", "config.toml", "console.log", "summary.json"):
            (run_dir / f).unlink(missing_ok=True)
    t0 = time.perf_counter()
    rc, timed_out = run_child(cmd, env, log_path, timeout_s)
    output = log_path.read_text(errors="replace")
    status, reason = classify(rc, output, timed_out)
    row: dict[str, Any] = {"status": status, "reason": reason, "returncode": rc}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["log"] = str(log_path)
    records = read_metrics(run_dir / "metrics.jsonl")
    if status == OK:
        row.update(summarize(records, warmup))
    elif records:  # how far it got (an OOM at step 5 still tells the first-step time)
        row["steps_done"] = max(r["step"] for r in records)
    return row


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: ours, unbuffered output, the checkout importable."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


# ----------------------------------------------------------------------------------------------
def option_problems(timeout: float, output: Path) -> list[str]:
    """What is wrong with the options sweep and rush share (--timeout, --output), before anything runs."""
    checks = [
        (not 0 < timeout < math.inf, f"--timeout {timeout}: seconds per run, a finite number > 0"),
        (output.exists() and not output.is_dir(), f"--output {output} is a file: name a folder"),
    ]
    return [message for failed, message in checks if failed]


# What a sweep or rush writes into --output first (after its first run): an earlier one's results.
RESULTS = ("results.jsonl", "runs", "logs")


def earlier_results(output: Path) -> str:
    """Why --output cannot take a new sweep or rush ('' if it can): it holds an earlier one's results,
    which the new one would replace (results.jsonl is rewritten whole, runs/<name> reused)."""
    found = [name + "/" * (output / name).is_dir() for name in RESULTS if (output / name).exists()]
    if not found:
        return ""
    what = f"{', '.join(found[:-1])} and {found[-1]}" if len(found) > 1 else found[0]
    return (
        f"--output {output} already holds {what} of an earlier run, which this one would replace: choose "
        "another --output (or move that folder away first)"
    )


# The machine


def probe_device(timeout_s: float = 120) -> dict[str, Any]:
    """What the children will see: GPU name, count, capability, memory, attention kernels, packages
    (`device_probe`), asked of a child process, or of this one on a host without a GPU's device file."""
    if not gpu_device_files():
        return device_facts(gpus=False)
    try:
        cmd = [sys.executable, "-m", "titanrush.tools.device_probe"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env())
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        # Every other key reads as absent (False / None) downstream.
        return {"cuda": False, "name": f"unknown (device probe failed: {e})", "count": 0, "torch": "unknown"}


# ----------------------------------------------------------------------------------------------
# One rung


@dataclasses.dataclass
class Rung:
    """One run of a ladder.

    group: `main` (the next rungs build on it), `side` (measured, not built on), `batch` (the doubling;
    stops at the first that does not fit), `ac` (at the batch or sequence that did not fit), `scaling`
    (dist), `8b` (dist), `moe` (dense vs MoE). status/reason: set when the rung will not run on this
    machine. fields: copied into the rung's row (the moe group's parameter counts).
    """

    name: str
    adds: str
    delta: dict[str, str]
    group: str = "main"
    status: str | None = None
    reason: str = ""
    ngpu: int = 1
    strategy: str = ""
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Ctx:
    """What every run of one rush shares."""

    config: str | None
    out: Path
    steps: int
    warmup: int
    timeout: float
    dry_run: bool
    skip_unfit: bool
    device: dict[str, Any]
    launcher: str  # "python" (python -m titanrush.train) or "torchrun" (NGPU=k ./run_train.sh)
    progress: Any  # rush_report.Progress
    gpu_mem_gib: float  # what the estimates are held against, and where it comes from (estimate.gpu_memory)
    gpu_mem_note: str
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    env: dict[str, Any] = dataclasses.field(default_factory=dict)  # rush_report.environment()


def to_args(settings: dict[str, str]) -> list[str]:
    """{"training.seq_len": "64"} -> ["--training.seq_len", "64"]."""
    return [a for key, value in settings.items() for a in (f"--{key}", value)]


def forced(ctx: Ctx, name: str) -> dict[str, str]:
    """What the rush sets on every child: the step count, a metrics row per step, its own run folder, and
    nothing that would skew the timing (checkpoints, validation, profiling, TensorBoard)."""
    return {
        "training.steps": str(ctx.steps),
        "training.global_batch_size": "-1",
        "metrics.log_freq": "1",
        "metrics.tensorboard": "false",
        "checkpoint.enable": "false",
        "profiling.enable": "false",
        "validation.freq": "0",
        "job.overwrite": "true",
        "job.dump_folder": str(ctx.out / "runs"),
        "job.name": name,
    }


def command(ctx: Ctx, rung: Rung, settings: dict[str, str]) -> tuple[list[str], str, dict[str, str]]:
    """(argv, the command as a user would type it, extra environment) of one rung."""
    args = (["--config", ctx.config] if ctx.config else []) + to_args({**settings, **forced(ctx, rung.name)})
    if ctx.launcher == "python":
        shown = shlex.join(["python", "-m", "titanrush.train", *args])
        return [sys.executable, "-m", "titanrush.train", *args], shown, {}
    env = {"NGPU": str(rung.ngpu), "PYTHON": sys.executable}
    shown = f"NGPU={rung.ngpu} " + shlex.join(["./run_train.sh", *args])
    return [str(ROOT / "run_train.sh"), *args], shown, env


def quick_estimate(cfg: cfgmod.JobConfig, ngpu: int, gpu_mem_gib: float) -> Any:
    """`titanrush.tools.estimate.estimate` without its fake-tensor trace (the analytic model: ~10 ms)."""
    from titanrush.tools.estimate import estimate

    return estimate(cfg, ngpu, gpu_mem_gib, trace=False)  # it plans for the GPU machine


def estimate_fit(ctx: Ctx, settings: dict[str, str], ngpu: int) -> dict[str, Any]:
    """The memory estimator's verdict on one run against `ctx.gpu_mem_gib`: total_gib, gpu_mem_gib and
    fits, or a note saying why there is none."""
    try:
        cfg = cfgmod.load(ctx.config, to_args(settings))
        est = quick_estimate(cfg, ngpu, ctx.gpu_mem_gib)
        return {"total_gib": float(est.total_gib), "gpu_mem_gib": ctx.gpu_mem_gib, "fits": bool(est.fits)}
    except ConfigError as e:  # a config the trainer would refuse, or one the estimator does not count
        return {"note": f"no estimate: {e}"[:200]}
    except Exception as e:  # an estimate must never stop the rush
        return {"note": f"estimator error: {type(e).__name__}: {e}"[:200]}


def fit_text(est: dict[str, Any]) -> str:
    """`37.2 of 80 GiB: fits` (or `does not fit`), or the note of a missing estimate."""
    if "total_gib" not in est:
        return est.get("note", "no estimate")
    verdict = "fits" if est["fits"] else "does not fit"
    return f"{est['total_gib']:.1f} of {est['gpu_mem_gib']:g} GiB: {verdict}"


def execute(ctx: Ctx, rung: Rung, settings: dict[str, str], parent: dict[str, Any] | None) -> dict[str, Any]:
    """Run one rung (a dry run prints its command instead) and return its row.

    Args:
        ctx: The rush.
        rung: The rung.
        settings: Its config overrides (the rush's forced keys are added on top).
        parent: The row it is compared with, or None.

    Returns:
        The row: index, name, adds, group, strategy, ngpu, parent, overrides, command, estimate, status,
        reason, and the figures of an OK run.
    """
    argv, shown, extra_env = command(ctx, rung, settings)
    row: dict[str, Any] = {
        "index": len(ctx.rows) + 1,
        "name": rung.name,
        "adds": rung.adds,
        "group": rung.group,
        "strategy": rung.strategy,
        "ngpu": rung.ngpu,
        "parent": parent["name"] if parent else None,
        "overrides": settings,
        "command": shown,
        **rung.fields,
    }
    if rung.status:  # cannot run here: one progress line
        row.update(status=rung.status, reason=rung.reason, estimate={})
        ctx.progress.end(rung.name, row, started=False)
        return row
    ctx.progress.start(rung.name, rung.adds)
    est = row["estimate"] = estimate_fit(ctx, settings, rung.ngpu)
    if ctx.skip_unfit and est.get("fits") is False:
        row.update(status=SKIPPED, reason=f"--skip-unfit: estimate {fit_text(est)}")
    elif ctx.dry_run:
        print(
            f"        + {shlex.join(to_args(rung.delta))} (estimate {fit_text(est)})\n        $ {shown}",
            flush=True,
        )
        row.update(status=PLANNED, reason="")
        return row
    else:
        row.update(
            run_training(
                argv,
                env=child_env(**extra_env),
                run_dir=ctx.out / "runs" / rung.name,
                log_path=ctx.out / "logs" / f"{rung.name}.log",
                warmup=ctx.warmup,
                timeout_s=ctx.timeout,
            )
        )
    if row.get("tps") is not None:
        row["tps_total"] = row["tps"] * rung.ngpu  # the trainer's tps is per GPU
    ctx.progress.end(rung.name, row)
    return row


def parse_with_overrides(
    ap: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace, list[str]]:
    """Parse the tool's own flags; every other argument is a trainer override (`--section.key value`)."""
    flags = {opt: act.nargs != 0 for act in ap._actions for opt in act.option_strings}
    own: list[str] = []
    overrides: list[str] = []
    rest = iter(argv)
    for arg in rest:
        key = arg.split("=", 1)[0]
        if key in flags:
            value = next(rest, None) if flags[key] and "=" not in arg else None
            own += [arg] if value is None else [arg, value]  # (a missing value: argparse names it)
        else:
            overrides.append(arg)
    return ap.parse_args(own), overrides


def base_settings(config: str | None, code_base: dict[str, str], overrides: list[str]) -> dict[str, str]:
    """The code's base, less what the TOML sets (the TOML wins), then the user's overrides."""
    toml = cfgmod.read_toml(config) if config else {}
    in_toml = {f"{s}.{k}" for s, values in toml.items() for k in values}
    settings = {k: v for k, v in code_base.items() if k not in in_toml}
    for section, key, value in cfgmod.parse_overrides(overrides):
        settings[f"{section}.{key}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return settings
