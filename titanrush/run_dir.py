"""The run folder `<job.dump_folder>/<job.name>`: checked before the run is built, written once accepted.

Rank 0 does the file work and every rank gets its outcome (`distributed.from_rank0`), so that a refused
folder stops every rank with the same message. Nothing is created or written while the run can still be
refused: `check` only looks, `create` makes the folder and records the resolved config (`config.toml`)
after the model is built and any checkpoint has loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from titanrush.config import ConfigError
from titanrush.distributed import from_rank0

CONFIG_FILE = "config.toml"


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check(path: Path, *, overwrite: bool, rank: int) -> None:
    """Refuse a folder the run cannot use, before anything is written (every rank calls this).

    Raises:
        ConfigError: The folder exists and `job.overwrite` is false, is a file, or cannot be written.
    """
    error = ""
    if rank == 0:
        if path.exists() and not path.is_dir():
            error = f"run folder {path} is a file; choose another job.name or job.dump_folder"
        elif path.exists() and not overwrite:
            error = f"run folder {path} exists and job.overwrite = false; choose another job.name"
        else:
            parent = _existing_parent(path)
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                error = (
                    f"cannot write the run folder {path} ({parent} is not a writable folder); choose "
                    "another job.dump_folder"
                )
    error = from_rank0(error)
    if error:
        raise ConfigError(error)


def create(path: Path, config_text: str, *, rank: int) -> None:
    """Make the folder and write the run's resolved config into it (every rank calls this).

    Raises:
        ConfigError: The folder or the config file cannot be written.
    """
    error = ""
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / CONFIG_FILE).write_text(config_text)
        except OSError as e:
            error = f"cannot write the run folder {path} ({e}); choose another job.dump_folder"
    error = from_rank0(error)
    if error:
        raise ConfigError(error)
