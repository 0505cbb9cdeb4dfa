"""The console: where titanrush's lines go, rank-aware, and a copy of rank 0's console in the run folder.

Progress and results (titanrush's INFO lines: the run's set-up, a line per logged step, the end-of-run
summary) go to stdout, so that `./run_train.sh > log` keeps them; warnings and errors go to stderr.
`ConsoleCopy` copies rank 0's console, both streams as they are written, into the run folder
(`console.log`).

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
import datetime
import logging
import math
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, TextIO

from titanrush.launch_env import ranks_from_env

_shown: set[tuple[str, str]] = set()  # (category, message) of the warnings rank 0 has printed


class _StreamHandler(logging.StreamHandler):
    """Writes to `sys.stdout` or `sys.stderr` (`target`) as it is when a record comes (a caller may have
    redirected it since: the console copy, a test's capture)."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    @property
    def stream(self) -> Any:
        return getattr(sys, self.target)

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def handleError(self, record: logging.LogRecord) -> None:
        """A reader that went away (`| head`) is no error to report for every later line."""
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)


def init_logging(*, verbose: bool = False) -> None:
    """Set up titanrush's logger and the console policy of this process; call it once the config is read,
    before torch is imported (the handlers are added once: a later call only changes levels and prefixes).

    INFO lines go to stdout (`HH:MM:SS message`), warnings and errors to stderr (`HH:MM:SS WARNING
    message`). In a job of several processes a stderr line names its rank (`[rank1] `), and so does a
    stdout line with `verbose`, where every rank prints them.

    Args:
        verbose: Every rank logs INFO and shows every warning (`metrics.verbose`).
    """
    ranks = ranks_from_env()
    rank, world = ranks.rank, ranks.world_size
    logger = logging.getLogger("titanrush")
    ours = {h.target: h for h in logger.handlers if isinstance(h, _StreamHandler)}
    if not ours:
        ours = {"stdout": _StreamHandler("stdout"), "stderr": _StreamHandler("stderr")}
        ours["stdout"].addFilter(lambda record: record.levelno < logging.WARNING)
        ours["stderr"].setLevel(logging.WARNING)
        for handler in ours.values():
            logger.addHandler(handler)
        logger.propagate = False
    prefix = f"[rank{rank}] " if world > 1 else ""
    out = prefix if verbose else ""
    ours["stdout"].setFormatter(logging.Formatter(f"%(asctime)s {out}%(message)s", "%H:%M:%S"))
    ours["stderr"].setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S")
    )
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


# How the console names each checkpoint mode (the config's "disabled" async mode is a synchronous save).
_CKPT_MODES = {
    "disabled": "sync",
    "async": "async",
    "async_pinned": "async, pinned",
    "model_only": "model only",
}


def short(x: float) -> str:
    """A number in three significant digits, never rounded to zero (`0.0123`, `4.56`, `78.9`, `1,234`)."""
    if not math.isfinite(x):
        return str(x)
    size = abs(x)
    if size >= 100:
        return f"{x:,.0f}"
    if size >= 10:
        return f"{x:.1f}"
    if size >= 1 or size == 0:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _memory(record: dict[str, Any]) -> str | None:
    """`mem 62.3GiB (44%)`: the peak the device held (the allocator's reserved memory on a GPU, the
    process's peak RSS on CPU), and its share of the device."""
    reserved = record.get("mem_reserved_gib")
    gib, pct = (
        (reserved, record.get("mem_reserved_pct"))
        if reserved is not None
        else (
            record.get("mem_active_gib"),
            record.get("mem_active_pct"),
        )
    )
    if gib is None:
        return None
    return f"mem {short(gib)}GiB" + (f" ({pct:.0f}%)" if pct is not None else "")


DATA_WAIT_SHOWN = 5.0  # data wait (% of the time) from which a step line shows it: below, the loader keeps up

# A console line shows these, in this order, each where the row has it. `tflops` only where MFU is not
# known (MFU is TFLOP/s over the peak the header names); the rest of a row is in metrics.jsonl.
_SHOWN: list[tuple[str, Any]] = [
    ("loss", lambda v, r: f"loss {v:.4f}"),
    ("skipped", lambda v, r: f"skipped {v} non-finite step{'s' * (v != 1)}"),
    ("val_loss", lambda v, r: f"validation loss {v:.4f}"),
    ("val_ppl", lambda v, r: f"perplexity {short(v)}"),
    ("val_time_s", lambda v, r: f"took {v:.1f}s"),
    ("lr", lambda v, r: f"lr {v:.1e}"),
    ("grad_norm", lambda v, r: f"gnorm {short(v)}"),
    ("tps", lambda v, r: f"tok/s {v:,.0f}"),
    ("tflops", lambda v, r: None if r.get("mfu") is not None else f"tflops {short(v)}"),
    ("mfu", lambda v, r: f"mfu {v:.1f}%"),
    ("mem_active_gib", lambda v, r: _memory(r)),
    ("offload_gib", lambda v, r: f"offloaded {short(v)}GiB"),
    ("data_wait_pct", lambda v, r: f"data wait {v:.0f}%" if v >= DATA_WAIT_SHOWN else None),
    ("moe_imbalance_window", lambda v, r: f"busiest expert {v:.2f}x mean load"),
    ("stop", lambda v, r: f"stopped ({v})"),
    ("restart", lambda v, r: f"restart {v}"),
    ("cause", lambda v, r: f"after {v}"),
    ("ckpt_mode", lambda v, r: f"checkpoint ({_CKPT_MODES.get(v, v)} save)"),
    ("ckpt_blocking_s", lambda v, r: f"training blocked {v:.2f}s"),
    ("ckpt_save_s", lambda v, r: f"saved in {v:.2f}s"),
    ("ckpt_load_s", lambda v, r: f"checkpoint loaded in {v:.2f}s"),
]

