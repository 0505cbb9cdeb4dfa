"""The end of a run: one block on the console saying what the run did and where everything went, and the
commands that come next (resume or train further, export, generate); the same in `summary.json`.

The trainer fills a `RunSummary` when its loop ends (at training.steps, or stopped by a signal), rank 0
prints `summary_lines` and writes `summary.json` (this attempt's; an earlier attempt's block stays in
console.log). Every command it prints is one that runs as printed, from the directory the run was started
in: the run's own command (as `run_train.sh` was called, `TITANRUSH_LAUNCHER`, or the Python entry point),
with a key changed where the next step needs it, `titanrush convert` and `titanrush generate`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

LAUNCHER_VAR = "TITANRUSH_LAUNCHER"  # how run_train.sh was called (`NGPU=2 ./run_train.sh`), set by it
SUMMARY_FILE = "summary.json"
PROMPT = "The"  # the generate command's prompt: a start any text may have


@dataclasses.dataclass
class RunSummary:
    """What one attempt of a run did (rank 0's view; throughput and memory per device)."""

    attempt: int
    first_step: int  # the first step this attempt trained (1, or the step after the one it resumed from)
    last_step: int  # the last step it finished
    total_steps: int  # training.steps
    stopped_by: str | None  # the signal that stopped it ("SIGTERM"), None where it reached total_steps
    devices: int
    tokens: int  # trained by the whole job in this attempt
    wall_s: float  # from the start of the process
    setup_s: float
    train_s: float  # the training steps' time (validation and checkpoint saves left out), per device
    tps: float | None  # tokens/s per device over train_s
    tflops: float | None
    mfu: float | None
    mfu_note: str  # why there is no MFU, where there is none
    mem_gib: float | None  # peak: the GPU allocator's reserved memory, or the process's RSS on CPU
    mem_pct: float | None
    mem_note: str  # what mem_gib counts
    mem_of: str  # what mem_pct is a share of ("GPU", "host's memory")
    loss: float | None  # the last logged training loss (the mean of its window)
    loss_step: int | None
    validation: list[tuple[int, float]]  # (step, validation loss) of every validation this attempt
    run_dir: Path
    checkpoint: Path | None  # the newest complete checkpoint in the run's checkpoint folder
    resumable: Path | None  # the newest complete full checkpoint (what a resume loads)
    checkpoint_enable: bool
    checkpoint_interval: int
    tensorboard: Path | None
    wandb: str | None  # where the Weights & Biases run went (metrics.wandb), None without one
    console: Path | None
    dense: bool  # a Llama (generate takes it), not a Llama 4
    launcher: str  # how the trainer was started (`command_prefix`), shell words
    args: list[str]  # the trainer's arguments

    @property
    def command(self) -> str:
        """The run's command, as it can be typed again."""
        return command_line(self.launcher, self.args)


def command_prefix(environ: Any = os.environ, argv0: str | None = None, world_size: int = 1) -> str:
    """How the trainer was started, without its arguments: run_train.sh as it was called
    (`LAUNCHER_VAR`), `titanrush train`, or `python -m titanrush.train` (under torchrun: a torchrun line
    for this many processes)."""
    if launcher := environ.get(LAUNCHER_VAR):
        return launcher
    started = Path(sys.argv[0] if argv0 is None else argv0)
    if started.name == "titanrush":
        return "titanrush train"
    if world_size > 1:
        return f"torchrun --standalone --nproc_per_node={world_size} -m titanrush.train"
    python = Path(sys.executable).name
    python = python if shutil.which(python) == sys.executable else shlex.quote(sys.executable)
    if started.parts[-2:] == ("titanrush", "__main__.py"):
        return f"{python} -m titanrush train"
    return f"{python} -m titanrush.train"  # (also where another program called titanrush.train.main)


def command_line(prefix: str, args: list[str]) -> str:
    """A command line: the launcher (shell words already) and its arguments, quoted."""
    return f"{prefix} {shlex.join(args)}" if args else prefix


def with_setting(args: list[str], key: str, value: str | None = None) -> list[str]:
    """`args` with every spelling of `--key` taken out (`--key v`, `--key=v`, `--key`, `--no-key`) and
    `--key value` (`--key` alone for a switch turned on: value None) put at the end."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if name in (key, f"no-{key}"):
            plain = arg == f"--{key}"
            i += 2 if plain and i + 1 < len(args) and not args[i + 1].startswith("--") else 1
            continue
        out.append(arg)
        i += 1
    return [*out, f"--{key}", *([] if value is None else [value])]


def next_commands(s: RunSummary) -> list[tuple[str, str | None]]:
    """(what, its command) for what comes after this run; None where there is no command (`what` says
    why)."""
    plot = ("plot the metrics (into plot.png)", f"titanrush plot {shlex.quote(str(s.run_dir))}")
    return [*_checkpoint_commands(s), plot]


def _checkpoint_commands(s: RunSummary) -> list[tuple[str, str | None]]:
    """Resume or train further, export and generate: what the run's checkpoint is for."""
    if s.checkpoint is None:
        if s.checkpoint_enable:
            every = f"checkpoint.interval = {s.checkpoint_interval}"
            return [
                (f"run again (no checkpoint was saved yet, one every {every} steps: from step 1)", s.command)
            ]
        more = with_setting(s.args, "checkpoint.enable")
        return [("save checkpoints (the same run, with checkpoint.enable)", command_line(s.launcher, more))]
    out: list[tuple[str, str | None]] = []
    if s.resumable is not None and s.stopped_by is not None:
        out.append((f"resume (from {s.resumable.name})", s.command))
    elif s.resumable is not None:
        steps = 2 * s.total_steps
        more = with_setting(s.args, "training.steps", str(steps))
        out.append(
            (f"train further (from {s.resumable.name}, to step {steps})", command_line(s.launcher, more))
        )
    ckpt = shlex.quote(str(s.checkpoint))
    hf = shlex.quote(str(s.run_dir / "hf" / s.checkpoint.name))  # (a folder per step: never refused)
    out.append(("export to a Hugging Face folder", f"titanrush convert --to-hf {ckpt} {hf}"))
    if s.dense:
        prompt = shlex.quote(PROMPT)
        out.append(("generate", f"titanrush generate --checkpoint {ckpt} --prompt {prompt}"))
    else:
        out.append(("generate: dense Llamas only; export, then transformers' Llama4ForCausalLM", None))
    return out


def _duration(seconds: float) -> str:
    """`42.1 s`, `12m05s`, `3h07m`."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 120:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def summary_lines(s: RunSummary) -> list[str]:
    """The console's block: a heading, then one named line per figure or place, then the next commands."""
    count = s.last_step - s.first_step + 1
    if s.stopped_by:
        ended = f"stopped by {s.stopped_by} after step {s.last_step} of {s.total_steps}"
    else:
        ended = f"reached step {s.last_step} (training.steps)"
    span = f"steps {s.first_step}-{s.last_step}" if count > 1 else f"step {s.last_step}"
    trained = f"{count:,} ({span}), {s.tokens:,} tokens" if count else "none (resumed at training.steps)"
    rows = [
        ("steps", trained),
        ("time", f"{_duration(s.wall_s)} (set-up {_duration(s.setup_s)}, training {_duration(s.train_s)})"),
    ]
    job = f" ({s.tps * s.devices:,.0f} for the {s.devices} devices)" if s.devices > 1 and s.tps else ""
    speed = "no step timed" if s.tps is None else f"{s.tps:,.0f} tokens/s per device{job}"
    if s.tflops is not None:
        speed += f", {s.tflops:.3g} TFLOP/s"
    rows.append(("throughput", speed))
    rows.append(("MFU", f"{s.mfu:.1f}%" if s.mfu is not None else f"not known: {s.mfu_note}"))
    if s.mem_gib is not None:
        share = f", {s.mem_pct:.0f}% of the {s.mem_of}" if s.mem_pct is not None else ""
        rows.append(("peak memory", f"{s.mem_gib:.2f} GiB ({s.mem_note}{share})"))
    if s.loss is not None:
        rows.append(("loss", f"{s.loss:.4f} (step {s.loss_step})"))
    if s.validation:
        step, last = s.validation[-1]
        best_step, best = min(s.validation, key=lambda v: (v[1], v[0]))
        rows.append(("validation", f"{last:.4f} (step {step}); best {best:.4f} (step {best_step})"))
    if s.checkpoint is not None:
        rows.append(("checkpoint", str(s.checkpoint)))
    elif s.checkpoint_enable:
        rows.append(("checkpoint", "none saved yet"))
    else:
        rows.append(("checkpoint", "none saved (checkpoint.enable = false)"))
    rows.append(("metrics", str(s.run_dir / "metrics.jsonl")))
    tb = "off (metrics.tensorboard = false)"
    rows.append(
        ("TensorBoard", f"tensorboard --logdir {shlex.quote(str(s.tensorboard))}" if s.tensorboard else tb)
    )
    if s.wandb is not None:
        rows.append(("W&B", s.wandb))
    if s.console is not None:
        rows.append(("console", str(s.console)))
    head = f"run summary: attempt {s.attempt}, {ended}"
    body = [f"  {name:<12} {text}" for name, text in rows]
    nexts = []
    for what, command in next_commands(s):
        nexts += [f"  {what}" + (":" if command else ""), *([f"    {command}"] if command else [])]
    return [head, *body, "next:", *nexts]


def to_json(s: RunSummary) -> dict[str, Any]:
    """summary.json's object: the summary's figures and places, and the next commands by name."""
    data = dataclasses.asdict(s)
    data["validation"] = [{"step": step, "loss": loss} for step, loss in s.validation]
    data["command"] = s.command
    data["next"] = [{"what": what, "command": command} for what, command in next_commands(s)]
    return {k: str(v) if isinstance(v, Path) else v for k, v in data.items()}


def write_summary(s: RunSummary) -> Path:
    """summary.json in the run folder, replaced whole (OSError where it cannot be written)."""
    path = s.run_dir / SUMMARY_FILE
    fresh = path.with_name(SUMMARY_FILE + ".tmp")
    try:
        fresh.write_text(json.dumps(to_json(s), indent=1) + "\n", encoding="utf-8")
        os.replace(fresh, path)
    finally:
        fresh.unlink(missing_ok=True)
    return path
