"""The checkpoint folder on disk: which step folders are complete, moving incomplete ones aside, whether
the folder can be written and the next save fits, and telling a full disk from other write failures.

A `step-<N>` folder is complete when it holds DCP's `.metadata`, `titanrush.json` and, for a checkpoint
saved with one (`titanrush.json` names it), the integrity record with every file it lists. Checkpoints
saved before integrity records, and those `titanrush convert` writes, have none: they are complete with
`.metadata` and `titanrush.json`, and load unverified.

Before a load (`check_folder`), a checkpoint whose small files are damaged is *corrupt*: the record or
titanrush.json unreadable or of another shape (`read_record`, `read_info` check it where they read it),
the record's sizes or the small files' checksums differing, or, without a record, `.metadata` cut short
or a data file shorter than `.metadata` says.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import typing
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from titanrush.checkpoint.integrity import RECORD_FILE, read_checked_json, read_record, verify, whole
from titanrush.config import ConfigError
from titanrush.distributed import all_ranks
from titanrush.files import (
    check_writable,
    first_unreadable,
    free_bytes,
    is_disk_full,
    one_line,
    os_error,
    unreadable_message,
)
from titanrush.models.llama import ModelArgs
from titanrush.models.llama4 import Llama4Args

logger = logging.getLogger("titanrush")
STEP_DIR = re.compile(r"^step-(\d+)$")
INFO_FILE = "titanrush.json"
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class StepFolder:
    """One `step-<N>` folder: its step, whether it holds only weights, and what it lacks ('' if none)."""

    step: int
    path: Path
    model_only: bool
    missing: str

    @property
    def complete(self) -> bool:
        return not self.missing


def read_info(path: Path) -> dict[str, Any] | None:
    """The folder's titanrush.json, None where it has none. Its shape is checked here (the fields a load
    reads, where present, of the types they are saved with), so what reads it need not.

    Raises:
        ValueError: titanrush.json exists but cannot be read, is not JSON or not of this shape; the message
            starts with the file's name and says what is wrong.
    """
    return read_checked_json(path / INFO_FILE, info_problem)


# titanrush.json's fields that loading reads, and their types (each may be absent: older saves, imports).
_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "model_only": (bool,),
    "world_size": (int,),
    "integrity": (str,),
    "optimizer": (str,),
    "flavor": (str,),
    "dtype": (str,),
    "torch": (str,),
    "model_args": (dict,),
    "schedule": (dict, type(None)),
}


_KIND = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "true or false",
    type(None): "null",
    int: "a whole number",
    float: "a number",
}


def _fits(value: Any, types: tuple[Any, ...]) -> bool:
    """Whether a JSON value is of one of `types` (true and false are no int; an int is a float)."""
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return any(isinstance(value, t) and t is not bool for t in types)


def _wrong(key: str, value: Any, types: tuple[Any, ...]) -> str:
    """'has <key> <value> (<its kind>), not <the kind it must be>', or '' where it is of one of types."""
    if _fits(value, types):
        return ""
    return f"has {key} {json.dumps(value)[:60]} ({_KIND.get(type(value), 'a number')}), not {_KIND[types[0]]}"


def info_problem(info: Any) -> str:
    """What makes `info` not a titanrush.json as a save writes one ('' if nothing): the fields that
    loading reads, where present, of the types they are saved with, the model arguments those of
    `ModelArgs` (`Llama4Args`); fields it does not know are not checked."""
    if not isinstance(info, dict):
        return f"is not a JSON object (it holds {_KIND.get(type(info), 'a number')})"
    for key, types in _INFO_TYPES.items():
        if key in info and (wrong := _wrong(key, info[key], types)):
            return wrong
    if info.get("step", 0) < 0:
        return f"has step {info['step']}, below 0"
    if info.get("world_size", 1) < 1:
        return f"has world_size {info['world_size']}, below 1"
    args = info.get("model_args") or {}
    hints = typing.get_type_hints(Llama4Args if "n_experts" in args else ModelArgs)
    for key, value in args.items():
        types = (typing.get_args(hints[key]) or (hints[key],)) if key in hints else ()
        if types and all(t in _KIND for t in types) and (wrong := _wrong(f"model_args.{key}", value, types)):
            return wrong  # (a field of another type than JSON's, or one this code does not know: unchecked)
    return ""


def data_problems(path: Path) -> list[str]:
    """For a checkpoint without an integrity record: `.metadata` unreadable for damage (cut short, not a
    pickle), and data files missing or shorter than `.metadata` places data in them; [] where nothing is
    seen (`.metadata` unreadable for another reason, another torch's, is for the load to name)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except (EOFError, pickle.UnpicklingError) as e:
        return [f".metadata cannot be read ({one_line(e)})"]
    except Exception:  # noqa: BLE001 - not damage that can be named here: the load names it
        return []
    if not isinstance(metadata, Metadata):
        return [f".metadata does not hold DCP's index (it unpickles to a {type(metadata).__name__})"]
    ends: dict[str, int] = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        name, offset, length = (getattr(item, k, None) for k in ("relative_path", "offset", "length"))
        if isinstance(name, str) and whole(offset) and whole(length):
            ends[name] = max(ends.get(name, 0), offset + length)
    problems = []
    for name, end in sorted(ends.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing (.metadata places data in it)")
            continue
        if size < end:
            problems.append(f"{name} has {size:,} bytes, .metadata places data up to byte {end:,}")
    return problems


def inspect(path: Path) -> StepFolder:
    """What a step folder is and lacks (looks at names and the record's file list; reads no data). A
    titanrush.json or integrity record that cannot be read counts as present: loading calls it corrupt."""
    m = STEP_DIR.match(path.name)
    step = int(m.group(1)) if m else -1
    if not (path / ".metadata").is_file():
        return StepFolder(step, path, False, ".metadata (DCP's index of the tensors)")
    try:
        info = read_info(path)
    except ValueError:
        info = {}
    if info is None:
        return StepFolder(step, path, False, INFO_FILE)
    model_only = bool(info.get("model_only"))
    if info.get("integrity"):
        if not (path / RECORD_FILE).is_file():
            return StepFolder(step, path, model_only, f"{RECORD_FILE} (the integrity record)")
        try:
            files = (read_record(path) or {}).get("files", {})
        except ValueError:
            files = {}
        gone = sorted(name for name in files if not (path / name).is_file())
        if gone:
            return StepFolder(step, path, model_only, ", ".join(gone[:3]) + (" ..." if len(gone) > 3 else ""))
    return StepFolder(step, path, model_only, "")


def scan(folder: Path) -> list[StepFolder]:
    """Every `step-<N>` folder in folder, oldest first."""
    if not folder.is_dir():
        return []
    found = [inspect(p) for p in folder.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda s: s.step)


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in folder (full or model-only), oldest first."""
    return [(s.step, s.path) for s in scan(folder) if s.complete]


def move_aside(path: Path, tag: str) -> Path:
    """Rename `path` to `<name>.<tag>-<n>` (the first free n), so that nothing is deleted."""
    n = 1
    while (target := path.with_name(f"{path.name}.{tag}-{n}")).exists():
        n += 1
    os.replace(path, target)
    return target


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


def unreadable_error(e: OSError, folder: Path | None = None) -> str:
    """The refusal of a checkpoint that this user may not read, `e` the permission failure met in it: the
    path, and the fix for the step folder that holds it (else for `folder`, else for the path)."""
    path = Path(e.filename or folder or ".")
    step = next((p for p in [path, *path.parents] if STEP_DIR.match(p.name)), folder or path)
    first = first_unreadable(step) if step.is_dir() else None  # (the folder itself, where it is that)
    return f"checkpoint {step} cannot be loaded: {unreadable_message(first or e, step)}"


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


def choose(folder: Path | None, load_path: str, model_only: bool) -> dict[str, Any]:
    """Rank 0, at start: which checkpoint to load ({} for none, {"error": ...} for a refusal), moving the
    run's incomplete step folders aside. `folder` is the run's checkpoint folder (None: checkpoints off).

    The run's newest full checkpoint wins over `load_path`; model-only exports newer than it are passed
    over (said); a run with only exports is refused with the command that starts a new run from them.
    """
    found = scan(folder) if folder is not None else []
    for partial in sorted(folder.glob("step-*.tmp")) if folder is not None and folder.is_dir() else []:
        shutil.rmtree(partial, ignore_errors=True)  # never loadable: only disk space
        logger.info(f"removed {partial}, a save that did not finish (the run stopped while writing it)")
    for s in found:
        if not s.complete:
            moved = move_aside(s.path, "incomplete")
            logger.warning(
                f"checkpoint {s.path} is incomplete (it lacks {s.missing}; a save that did not finish, or a "
                f"partial copy): moved aside to {moved.name}; resuming from the newest complete one"
            )
    return decide([s for s in found if s.complete], folder, load_path, model_only)


def decide(done: list[StepFolder], folder: Path | None, load_path: str, model_only: bool) -> dict[str, Any]:
    """`choose`'s decision from the run's complete step folders `done`, without changing the disk (also
    what `titanrush.train --check` asks)."""
    full = [s for s in done if not s.model_only]
    if full:
        newer = [s for s in done if s.model_only and s.step > full[-1].step]
        if newer:
            logger.info(
                f"{newer[-1].path.name} holds only model weights (checkpoint.last_save_model_only): resuming "
                f"the full state from {full[-1].path.name}, the newest full checkpoint"
            )
        if load_path:
            logger.info(f"checkpoint.load_path is not used: this run resumes from its own {full[-1].path}")
        return {"path": str(full[-1].path), "model_only": False, "own": True}
    if done and not load_path:
        names = ", ".join(s.path.name for s in done)
        return {
            "error": f"{folder} holds only model-only checkpoints ({names}; checkpoint.last_save_model_only) "
            "and no full one, so this run cannot be resumed or extended: its optimizer state and data "
            "position were not saved. To train on from these weights as a new run: --job.name <new name> "
            f"--checkpoint.load_path {done[-1].path} --checkpoint.load_model_only (and leave "
            "checkpoint.last_save_model_only off to keep a full checkpoint next time)"
        }
    if not load_path:
        return {}
    path = Path(load_path)
    inside = scan(path) if STEP_DIR.match(path.name) is None else []
    if not inside and STEP_DIR.match(path.name) is None and path.is_dir():
        nested = sorted(d for d in path.iterdir() if d.is_dir() and scan(d))
        if nested:  # a run folder
            return {
                "error": f"checkpoint.load_path {path} holds no step-<N> folder; its checkpoints are in "
                f"{nested[0]}: name that folder (its newest complete checkpoint is taken) or one of its steps"
            }
    if inside:  # a checkpoint folder: take its newest complete (full, unless only the weights are asked)
        done = [s for s in inside if s.complete]
        candidates = done if model_only else [s for s in done if not s.model_only] or done
        if not candidates:
            lacking = "; ".join(f"{s.path.name} lacks {s.missing}" for s in inside[-3:])
            return {
                "error": f"checkpoint.load_path {path} holds no complete checkpoint ({lacking}); name one"
            }
        path = candidates[-1].path
    return {"path": str(path), "model_only": model_only, "own": False}


def elsewhere(path: Path, own: bool) -> str:
    """Where to resume from instead of a bad checkpoint, in words that work: for the run's own checkpoint
    moving it aside (the run then takes the newest earlier one), for checkpoint.load_path another path."""
    step = int(m.group(1)) if (m := STEP_DIR.match(path.name)) else None
    earlier = [
        s
        for s in scan(path.parent)
        if s.complete and not s.model_only and s.path != path and (step is None or s.step < step)
    ]
    aside = f"mv {path} {path}.bad"
    if own and earlier:
        return (
            f"resume from {earlier[-1].path.name}, the newest earlier complete checkpoint, by moving this "
            f"one aside ({aside}) or deleting it"
        )
    if own:
        return f"no earlier complete checkpoint exists: move it aside ({aside}) to start over"
    if earlier:
        return (
            f"resume from {earlier[-1].path} with --checkpoint.load_path {earlier[-1].path}, or move this one"
        )
    return "no earlier complete checkpoint is beside it; choose another checkpoint.load_path"


def prepare_save(folder: Path, final: Path, tmp: Path, step: int, last: Path | None) -> str:
    """Rank 0, before a save: warn when it may not fit, clear its way; the error, '' if none.

    An export (model-only) or an incomplete folder in the way is moved aside, never deleted; a full
    checkpoint in the way is refused (it is never overwritten)."""
    if warning := space_warning(folder, last, step):
        logger.warning(warning)
    if final.exists():
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


def check_folder(path: Path, *, own: bool, model_only: bool, steps: int | None) -> dict[str, Any]:
    """Before a load: the folder exists, is complete, holds what is asked for, and is not past
    training.steps (`steps`); returns its titanrush.json ({} where it has none).

    Raises:
        ConfigError: saying incomplete, corrupt or what else is wrong, and what to do.
    """
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"checkpoint folder {path} {what}; check checkpoint.load_path")
    if (denied := first_unreadable(path)) is not None:  # (a permission is no damage: never "corrupt")
        raise ConfigError(unreadable_error(denied, path))
    if (path / "config.json").exists() and not (path / INFO_FILE).exists():
        raise ConfigError(
            f"{path} is a Hugging Face model folder, not a titanrush checkpoint: import it first (titanrush "
            f"convert --from-hf {path} OUT_DIR) and start from OUT_DIR (titanrush convert prints the flags)"
        )
    state = inspect(path)
    if not state.complete:
        raise ConfigError(
            f"checkpoint {path} is incomplete: it lacks {state.missing} (a save that did not finish, or "
            f"a partial copy); {elsewhere(path, own)}"
        )
    # The small files before anything reads them: the record's sizes and the one-block files' checksums
    # (verify_files checks every block after), or without a record the data files' lengths.
    try:
        record = read_record(path)
        problems = verify(path, record, quick=True) if record is not None else data_problems(path)
        saved = {} if problems else read_info(path) or {}
    except ValueError as e:  # the record or titanrush.json, unreadable or not of its shape
        problems, saved = [str(e)], {}
    if problems:
        raise ConfigError(f"checkpoint {path} is corrupt: {summarize(problems)}; {elsewhere(path, own)}")
    if not model_only and (named := step_name_problem(path, saved)):
        raise ConfigError(named)
    if saved.get("model_only") and not model_only:
        raise ConfigError(
            f"checkpoint {path} holds only model weights; add --checkpoint.load_model_only to start a "
            "new run from them"
        )
    if steps is not None and not model_only and saved.get("step", -1) > steps:
        within = [s for s in scan(path.parent) if s.complete and not s.model_only and s.step <= steps]
        other = (
            f"; to stop at {within[-1].path.name} instead, start a new run from it: --job.name <new name> "
            f"--checkpoint.load_path {within[-1].path}"
            if within
            else ""
        )
        raise ConfigError(
            f"the checkpoint at step {saved['step']} ({path}) is past training.steps = {steps}: raise "
            f"training.steps above {saved['step']} to continue{other}"
        )
    return saved


def step_name_problem(path: Path, saved: dict[str, Any]) -> str:
    """Where a `step-<N>` folder holds another step than N (a renamed or copied folder), the refusal: it
    would resume after its own step and then meet its name at the save of step N."""
    m = STEP_DIR.match(path.name)
    step = saved.get("step")
    if m is None or step is None or int(m.group(1)) == step:
        return ""
    right = path.with_name(f"step-{step}")
    fix = (
        f"move it aside (mv {path} {path}.bad): {right.name} exists beside it"
        if right.exists()
        else f"rename it back (mv {path} {right})"
    )
    return (
        f"checkpoint {path} holds step {step} (its {INFO_FILE}), not step {m.group(1)} as its name says: the "
        f"folder was renamed or copied; {fix}"
    )


def verify_files(path: Path, *, own: bool, rank: int, world_size: int) -> bool:
    """Check the files against the integrity record, each rank its share, all ranks raising the same
    error; False where the checkpoint has no record (said once).

    Raises:
        ConfigError: "checkpoint ... is corrupt: <file> bytes ... differ ...; resume from ...".
    """
    try:
        record = read_record(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: {e}; {elsewhere(path, own)}") from None
    if record is None:
        if rank == 0:
            logger.warning(
                f"checkpoint {path} has no integrity record (saved by an older titanrush, or by "
                "`titanrush convert`): its bytes are not verified"
            )
        return False
    problems = all_ranks(verify(path, record, rank=rank, world_size=world_size))
    if problems:
        raise ConfigError(f"checkpoint {path} is corrupt: {summarize(problems)}; {elsewhere(path, own)}")
    return True


def summarize(problems: list[str], limit: int = 3) -> str:
    """The first `limit` problems and how many more, for a one-line message."""
    more = len(problems) - limit
    return "; ".join(problems[:limit]) + (f"; and {more} more" if more > 0 else "")
