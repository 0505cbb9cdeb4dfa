"""The checkpoint folder's layout: the `step-<N>` folders in it, what each holds and lacks, and moving
one aside (renamed, never deleted).

A `step-<N>` folder is complete when it holds DCP's `.metadata`, `titanrush.json` and, for a checkpoint
saved with one (`titanrush.json` names it), the integrity record with every file it lists. Checkpoints
saved before integrity records, and those `titanrush convert` writes, have none: they are complete with
`.metadata` and `titanrush.json`, and load unverified.

What reads these files checks them here: `read_info` titanrush.json's shape (`info_problem`),
`data_problems` the data files' lengths against `.metadata` for a checkpoint without a record. Which
checkpoint to load and whether it can be is `choose`'s job; a save's room on disk is `space`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import typing
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from titanrush.checkpoint.integrity import RECORD_FILE, read_checked_json, read_record, whole
from titanrush.files import first_unreadable, one_line, unreadable_message
from titanrush.models.llama import ModelArgs
from titanrush.models.llama4 import Llama4Args

STEP_DIR = re.compile(r"^step-(\d+)$")
INFO_FILE = "titanrush.json"


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
    "data": (dict, type(None)),
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
    while os.path.lexists(target := path.with_name(f"{path.name}.{tag}-{n}")):  # (a kept link too)
        n += 1
    os.replace(path, target)
    return target


def unreadable_error(e: OSError, folder: Path | None = None) -> str:
    """The refusal of a checkpoint that this user may not read, `e` the permission failure met in it: the
    path, and the fix for the step folder that holds it (else for `folder`, else for the path)."""
    path = Path(e.filename or folder or ".")
    step = next((p for p in [path, *path.parents] if STEP_DIR.match(p.name)), folder or path)
    first = first_unreadable(step) if step.is_dir() else None  # (the folder itself, where it is that)
    return f"checkpoint {step} cannot be loaded: {unreadable_message(first or e, step)}"


def summarize(problems: list[str], limit: int = 3) -> str:
    """The first `limit` problems and how many more, for a one-line message."""
    more = len(problems) - limit
    return "; ".join(problems[:limit]) + (f"; and {more} more" if more > 0 else "")
