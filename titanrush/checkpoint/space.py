"""A save's room on disk: whether the checkpoint folder can be written and the next save fits, clearing
a save's way (what is in it moved aside, a full checkpoint never overwritten), and telling a full disk
from other write failures, in messages that say what was kept and what to do.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from titanrush.checkpoint.folder import inspect, move_aside, scan
from titanrush.files import check_writable, free_bytes, is_disk_full, os_error

logger = logging.getLogger("titanrush")
GiB = 2**30


def folder_bytes(path: Path) -> int:
    """Bytes of the files under path."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def unwritable_error(folder: Path) -> str:
    """The refusal of a checkpoint folder that cannot be written ('' if it can)."""
    error = check_writable(folder)
    return error and (
        f"checkpoint.folder: {error}, so no checkpoint could be saved; choose a writable "
        "checkpoint.folder (relative to the run folder, or absolute), fix its permissions, or "
        "--no-checkpoint.enable"
    )


def space_warning(folder: Path, last: Path | None, next_step: int) -> str:
    """A warning when the disk cannot hold another checkpoint the size of the last one ('' if it can)."""
    if last is None or not last.is_dir():
        return ""
    need = folder_bytes(last)
    free = free_bytes(folder)
    if free >= need:
        return ""
    return (
        f"the disk of {folder} has {free / GiB:.2f} GiB free and the last checkpoint ({last.name}) took "
        f"{need / GiB:.2f} GiB: the next save (step {next_step}) will not fit. Free space, set "
        "checkpoint.keep_latest_k (old checkpoints are pruned only after a save completes) or move "
        "checkpoint.folder to a larger disk"
    )


def prepare_save(folder: Path, final: Path, tmp: Path, step: int, last: Path | None) -> str:
    """Rank 0, before a save: warn when it may not fit, clear its way; the error, '' if none.

    An export (model-only) or an incomplete folder in the way is moved aside, never deleted; a full
    checkpoint in the way is refused (it is never overwritten)."""
    if warning := space_warning(folder, last, step):
        logger.warning(warning)
    if os.path.lexists(final) and not final.is_dir():  # (a file, or a link to one or to nothing)
        what = (
            f"a link to {os.readlink(final)}, {'not a folder' if final.exists() else 'which does not exist'}"
            if final.is_symlink()
            else "a file"
        )
        moved = move_aside(final, "not-a-checkpoint")
        logger.warning(
            f"{final.name} is {what}, in the way of this run's save at step {step}: kept as {moved.name}"
        )
    elif final.exists():
        state = inspect(final)
        if state.complete and not state.model_only:
            return (
                f"checkpoint {final} already exists and is never overwritten (is another run writing into "
                f"{folder}?); move it aside, or give this run another checkpoint.folder"
            )
        tag = "model-only" if state.complete else "incomplete"
        moved = move_aside(final, tag)
        logger.warning(
            f"{final.name} ({tag}) is in the way of this run's save at step {step}: kept as {moved.name}"
        )
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        return save_failure(e, folder, tmp, step, last)
    return ""


def save_failure(e: BaseException, folder: Path, tmp: Path, step: int, last: Path | None) -> str:
    """The message for a failed save ('' for a failure that is no storage problem: a bug, to be shown).
    Call before the partial folder is removed: a full disk shows in its free space."""
    need = folder_bytes(last) if last is not None and last.is_dir() else 0
    full = is_disk_full(e, folder, need)
    err = os_error(e)
    if not full and err is None:
        return ""
    earlier = [s for s in scan(folder) if s.complete and not s.model_only]
    kept = (
        f"earlier checkpoints are untouched (newest: {earlier[-1].path.name})"
        if earlier
        else "none was earlier"
    )
    then = f"then relaunch: the run resumes from {earlier[-1].path.name}" if earlier else "then relaunch"
    if full:
        size = f"; the last checkpoint took {need / GiB:.2f} GiB" if need else ""
        return (
            f"checkpoint step-{step} could not be written: the disk of {folder} is full "
            f"({free_bytes(folder) / GiB:.2f} GiB free{size}). The partial {tmp.name} was removed; {kept}. "
            f"Free space, lower checkpoint.keep_latest_k or set checkpoint.folder to a larger disk, {then}"
        )
    where = err.filename or folder
    return (
        f"checkpoint step-{step} could not be written ({err.strerror}: {where}). The partial {tmp.name} was "
        f"removed; {kept}. Make {folder} writable or set checkpoint.folder to another place, {then}"
    )
