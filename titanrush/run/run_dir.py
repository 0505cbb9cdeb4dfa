"""The run folder `<job.dump_folder>/<job.name>`: checked and locked before the run is built, written once
accepted, and each attempt in it told apart.

Rank 0 does the file work and every rank gets its outcome (`distributed.from_rank0`), so that a refused
folder stops every rank with the same message. Nothing is created or written while the run can still be
refused: `check` only looks (and locks a folder that exists), `create` makes the folder and records the
resolved config (`config.toml`) after the model is built and any checkpoint has loaded.

The lock: rank 0 holds an exclusive `flock` on `<run folder>/.lock` (which records its pid and host) for
the run's life, so a second run cannot write into the folder, or load a checkpoint from it that the
first is still writing. The kernel releases it when the process ends, however it ends. A run refused at
start lets it go and leaves no trace: the lock file and folders it made are removed (`RunLock.release`).
A job the launcher restarts after a failure (`job.max_restarts`) waits up to `RESTART_LOCK_WAIT_S` for
the failed attempt's lock: a process of it that the launcher killed may take a moment to be gone.

Attempts: each run in a folder is an attempt, numbered from 1. Every metrics row carries its attempt,
TensorBoard writes under `tb/attempt-<n>/`, and the config.toml of an earlier attempt is kept as
`config.attempt-<n>.toml`. A resumed run is a new attempt that continues the same step series.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

from titanrush.config import ConfigError
from titanrush.distributed import from_rank0
from titanrush.files import check_writable
from titanrush.launch_env import restart_from_env

CONFIG_FILE = "config.toml"
LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
CONSOLE_FILE = (
    "console.log"  # rank 0's console, each attempt's appended (titanrush.logging_utils.ConsoleCopy)
)
RESTART_LOCK_WAIT_S = 30.0
logger = logging.getLogger("titanrush")
_KEPT_CONFIG = re.compile(r"^config\.attempt-(\d+)\.toml$")


class RunLock:
    """Rank 0's exclusive lock on a run folder (a no-op object on the other ranks)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.made: list[Path] = []  # what this run made for the lock (the file, new folders), to undo
        self.made_run_folder: Path | None = None  # the run folder, where `create` made it: all of it ours

    def acquire(self, folder: Path, wait: float = 0.0) -> str:
        """Lock `folder` (it exists), trying for `wait` seconds while another process holds it; return ""
        or the reason it is refused (then nothing is held)."""
        if self.fd is not None:
            return ""
        path = folder / LOCK_FILE
        for _ in range(3):  # (again where a refused run removed the file between our open and flock)
            try:
                fd, made = _open_lock(path)
            except OSError as e:
                return _cannot_lock(folder, e)
            if not _flock(fd, wait):
                holder = os.read(fd, 256).decode(errors="replace").strip()
                os.close(fd)
                return _in_use(folder, holder)
            if _same_file(fd, path):
                break
            os.close(fd)
        else:
            return f"cannot lock the run folder {folder}: its {LOCK_FILE} keeps being replaced; {_fix(None)}"
        self.fd = fd
        self.made += [path] if made else []
        line = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
        try:  # (over the last holder's line first: a block the file has needs no free space)
            os.pwrite(fd, line, 0)
            os.ftruncate(fd, len(line))
        except OSError as e:
            self.release(refused=True)
            return f"cannot write the run folder {folder} ({e}); {_fix(e)}"
        return ""

    def release(self, *, refused: bool = False) -> None:
        """Let the folder go (closing the descriptor drops the flock). `refused`: the run stops before it
        starts, so the lock file and the folders it made are removed too (while it is still held)."""
        if refused and self.made_run_folder is not None:  # (refused after `create`: what it wrote too)
            shutil.rmtree(self.made_run_folder, ignore_errors=True)
            self.made_run_folder = None
        if refused:  # (the file first, then the folders, innermost first, where empty)
            for p in sorted(self.made, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    p.rmdir() if p.is_dir() else p.unlink()
            self.made = []
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _cannot_lock(folder: Path, e: OSError) -> str:
    return own_file_problem(folder) or f"cannot lock the run folder {folder} ({e}); {_fix(e)}"


def _in_use(folder: Path, holder: str) -> str:
    return (
        f"run folder {folder} is in use by another run ({holder or 'unknown'}); wait for it to end (or stop "
        "it), or choose another job.name"
    )


def in_use(folder: Path) -> str:
    """Why another run holds `folder`, or its lock file cannot be taken ('' where neither), writing nothing
    (for `--check`, in a process of its own: the lock is tried shared and let go at once; where flock is
    emulated by POSIX locks, as on some NFS mounts, a probe from the holding process would drop its lock)."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_NONBLOCK)  # (as `acquire` opens it)
    except FileNotFoundError:  # (no run ever held it)
        return ""
    except OSError as e:
        return _cannot_lock(folder, e)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        held = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)  # (else no lock service: `acquire` will say)
        return _in_use(folder, os.read(fd, 256).decode(errors="replace").strip()) if held else ""
    finally:
        os.close(fd)  # (drops a lock taken here)
    return ""


def _flock(fd: int, wait: float) -> bool:
    """Take the exclusive lock on fd, trying for `wait` seconds; whether it is held."""
    end = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.2)


def _open_lock(path: Path) -> tuple[int, bool]:
    """(a descriptor of the lock file, whether this call made it)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK, 0o644), True
    except FileExistsError:
        return os.open(path, os.O_RDWR | os.O_NONBLOCK), False


