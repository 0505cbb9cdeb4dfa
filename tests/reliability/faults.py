"""Helpers of the reliability tests: the shrunk debug run, training in this process, and what a folder
holds (to show that a failure touched nothing).

A run trains a model of one small layer (TINY) on synthetic tokens (no corpus to read) at seq_len 32 and
local batch 2.
"""

from __future__ import annotations

from pathlib import Path

BASE = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--data.dataset",
    "synthetic",
    "--metrics.log_freq",
    "1",
    "--no-metrics.tensorboard",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.gc_freq",
    "0",
]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
# A model of one small layer (its checkpoints are ~7 MB): what the runs train, unless a test says otherwise.
TINY = [
    "--model.flavor",
    "custom",
    "--model.dim",
    "32",
    "--model.n_layers",
    "1",
    "--model.n_heads",
    "2",
    "--model.n_kv_heads",
    "1",
    "--model.vocab_size",
    "8192",
]


def run_args(dump: Path, name: str, steps: int, *extra: str) -> list[str]:
    """The shrunk run `dump/name` of `steps` steps, of the TINY model; `extra` last (it wins)."""
    return [
        *("--job.dump_folder", str(dump), "--job.name", name, "--training.steps", str(steps)),
        *BASE,
        *TINY,
        *extra,
    ]


def build(argv: list[str]):  # -> Trainer (imported late: the fixtures set the environment first)
    from titanrush import config, distributed
    from titanrush.run.plan import build_plan
    from titanrush.trainer import Trainer

    cfg = config.load(None, argv)
    return Trainer(cfg, build_plan(cfg, distributed.ranks_from_env().world_size))


def train(argv: list[str], stop_at: int | None = None) -> list[float]:
    """Build, train (to `stop_at`, as if cut off there) and close a run; its logged losses."""
    trainer = build(argv)
    try:
        return trainer.train(stop_at)
    finally:
        trainer.close()


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime in ns)} of every file under folder."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def assert_one_line(message: str) -> None:
    """A message for people: one line, no traceback pasted into it."""
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message, message
