"""Stopping on a signal, and workers that end with their launcher.

SIGTERM (what SLURM and Kubernetes send before they preempt a job) and SIGINT (Ctrl-C; torchrun forwards
both to its workers) only set a flag here; the training loop looks at it after each step. A signal may
reach some ranks and not others, or reach them during different steps, so the ranks agree before they
stop: at each step boundary every rank contributes its flag to an asynchronous all-reduce (MAX) on a
gloo group of its own, and reads the result of the previous boundary's. Every rank thus sees the same
value at the same step, one step after the last rank saw the signal, without waiting on the device or
on the other ranks in between. A second SIGINT raises KeyboardInterrupt at once (to abort a save), and so
does a SIGTERM after a SIGINT: torchrun passes a second Ctrl-C on to its workers as SIGTERM (it sent
them the first as SIGINT).

`end_with_launcher` asks the kernel for SIGTERM when the parent process dies (Linux's
PR_SET_PDEATHSIG): torchrun starts its workers in sessions of their own, so a `kill -9` of torchrun
otherwise leaves them training and writing checkpoints. With it they stop like on any SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("titanrush")

HANDLED = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_launcher() -> bool:
    """Under torchrun on Linux: have this worker receive SIGTERM when its launcher dies.

    Returns:
        Whether the request was made (False elsewhere, or where prctl is not available).
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died during the request: nothing will send the signal now
        os.kill(os.getpid(), signal.SIGTERM)
    return True


class StopSignals:
    """The SIGTERM/SIGINT flag of this process, and the ranks' agreement on it (see the module doc).

    Args:
        group: A process group over every rank for the agreement (created here when None and several
            processes run; gloo, so that the agreement never waits on a GPU stream).
    """

    def __init__(self, group: Any = None) -> None:
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.new_group(backend="gloo")
        self.group = group
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._work: Any = None
        self._buf = torch.zeros(1, dtype=torch.int32)

    def install(self) -> None:
        """Catch SIGTERM and SIGINT (main thread only; elsewhere Python allows no handlers)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signal.SIGINT in (signum, self.received):
            raise KeyboardInterrupt  # a second Ctrl-C (under torchrun: SIGINT, then SIGTERM): stop now
        self.received = self.received or signum
        # (os.write: a signal handler must not take the logging module's locks)
        name = signal.Signals(signum).name
        os.write(2, f"titanrush: {name} received: stopping after the current step\n".encode())

    def poll(self) -> int | None:
        """At a step boundary (every rank calls it at every boundary): the signal to stop on, or None.

        One process: this process's signal. Several: the largest signal number any rank had received
        at the previous boundary, the same on every rank.
        """
        if self.group is None:
            return self.received
        agreed = None
        if self._work is not None:
            self._work.wait()
            agreed = int(self._buf.item()) or None
        self._buf = torch.tensor([self.received or 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def close(self) -> None:
        """Finish the agreement in flight (every rank started it) and restore the handlers."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.restore()


def stop_message(signum: int, step: int, *, enable: bool, save: bool) -> str:
    """The one line a run stopped by `signum` after `step` ends with (checkpoint.enable, save_on_signal)."""
    if not enable:
        saved = "no checkpoint (checkpoint.enable = false)"
    elif not save:
        saved = "no checkpoint (checkpoint.save_on_signal = false); a restart resumes from the newest one"
    else:
        saved = f"checkpoint of step {step} saved; run the same command to resume"
    return f"stopped by {signal.Signals(signum).name} after step {step}: {saved} (exit status {128 + signum})"
