"""File-system and error-wording helpers shared by the checkpoint folder, the run folder, data preparation
and the Hugging Face conversions: can a folder be written, how much room is left, was a failed write a
full disk, and the one-line form of an exception for a message.

A base module: it imports nothing of titanrush.
"""

from __future__ import annotations

import errno
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