# The widest a dense run's training line should be, its time stamp included (tests/unit/test_metrics.py
# holds a large run's line to it).
LINE_WIDTH = 100


def format_line(record: dict[str, Any]) -> str:
    """The console line of a metrics row: `step 40  loss 6.9123  lr 3.0e-04  gnorm 1.23  tok/s 1,234 ...`."""
    parts = [f"step {record['step']}"]
    for key, show in _SHOWN:
        value = record.get(key)
        if value is not None and (part := show(value, record)) is not None:
            parts.append(part)
    return "  ".join(parts)


class ConsoleCopy:
    """Rank 0's console, stdout and stderr as written, copied line by line into a file of the run folder.

    `start` puts a tee on `sys.stdout` and `sys.stderr` (what each stream shows is unchanged; a line is
    flushed as it ends, so `> log` and `tail -f` follow the run). The lines are kept in memory until the
    run folder exists: a run refused at start leaves no file behind. `attach` then appends a heading line,
    the lines so far and every later line to the file, each write whole lines (`titanrush.files.JsonLines`:
    a write the disk cuts short is cut back, a cut-off line from a machine that went down is removed).
    Output that bypasses Python's streams (a C++ library writing to the file descriptor, faulthandler's
    stacks) is on the console only. A file that cannot be written stops the copy with one warning; the
    run goes on.
    """

    EARLY_LINES = 10_000  # the most lines kept before the folder exists (the first ones are dropped)
    LOCK_WAIT_S = 5.0  # a line that waits longer for the copy's lock (a thread stuck in a write) is skipped

    def __init__(self) -> None:
        self.path: Path | None = None
        self._lock = threading.Lock()
        self._early: list[str] = []
        self._dropped = 0
        self._file: Any = None  # titanrush.files.JsonLines once attached
        self._stopped = False
        self._tees: list[_Tee] = []
        self._stack: contextlib.ExitStack | None = None

    def start(self) -> None:
        """Copy from now on (until `close`): tee `sys.stdout` and `sys.stderr`."""
        assert self._stack is None, "started twice"
        self._tees = [_Tee(sys.stdout, self), _Tee(sys.stderr, self)]
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._tees[0]))
        self._stack.enter_context(contextlib.redirect_stderr(self._tees[1]))

    def attach(self, path: Path, heading: str) -> None:
        """Append `heading` (one line that opens this process's part), the lines so far and every later
        line to `path`."""
        from titanrush.files import JsonLines  # (imports torch: the copy starts before torch's import)

        with self._locked() as held:
            if not held:
                return
            try:
                self._file = JsonLines(path)
            except OSError as e:
                self._stop(path, e)
                return
            self.path = path
            early = [f"[... {self._dropped} earlier lines not kept ...]"] if self._dropped else []
            self._write([heading, *early, *self._early])
            self._early = []

    def add(self, lines: list[str]) -> None:
        """Copy whole lines (without their newlines)."""
        with self._locked() as held:
            if not held or self._stopped:
                return
            if self._file is None:
                self._early += lines
                if len(self._early) > self.EARLY_LINES:
                    cut = len(self._early) - self.EARLY_LINES
                    self._early, self._dropped = self._early[cut:], self._dropped + cut
                return
            self._write(lines)

    def note(self, text: str) -> None:
        """Copy text that the console shows another way (an exception's traceback, which Python prints at
        exit, after the copy has ended)."""
        self.add(text.rstrip("\n").split("\n"))

    def close(self) -> None:
        """Copy what is left of an unfinished line, give the streams back and close the file."""
        for tee in self._tees:
            tee.end()
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        with self._locked():
            if self._file is not None:
                self._file.close()
                self._file = None

    @contextlib.contextmanager
    def _locked(self) -> Any:
        held = self._lock.acquire(timeout=self.LOCK_WAIT_S)
        try:
            yield held
        finally:
            if held:
                self._lock.release()

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self._file.write("\n".join(lines))
        except OSError as e:
            self._stop(self.path, e)

    def _stop(self, path: Path | None, e: OSError) -> None:
        """No more copying; one warning, straight to the console (not through the copy)."""
        self._stopped, self._early = True, []
        if self._file is not None:
            self._file.close()
            self._file = None
        stream = self._tees[1].stream if self._tees else sys.stderr
        with contextlib.suppress(OSError):
            when = datetime.datetime.now().strftime("%H:%M:%S")
            stream.write(
                f"{when} WARNING cannot write {path} ({e.strerror}): the console is not copied there\n"
            )
            stream.flush()


class _Tee:
    """A text stream that writes through to `stream` and hands each finished line to a `ConsoleCopy`."""

    def __init__(self, stream: TextIO, copy: ConsoleCopy) -> None:
        self.stream = stream
        self.copy = copy
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
        if lines:
            self.copy.add(lines)  # (first: a reader gone from the stream does not stop the copy)
        written = self.stream.write(text)
        if lines:
            self.stream.flush()
        return written

    def flush(self) -> None:
        self.stream.flush()

    def end(self) -> None:
        """Copy an unfinished last line."""
        with self._lock:
            partial, self._partial = self._partial, ""
        if partial:
            self.copy.add([partial])

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


def run_heading(attempt: int, resumed_step: int, command: str) -> str:
    """The line that opens an attempt's part of console.log."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    how = f"resuming after step {resumed_step}" if resumed_step else "from step 1"
    return f"===== attempt {attempt}, {when}, {how}, pid {os.getpid()}: {command} ====="
