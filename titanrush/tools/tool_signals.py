"""SIGTERM and SIGINT in `titanrush sweep` and `rush`: passed on to the run in progress, then one line.

A tool starts each run in a session of its own (`rush_runner.run_child`), so that it can stop the run and
everything the run started; a signal to the tool (a scheduler's SIGTERM, Ctrl-C in a terminal) thus
reaches the tool alone. While a run is in progress, the tool passes each signal on to the run's process
group (the training run, or run_train.sh's launcher, which passes it on to its ranks) and waits for the
run to stop, after its step as any titanrush run does (a second Ctrl-C: at once). Then, or at once when
no run is in progress, the tool ends with one line and exit status 128 + N.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
Main = Callable[[list[str] | None], int]


class Stopped(BaseException):
    """A signal stopped the tool. A BaseException, as KeyboardInterrupt is: an `except Exception` (the
    estimator's, which must never stop a rush) does not swallow it."""

    def __init__(self, signum: int, *, run: bool = False) -> None:
        self.status = 128 + signum
        also = "; its run in progress stopped too" if run else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{also} (exit status {self.status})")


def _install(handler: Callable[[int, FrameType | None], Any]) -> dict[int, Any]:
    """Put `handler` on SIGTERM and SIGINT; the handlers it replaced (none off the main thread, where
    Python allows no handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def stops_on_signals(prog: str) -> Callable[[Main], Main]:
    """Decorate a tool's `main(argv) -> int`: SIGTERM and SIGINT end it with one line, `prog: stopped by
    SIGTERM ...`, and 128 + N (not a KeyboardInterrupt traceback, nor a kill that leaves its run going)."""

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            previous = _install(_stop)
            try:
                return main(argv)
            except Stopped as e:
                print(f"{prog}: {e}", file=sys.stderr)
                return e.status
            finally:
                _restore(previous)

        return run

    return wrap


@contextlib.contextmanager
def passed_on(proc: subprocess.Popen) -> Iterator[None]:
    """While the body waits for `proc` (started in a session of its own): each SIGTERM and SIGINT goes on
    to its process group; once the body is done (the run has ended), the first raises Stopped."""
    got: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        with contextlib.suppress(ProcessLookupError):  # (it has just ended)
            os.killpg(proc.pid, signum)

    previous = _install(forward)
    try:
        yield
    finally:
        _restore(previous)
    if got:
        raise Stopped(got[0], run=True)
