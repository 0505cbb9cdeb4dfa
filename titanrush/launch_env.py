"""The launcher's word on this process: RANK, WORLD_SIZE and LOCAL_RANK, checked before anything starts,
and whether the launcher restarted the job after a failure.

torchrun (or `run_train.sh`) sets them; a process started without them is rank 0 of 1. A value that is
not a whole number in range is a `ConfigError` naming the variable, not a traceback from `int()`.
titanrush's launcher (`titanrush.run.launch`) sets `TITANRUSH_RESTART` (the restart's number, from 1) and
`TITANRUSH_RESTART_CAUSE` (what ended the attempt before) when it starts a job again (`restart_from_env`).
Also whether this host has a GPU at all (`gpu_device_files`). This module imports no torch: the trainer
reads it before torch's import.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from titanrush.config import ConfigError

_FIX = "torchrun sets RANK, WORLD_SIZE and LOCAL_RANK: launch with run_train.sh, or unset all three"


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, from torchrun's environment variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def whole_number(
    environ: dict[str, str] | os._Environ, name: str, default: int, low: int, fix: str = _FIX
) -> int:
    """The environment variable `name` as a whole number >= `low` (`default` where unset or empty); else a
    `ConfigError` naming the variable, its value and `fix`."""
    text = environ.get(name)
    if not text:
        return default
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() else None
    if value is None or value < low:
        raise ConfigError(f"{name}={text!r} in the environment must be a whole number >= {low} ({fix})")
    return value


def ranks_from_env(environ: dict[str, str] | os._Environ = os.environ) -> Ranks:
    """RANK, WORLD_SIZE and LOCAL_RANK (defaults: one process); `ConfigError` on a bad value."""
    ranks = Ranks(
        rank=whole_number(environ, "RANK", 0, 0),
        world_size=whole_number(environ, "WORLD_SIZE", 1, 1),
        local_rank=whole_number(environ, "LOCAL_RANK", 0, 0),
    )
    if ranks.rank >= ranks.world_size:
        raise ConfigError(f"RANK={ranks.rank} must be below WORLD_SIZE={ranks.world_size} ({_FIX})")
    return ranks


RESTART_VARS = ("TITANRUSH_RESTART", "TITANRUSH_RESTART_CAUSE")


@dataclass(frozen=True)
class Restart:
    """The launcher started this job again after a failure: its `count`-th restart, after `cause`."""

    count: int
    cause: str


def restart_from_env(environ: dict[str, str] | os._Environ = os.environ) -> Restart | None:
    """The launcher's restart of this job (`RESTART_VARS`), or None for a job's first start."""
    count = whole_number(environ, RESTART_VARS[0], 0, 0, "set by titanrush's launcher only: unset it")
    return Restart(count, environ.get(RESTART_VARS[1], "")) if count else None


# A GPU's device files: NVIDIA's, AMD's (ROCm), WSL's. run_train.sh checks the same before it asks torch.
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def gpu_device_files() -> bool:
    """Whether this host has a GPU's device file. Without one torch can see no GPU, and asking it (seconds
    of importing torch, in a child process that keeps CUDA out of the caller) can be skipped."""
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)
