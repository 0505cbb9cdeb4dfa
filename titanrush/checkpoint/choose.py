"""Which checkpoint a run loads, and whether it can: at start, the run's newest complete checkpoint or
`checkpoint.load_path` (`choose`, `decide`, which `titanrush train --check` also asks); before a load,
the folder complete and its small files undamaged (`check_folder`), then every file against the
integrity record (`verify_files`); for a bad one, where to resume from instead (`elsewhere`).

Before a load (`check_folder`), a checkpoint whose small files are damaged is *corrupt*: the record or
titanrush.json unreadable or of another shape (`read_record`, `read_info` check it where they read it),
the record's sizes or the small files' checksums differing, or, without a record, `.metadata` cut short
or a data file shorter than `.metadata` says.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from titanrush.checkpoint.folder import (
    INFO_FILE,
    STEP_DIR,
    StepFolder,
    data_problems,
    inspect,
    move_aside,
    read_info,
    scan,
    summarize,
    unreadable_error,
)
from titanrush.checkpoint.integrity import read_record, verify
from titanrush.config import ConfigError
from titanrush.distributed import all_ranks
from titanrush.files import first_unreadable

logger = logging.getLogger("titanrush")


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
                f"{incomplete(s)}: moved aside to {moved.name}; resuming from the newest complete one"
            )
    return decide([s for s in found if s.complete], folder, load_path, model_only)


def incomplete(s: StepFolder) -> str:
    """`checkpoint <path> is incomplete (it lacks ...)`: the start of what is said of a step folder that
    `choose` moves aside (and `--check` says it will)."""
    return (
        f"checkpoint {s.path} is incomplete (it lacks {s.missing}; a save that did not finish, or a partial "
        "copy)"
    )


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
    try:
        problems = _quick_problems(path)
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


def elsewhere(path: Path, own: bool) -> str:
    """Where to resume from instead of a bad checkpoint, in words that work: for the run's own checkpoint
    moving it aside (the run then takes the newest earlier one), for checkpoint.load_path another path."""
    step = int(m.group(1)) if (m := STEP_DIR.match(path.name)) else None
    earlier = [
        s
        for s in scan(path.parent)
        if s.complete and not s.model_only and s.path != path and (step is None or s.step < step)
    ]
    # The newest earlier one whose sizes and small files are sound: a damaged disk often took several.
    damaged = []
    while earlier and _damaged(earlier[-1].path):
        damaged.append(earlier.pop().path)
    also = f" ({', '.join(d.name for d in damaged)} {'is' if len(damaged) == 1 else 'are'} damaged too)"
    also = also if damaged else ""
    bad = [path, *damaged] if own else [path]
    aside = "; ".join(f"mv {b} {b}.bad" for b in bad)
    these = "these" if len(bad) > 1 else "this one"
    if own and earlier:
        return (
            f"resume from {earlier[-1].path.name}, the newest earlier sound checkpoint{also}, by moving "
            f"{these} aside ({aside}) or deleting {'them' if len(bad) > 1 else 'it'}"
        )
    if own:
        return f"no earlier sound checkpoint exists{also}: move {these} aside ({aside}) to start over"
    if earlier:
        return (
            f"resume from {earlier[-1].path}{also} with --checkpoint.load_path {earlier[-1].path}, or move "
            "this one"
        )
    return f"no earlier sound checkpoint is beside it{also}; choose another checkpoint.load_path"


def _quick_problems(path: Path) -> list[str]:
    """The quick check of a checkpoint folder before anything reads it: the record's sizes and the one-block
    files' checksums (`verify_files` checks every block after), or without a record the data files'
    lengths. Raises ValueError where the record cannot be read or is not of its shape."""
    record = read_record(path)
    return verify(path, record, quick=True) if record is not None else data_problems(path)


def _damaged(path: Path) -> bool:
    """Whether the quick check refuses the checkpoint at `path` (or cannot read it)."""
    try:
        return bool(_quick_problems(path))
    except (OSError, ValueError):
        return True
