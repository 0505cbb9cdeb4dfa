"""Logging set-up: one stream handler, rank-aware, and a quiet console for multi-process jobs.

Each of N processes imports the same libraries and meets the same conditions, so a library warning
(torch's, Inductor's) would be printed N times, and titanrush's own progress lines too. Unless
`metrics.verbose`:

- rank 0 prints titanrush's INFO lines and each library warning once (Python's own once-per-location
  rule is not enough: every change to the warning filters, which torch.compile makes, resets it);
- the other ranks print titanrush's warnings and errors (a rank's own trouble: a file it cannot write),
  and no library warning, nor torch's logged warnings.

With `metrics.verbose` every rank prints everything, as Python and torch would.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Any, TextIO

from titanrush.launch_env import ranks_from_env

_shown: set[tuple[str, str]] = set()  # (category, message) of the warnings rank 0 has printed


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a record comes (a caller may have redirected it since)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def init_logging(*, verbose: bool = False) -> None:
    """Set up titanrush's logger and the console policy of this process; call it once the config is read,
    before torch is imported (the handler is added once: a later call only changes the levels).

    Args:
        verbose: Every rank logs INFO and shows every warning (`metrics.verbose`).
    """
    ranks = ranks_from_env()
    rank, world = ranks.rank, ranks.world_size
    logger = logging.getLogger("titanrush")
    if not logger.handlers:
        prefix = f"[rank{rank}] " if world > 1 else ""
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 or verbose else logging.WARNING)
    if verbose:
        warnings.showwarning = show_every
    elif rank == 0:
        warnings.showwarning = show_once
    else:
        warnings.showwarning = _show_nothing
        # torch logs some warnings through `logging` (its "torch" logger has its own handler)
        logging.getLogger("torch").setLevel(logging.ERROR)


def show_once(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings.showwarning` that prints each (category, message) once per process, whatever resets
    Python's own registry of the warnings already shown."""
    key = (category.__name__, str(message))
    if key in _shown:
        return
    _shown.add(key)
    show_every(message, category, filename, lineno, file, line)


def show_every(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings.showwarning` as Python's own: every warning its filters let through, to stderr."""
    stream = sys.stderr if file is None else file
    with contextlib.suppress(OSError):  # stderr gone (a closed pipe): as Python's own, drop the warning
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))


def _show_nothing(*args: Any, **kwargs: Any) -> None:
    """`warnings.showwarning` of a non-zero rank: rank 0 shows the same warning."""