def _same_file(fd: int, path: Path) -> bool:
    """Whether path still names the file open as fd (a refused run removes the lock file it made)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _fix(e: OSError | None) -> str:
    """What to do about a run folder that cannot be written: free space on a full disk, else another."""
    if e is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on its disk, or choose a job.dump_folder on another disk"
    return "choose another job.name or job.dump_folder"


def check(path: Path, *, overwrite: bool, rank: int) -> RunLock:
    """Refuse a folder the run cannot use, before anything is written (every rank calls this); lock it
    when it exists.

    Returns:
        The lock, held on rank 0 when the folder exists (`create` takes it for a new folder).

    Raises:
        ConfigError: The folder exists and `job.overwrite` is false, is a file, cannot be written, or
            another run holds it.
    """
    lock = RunLock()
    error = ""
    if rank == 0:
        wait = RESTART_LOCK_WAIT_S if restart_from_env() is not None else 0.0
        error = problem(path, overwrite=overwrite) or (lock.acquire(path, wait) if path.is_dir() else "")
    error = from_rank0(error)
    if error:
        lock.release(refused=True)
        raise ConfigError(error)
    return lock


def own_file_problem(folder: Path) -> str:
    """Why a file the run writes in its folder (the lock, config.toml, metrics.jsonl, console.log) cannot be
    one ('' where each can): something else under its name."""
    for name in (LOCK_FILE, CONFIG_FILE, METRICS_FILE, CONSOLE_FILE):
        path = folder / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            return (
                f"{path} is not a file (a folder, a link, a pipe ...); remove it, or choose another job.name"
            )
    return ""


def problem(path: Path, *, overwrite: bool) -> str:
    """Why the run cannot use the folder ('' if it can), lock aside: a file, an existing folder without
    job.overwrite, or a folder (or nearest existing parent) that cannot be written."""
    if path.exists() and not path.is_dir():
        return f"run folder {path} is a file; choose another job.name or job.dump_folder"
    if path.exists() and not overwrite:
        return f"run folder {path} exists and job.overwrite = false; choose another job.name"
    if error := own_file_problem(path):
        return error
    error = check_writable(path)
    return error and f"cannot write the run folder {path} ({error}); choose another job.dump_folder"


def create(path: Path, config_text: str, *, rank: int, lock: RunLock, resumed_step: int = 0) -> int:
    """Make the folder, lock it, keep an earlier attempt's config and write this run's (every rank calls
    this). `resumed_step`: the step a resumed run continues after (0: a run from step 1).

    Returns:
        This attempt's number (1 for the folder's first run), the same on every rank.

    Raises:
        ConfigError: The folder or the config file cannot be written, or another run took the folder.
    """
    outcome: str | int = ""
    if rank == 0:
        lock.made += [p for p in [path, *path.parents] if not p.exists()]  # (a refusal removes them)
        lock.made_run_folder = None if path.exists() else path
        fresh = path / (CONFIG_FILE + ".tmp")
        try:
            path.mkdir(parents=True, exist_ok=True)
            outcome = lock.acquire(path)
            if not outcome:
                previous = previous_attempt(path)
                config = path / CONFIG_FILE
                fresh.write_text(config_text, encoding="utf-8")  # (written whole before the old one moves)
                if config.exists():  # an earlier attempt's: kept beside this one's
                    os.replace(config, path / f"config.attempt-{previous}.toml")
                os.replace(fresh, config)
                outcome = previous + 1
        except OSError as e:
            outcome = f"cannot write the run folder {path} ({e}); {_fix(e)}"
            with contextlib.suppress(OSError):
                fresh.unlink(missing_ok=True)
    outcome = from_rank0(outcome)
    if isinstance(outcome, str):
        lock.release(refused=True)
        raise ConfigError(outcome)
    if outcome > 1:  # the folder was used before: say how this attempt's rows relate to the earlier ones
        how = (
            f"resuming after step {resumed_step}: the step series continues"
            if resumed_step
            else "from step 1"
        )
        logger.info(
            f'attempt {outcome} in {path}, {how}; its metrics rows carry "attempt": {outcome}, TensorBoard '
            f"goes to tb/attempt-{outcome}"
        )
    return outcome


def previous_attempt(path: Path) -> int:
    """The number of the folder's latest attempt (0: none), from its metrics and kept configs."""
    kept = [int(m[1]) for p in path.glob("config.attempt-*.toml") if (m := _KEPT_CONFIG.match(p.name))]
    latest = max(kept, default=0) + 1 if (path / CONFIG_FILE).exists() else max(kept, default=0)
    return max(latest, _last_logged_attempt(path / METRICS_FILE))


def _last_logged_attempt(metrics: Path) -> int:
    """The attempt of the last complete row of metrics.jsonl (1 for rows written before attempts)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            return int(json.loads(line).get("attempt", 1))
    return 1 if lines else 0
