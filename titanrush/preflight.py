"""What `titanrush train --check` verifies beyond the config's values (`titanrush.validate`): that the
run's inputs exist and its outputs can be written, before any process starts.

`run_train.sh` runs the check once before launching several processes, so that a missing data path or
checkpoint, or an unwritable folder, is one line and exit status 2 instead of an error on every rank
under the launcher. Each check calls what the trainer itself runs at start-up (the run folder's,
the checkpoint folder's and the data loader's checks), so the two cannot disagree. Nothing is written but
the token cache, which the run then reads.
"""

from __future__ import annotations

from pathlib import Path

from titanrush import run_dir
from titanrush.checkpoint_folder import check_folder, decide, scan, unwritable_error
from titanrush.config import ConfigError, JobConfig
from titanrush.data import build_dataloader, build_tokenizer
from titanrush.plan import RunPlan


def check_files(cfg: JobConfig, plan: RunPlan) -> None:
    """Raise the ConfigError the run would stop with at start-up over its folders, checkpoint or data."""
    folder = Path(cfg.job.dump_folder) / cfg.job.name
    if error := run_dir.problem(folder, overwrite=cfg.job.overwrite):
        raise ConfigError(error)
    ck = cfg.checkpoint
    ck_folder = folder / ck.folder if ck.enable else None
    if ck_folder is not None and (error := unwritable_error(ck_folder)):
        raise ConfigError(error)
    done = [s for s in scan(ck_folder) if s.complete] if ck_folder is not None else []
    choice = decide(done, ck_folder, ck.load_path, ck.load_model_only)
    if choice.get("error"):
        raise ConfigError(choice["error"])
    if choice.get("path"):
        path, own = Path(choice["path"]), choice["own"]
        check_folder(path, own=own, model_only=choice["model_only"], steps=cfg.training.steps)
    loader_args = dict(
        tokenizer=build_tokenizer(cfg.data.tokenizer),
        seq_len=plan.seq_len,
        local_batch_size=plan.local_batch,
        dp_degree=plan.dp,
        seed=cfg.training.seed,
        vocab_size=plan.args.vocab_size,
    )
    build_dataloader(cfg.data, split="train", **loader_args)
    if cfg.validation.freq:
        build_dataloader(cfg.data, split="validation", **loader_args)
