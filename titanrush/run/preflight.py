"""What `titanrush train --check` verifies beyond the config's values (`titanrush.run.validate`): that the
run's inputs exist and its outputs can be written, before any process starts.

The launcher (`titanrush.run.launch`) runs the check once before it starts several processes, so that a
missing data path or checkpoint, or an unwritable folder, is one line and exit status 2 instead of an
error on every rank. Each check calls what the trainer itself runs at start-up (the run folder's,
the checkpoint folder's and the data loader's checks), so the two cannot disagree. Nothing is written but
the token cache, which the run then reads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titanrush.checkpoint.choose import check_folder, decide, elsewhere, incomplete, verify_files
from titanrush.checkpoint.compat import check_compatible, load_failure
from titanrush.checkpoint.folder import scan, unreadable_error
from titanrush.checkpoint.integrity import read_record
from titanrush.checkpoint.space import unwritable_error
from titanrush.checkpoint.state import ObjectState
from titanrush.config import ConfigError, JobConfig
from titanrush.data import build_dataloader, build_tokenizer
from titanrush.data.fingerprint import fingerprint
from titanrush.data.tokenizer import tokenizer_path
from titanrush.distributed import from_rank0
from titanrush.run import run_dir
from titanrush.run.plan import RunPlan


def check_files(cfg: JobConfig, plan: RunPlan) -> list[str]:
    """Raise the ConfigError the run would stop with at start-up over its folders, checkpoint or data; the
    warnings it would give about them."""
    folder = Path(cfg.job.dump_folder) / cfg.job.name
    if error := run_dir.problem(folder, overwrite=cfg.job.overwrite) or run_dir.in_use(folder):
        raise ConfigError(error)
    ck = cfg.checkpoint
    ck_folder = folder / ck.folder if ck.enable else None
    if ck_folder is not None and (error := unwritable_error(ck_folder)):
        raise ConfigError(error)
    try:
        found = scan(ck_folder) if ck_folder is not None else []
    except PermissionError as e:
        raise ConfigError(unreadable_error(e)) from None
    done = [s for s in found if s.complete]
    choice = decide(done, ck_folder, ck.load_path, ck.load_model_only)
    if choice.get("error"):
        raise ConfigError(choice["error"])
    if not choice.get("path"):
        then = "start from step 0"
    elif choice["own"]:
        then = f"resume from {Path(choice['path']).name}"
    else:
        then = ("load the weights of " if choice["model_only"] else "resume from ") + choice["path"]
    warnings = [
        f"{incomplete(s)}: the run will move it aside to {s.path.name}.incomplete-<n> and {then}"
        for s in found
        if not s.complete
    ]
    loader_args = dict(
        tokenizer=build_tokenizer(cfg.data.tokenizer),
        seq_len=plan.seq_len,
        local_batch_size=plan.local_batch,
        dp_degree=plan.dp,
        seed=cfg.training.seed,
        vocab_size=plan.args.vocab_size,
    )
    loader = build_dataloader(cfg.data, split="train", **loader_args)
    if cfg.validation.freq:
        build_dataloader(cfg.data, split="validation", **loader_args)
    if choice.get("path"):
        path, own, model_only = Path(choice["path"]), choice["own"], choice["model_only"]
        saved = check_folder(path, own=own, model_only=model_only, steps=cfg.training.steps)
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001 - classified as the trainer's load does
            raise load_failure(path, e, verified=False, saved=saved, hint=elsewhere(path, own)) from None
        states = {} if model_only else {"dataloader": ObjectState(loader)}
        info = checkpoint_info(cfg, plan)
        try:  # (reads the data loader's saved objects)
            check_compatible(
                path,
                metadata,
                saved,
                info,
                states,
                own=own,
                model_only=model_only,
                tensors=False,
                allow_data_change=cfg.data.allow_changed,
            )
        except CheckpointException as e:  # DCP's read failed: worded as the trainer's load words it,
            recorded = read_record(path) is not None  # after checking every block against the record
            verified = recorded and verify_files(path, own=own, rank=0, world_size=1)
            raise load_failure(path, e, verified=verified, saved=saved, hint=elsewhere(path, own)) from None
    return warnings


def checkpoint_info(cfg: JobConfig, plan: RunPlan) -> dict[str, Any]:
    """What each checkpoint's titanrush.json says of its run (its tokenizer file too, for an export), and
    what a load compares with this run's.
    (The RoPE table's length and context parallel's K/V expansion are this run's, not the model's: a model
    rebuilt from the checkpoint gets the full table and grouped K/V heads; a resume names the schedule
    settings that changed since the save; `data`, the train data's fingerprint, which a resume compares.)"""
    args = dataclasses.replace(plan.args, rope_positions=0, expand_kv=False)
    schedule = {f"lr_scheduler.{k}": v for k, v in dataclasses.asdict(cfg.lr_scheduler).items()}
    spec = cfg.data.tokenizer
    return {
        "flavor": cfg.model.flavor,
        "model_args": dataclasses.asdict(args),
        "optimizer": cfg.optimizer.name,
        "schedule": {"training.steps": cfg.training.steps} | schedule,
        # the tokenizer file itself, absolute: an export finds it from any folder (data.tokenizer in
        # config.toml may be relative to where the run started)
        "tokenizer": spec if spec == "default" else str(tokenizer_path(spec).resolve()),
        "data": data_fingerprint(cfg),
    }


def data_fingerprint(cfg: JobConfig) -> dict[str, Any] | None:
    """The train data's fingerprint (`titanrush.data.fingerprint`), taken by rank 0 alone: it writes
    titanrush.json and compares on a resume (its finding reaches every rank), and a thousand ranks
    reading the same blocks would only load the file system. None on the other ranks, and where no
    checkpoint is saved or resumed. Every rank calls it: a file rank 0 cannot read stops every rank."""
    ck = cfg.checkpoint
    if not (ck.enable or (ck.load_path and not ck.load_model_only)):
        return None
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    record, error = None, ""
    if rank0:
        try:
            record = fingerprint(cfg.data)
        except ConfigError as e:
            error = str(e)
    if error := from_rank0(error):
        raise ConfigError(error)
    return record
