"""Reading a checkpoint folder that a training run prunes meanwhile (`checkpoint.keep_latest_k`).

`generate` and `convert` read a step folder while the run that writes its checkpoint folder may delete it:
a save of a newer step prunes the older ones. A file that goes away between two reads used to surface as
a FileNotFoundError traceback, or as "corrupt" for a checkpoint that was healthy a moment before. Here a
failure while reading a step folder whose files went away meanwhile is `CheckpointRemoved`, and
`newest_kept` reads again from the newest step left where the command was given the checkpoint folder
(a step folder named by the user is not swapped for another: that is refused, naming the newest kept).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from titanrush.checkpoint.folder import INFO_FILE, STEP_DIR
from titanrush.config import ConfigError
from titanrush.files import one_line, unreadable_message

logger = logging.getLogger("titanrush")
T = TypeVar("T")


class CheckpointRemoved(ConfigError):
    """A step folder that went away while it was read: a training run pruning it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        kept = [p for p in path.parent.glob("step-*") if STEP_DIR.match(p.name) and (p / INFO_FILE).exists()]
        newest = max(kept, key=lambda p: int(p.name[5:]), default=None)
        instead = (
            f"read one that is kept ({newest} is the newest), or pass the checkpoint folder {path.parent} "
            "to read its newest"
            if newest is not None
            else "no checkpoint is left beside it"
        )
        super().__init__(
            f"checkpoint {path} was removed while it was being read (the run that writes {path.parent} "
            f"prunes its older checkpoints: checkpoint.keep_latest_k); {instead}"
        )


def _names(path: Path) -> set[str] | None:
    """The names in a folder (none where it is gone; None where it cannot be listed for another reason)."""
    try:
        return set(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    except OSError:
        return None


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Read the step folder `path` (chosen for its titanrush.json) in the block. A failure there while its
    files go away (a missing file, a checkpoint that looks corrupt) is CheckpointRemoved; any other
    failure of the file system a one-line ConfigError."""
    before = _names(path)
    try:
        yield
    except (ConfigError, OSError) as e:
        now = _names(path)
        gone = now is not None and (INFO_FILE not in now or bool((before or set()) - now))
        if gone and not isinstance(e, CheckpointRemoved):
            raise CheckpointRemoved(path) from None
        if isinstance(e, PermissionError):
            raise ConfigError(f"checkpoint {path} cannot be read: {unreadable_message(e, path)}") from None
        if isinstance(e, OSError):
            raise ConfigError(f"checkpoint {path} cannot be read ({one_line(e)}); use another step") from None
        raise


def newest_kept(checkpoint: str | Path, read: Callable[[], T], attempts: int = 3) -> T:
    """read(), which reads what `checkpoint` names. Where the step folder it reads is removed meanwhile
    and `checkpoint` is the checkpoint folder, not that step, it is called again (said): it then reads
    the newest step left."""
    named = Path(checkpoint).expanduser()
    for attempt in range(attempts):
        try:
            return read()
        except CheckpointRemoved as e:
            if e.path == named or attempt == attempts - 1:
                raise
            logger.warning(
                f"{e.path} was removed while it was being read (the run that writes {e.path.parent} pruned "
                "it: checkpoint.keep_latest_k); reading the newest checkpoint left there"
            )
    raise AssertionError("unreachable")  # (the last attempt returns or raises)
