"""File-system and error-wording helpers shared by the checkpoint folder, the run folder, the metrics, data
preparation and the Hugging Face conversions: can a folder be written or read, how much room is left, was
a failed write a full disk, the one-line form of an exception for a message, and a JSON-lines file that
only ever holds whole rows.

A base module: it imports nothing of titanrush.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

# After a write failure, a disk with less free space than this is taken to be full (a failed write on a
# full disk leaves it at ~0; the bound leaves room for reserved blocks and other writers).
FULL_BELOW = 256 * 2**20


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes (for an unprivileged user) on the disk that holds path, or would hold it."""
    return shutil.disk_usage(_existing(path)).free


def check_writable(folder: Path) -> str:
    """Why the checkpoint folder cannot be made or written ('' if it can): a probe file is created and
    removed in it, or in its nearest existing parent (permissions, read-only mounts and quotas all show)."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file"
    target = _existing(folder)
    if not target.is_dir():
        return f"{target} is a file, so {folder} cannot be made"
    try:
        fd, probe = tempfile.mkstemp(prefix=".titanrush-write-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{target} cannot be written ({e.strerror or e})"
    return ""


def first_unreadable(folder: Path) -> PermissionError | None:
    """The first permission failure that reading `folder` meets (listing it, opening one of its entries),
    None where this user may read all of it. Opens without reading: the cost of a stat per entry."""
    try:
        names = sorted(os.listdir(folder))
    except PermissionError as e:
        return e
    except OSError:  # (gone, or not a folder: for the caller's own checks to name)
        return None
    for name in names:
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NONBLOCK)  # (a pipe in the way does not block)
        except PermissionError as e:
            return e
        except OSError:
            continue
        os.close(fd)
    return None


def unreadable_message(e: OSError, folder: Path) -> str:
    """`<path> cannot be read by this user (Permission denied): <fix>` for a file or folder under `folder`
    (what the fix names) that this user may not read."""
    path = Path(e.filename) if e.filename else folder
    try:
        owner = path.stat().st_uid
    except OSError:  # (a folder above it that cannot be searched)
        owner = folder.stat().st_uid
    if owner == os.geteuid():
        fix = f"give yourself read access (chmod -R u+rX {folder})"
    else:
        fix = (
            f"its owner (uid {owner}) can give read access (chmod -R a+rX {folder}), or run as the user that "
            "wrote it"
        )
    return f"{path} cannot be read by this user ({e.strerror or 'Permission denied'}): {fix}"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """exc, its causes and contexts, and the per-rank failures a CheckpointException wraps."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


def os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno behind exc (a save's failure is wrapped by DCP), else None."""
    return next((e for e in _causes(exc) if isinstance(e, OSError) and e.errno), None)


def is_disk_full(exc: BaseException, folder: Path, need: int = 0) -> bool:
    """Whether a failed write is a full disk: ENOSPC or EDQUOT behind it, or a write failure without an
    errno (torch's `inline_container.cc ... unexpected pos`) on a disk that now has (almost) no room."""
    e = os_error(exc)
    if e is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    texts = " ".join(str(c) for c in _causes(exc) if not isinstance(c, CheckpointException))
    write_failed = any(k in texts for k in ("unexpected pos", "inline_container", "write failed", "No space"))
    return write_failed and free_bytes(folder) < max(FULL_BELOW, need)


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` of the innermost failure, for messages (never a traceback)."""
    inner = exc
    if isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


class JsonLines:
    """An append-only JSON-lines file (rows of one writer) that a reader never sees a broken row of.

    Each row goes to the file whole, in one write where the disk takes it (no buffer is left to flush at
    close). A write that fails (a full disk takes part of a line, then fails) is cut back to the last
    whole row before the OSError is raised. A file that ends in a cut-off row (a machine that went down
    mid-write, or an older titanrush on a full disk) is repaired when opened: a last line that is a whole
    object gets its newline, anything else is cut off (`cut`: how many bytes).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            self.cut = _end_with_whole_row(self.fd)
        except OSError:
            self.close()
            raise

    def write(self, row: str) -> None:
        """Append `row` (one line of JSON, no newline) whole; on OSError the file is as it was."""
        assert self.fd is not None, "written after close"
        data = memoryview((row + "\n").encode())
        end = os.fstat(self.fd).st_size
        try:
            done = 0
            while done < len(data):  # (a write may take part of the line: the rest goes next)
                done += os.write(self.fd, data[done:])
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)  # (frees blocks: works on a full disk)
            raise

    def sync(self) -> None:
        """Push what is written to the disk."""
        if self.fd is not None:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _end_with_whole_row(fd: int) -> int:
    """Make the file end with a whole row; the bytes of a cut-off last row removed (0: none)."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, 2**20), max(size - 2**20, 0))  # (a row is far shorter than this)
    if not tail or tail.endswith(b"\n"):
        return 0
    last = tail[tail.rfind(b"\n") + 1 :]  # (the whole tail where it holds no newline)
    with contextlib.suppress(ValueError):
        if isinstance(json.loads(last), dict):  # only its newline was lost
            os.write(fd, b"\n")
            return 0
    os.ftruncate(fd, size - len(last))
    return len(last)
