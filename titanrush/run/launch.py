"""`python -m titanrush.run.launch [torchrun's options] -m titanrush.train [args]`: what run_train.sh starts
for a job of several processes.

It is torchrun (torch.distributed.run, with its options and behaviour), except for how it ends. When a
worker fails, torchrun raises ChildFailedError: a traceback and a report some forty lines long, and exit
status 1 whatever the workers said. Here the launcher ends with the first failed worker's own status (2 a
config error, 3 a non-finite loss, 128 + N a signal: the statuses of a one-process run, in
docs/operations.md) and one line naming it; the worker's own line, printed above, says why. A signal to
the launcher itself (which torchrun forwards to its workers) ends it with 128 + N, without a traceback.
"""

from __future__ import annotations

import signal
import sys

REASONS = {1: "an error", 2: "a config error", 3: "a non-finite loss or gradient norm"}


def describe(status: int) -> str:
    """What a titanrush worker's exit status means (train.py's statuses)."""
    if status > 128 and status - 128 in signal.valid_signals():
        return f"signal {signal.Signals(status - 128).name}"
    return REASONS.get(status, "an unknown failure")


def worker_status(exitcode: int) -> int:
    """A worker's exit status as a shell gives it: a negative exit code is a signal (-N -> 128 + N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        status = worker_status(failure.exitcode)
        if status == 0:  # (a worker failed another way: torchrun's report says how)
            raise
        print(
            f"titanrush: the job ended with exit status {status} ({describe(status)}): rank {rank} ended "
            "first, its lines above say why",
            file=sys.stderr,
        )
        return status
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"titanrush: the launcher got {name} and stopped its workers", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main())
