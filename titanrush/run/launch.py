"""`python -m titanrush.run.launch [torchrun's options] -m titanrush.train [args]`: what run_train.sh starts
for a job of several processes.

It is torchrun (torch.distributed.run, with its options and behaviour), except for how it ends. When a
worker fails, torchrun raises ChildFailedError: a traceback and a report some forty lines long, and exit
status 1 whatever the workers said. Here the launcher ends with the first failed worker's own status (2 a
config error, 3 a non-finite loss, 128 + N a signal: the statuses of a one-process run, in
docs/operations.md) and one line naming it: the worker's own line, printed above, says why, or, for a
worker killed by a signal (which could print nothing), the launcher's line says so. A signal to the
launcher itself (which torchrun forwards to its workers) ends it with 128 + N, without a traceback; a
second one while the workers stop is passed on as SIGTERM by torchrun, which a worker stopping on a
Ctrl-C takes as a second Ctrl-C (titanrush/run/signals.py): it stops at once.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

REASONS = {1: "an error", 2: "a config error", 3: "a non-finite loss or gradient norm"}


def describe(status: int) -> str:
    """What a titanrush worker's exit status means (train.py's statuses)."""
    if status > 128 and status - 128 in signal.valid_signals():
        return f"signal {signal.Signals(status - 128).name}"
    return REASONS.get(status, "an unknown failure")


def worker_status(exitcode: int) -> int:
    """A worker's exit status as a shell gives it: a negative exit code is a signal (-N -> 128 + N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The worker that ended first: (rank, torchrun's ProcessFailure).

    torchrun dates failures in whole seconds; within the first one, a worker killed by SIGKILL (from
    outside: kill -9, the kernel's out-of-memory killer) comes first, since the others' failures in that
    second (a lost connection to it) follow from it and it could say nothing itself.
    """
    first = min(f.timestamp for f in failures.values())
    same = [(rank, f) for rank, f in failures.items() if f.timestamp == first]
    return next(((r, f) for r, f in same if f.exitcode == -signal.SIGKILL), same[0])


def ended_line(rank: int, exitcode: int) -> str:
    """The launcher's one line on a job whose first failed worker is `rank` (exit code as torchrun gives
    it: negative for a worker killed by that signal)."""
    status = worker_status(exitcode)
    head = f"titanrush: the job ended with exit status {status}"
    if exitcode >= 0:
        return f"{head} ({describe(status)}): rank {rank} ended first, its lines above say why"
    # killed by a signal: it could print nothing of its own
    number = -exitcode
    name = signal.Signals(number).name if number in signal.valid_signals() else "unknown"
    how = ": a kill -9, or the host's out-of-memory killer" if number == signal.SIGKILL else ""
    return f"{head}: rank {rank} ended first, killed by signal {number} ({name}{how})"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        if failure.exitcode == 0:  # (a worker failed another way: torchrun's report says how)
            raise
        print(ended_line(rank, failure.exitcode), file=sys.stderr)
        return worker_status(failure.exitcode)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        first = e.__context__ if isinstance(e.__context__, SignalException) else None
        if first is not None and first.sigval == signal.SIGINT:  # (torchrun passed it on as SIGTERM)
            again = "a second SIGINT" if e.sigval == signal.SIGINT else f"SIGINT, then {name}"
            line = f"got {again}: its workers stopped at once, without saving"
        else:
            line = f"got {name} and stopped its workers"
        print(f"titanrush: the launcher {line}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
