"""The step watchdog: a rank whose step does not finish in time ends the job, with its stacks and one line.

A hang says nothing: a rank stopped (`kill -STOP`, a debugger), a peer lost without a closed connection,
a collective that one rank never enters leave every other rank waiting inside a collective until the
process group's timeout (`job.collective_timeout`), and then a traceback from deep inside the backend.
Here each rank runs a thread that is armed at the start of every step; when a step has not finished in
its time, the thread

1. writes this rank's Python stacks (every thread, `faulthandler`) to stderr and, with the rank's line
   and the collectives still pending in the flight recorder, to `<run folder>/hang/rank<R>.txt`; the
   flight recorder's own dump (`fr_trace_rank_<R>`, torch's format for its `fr_trace` analyzer, which
   wants every rank's dump) goes beside it where torch provides one;
2. prints one line: `titanrush: rank 0: step 7 did not finish in 5 s (waiting in forward and backward,
   in gloo:all_reduce on default_pg, collective 41; stacks in .../hang/rank0.txt)`;
3. tells the launcher what it waited in (torchrun's error file, `TORCHELASTIC_ERROR_FILE`), which names
   the ranks that never reported, and ends the process with `HANG_STATUS` (4).

The time a step may take: `training.step_timeout` when set; else derived: 10 x the median of the
attempt's measured steps, at least 120 s, once 5 steps are measured, and 600 s before that. The
attempt's first step (compilation, the communicators' start) is always given at least 600 s. A
validation pass, a checkpoint save or the profiler's work inside the loop is given 30 minutes
(`LONG_PHASE_S`), apart from the step's time.

The flight recorder keeps the last collectives of every process group (gloo and NCCL): its size is set
through `TORCH_FR_BUFFER_SIZE` by `titanrush.distributed.init`. Reading it uses torch's private
`_dump_fr_trace_json`; where a torch build lacks it, the line names the phase only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HANG_STATUS = 4
FIRST_STEP_S = 600.0  # the attempt's first step: compilation, communicators, first allocations
MIN_DERIVED_S = 120.0  # the derived timeout's floor
FACTOR = 10.0  # the derived timeout: FACTOR x the median step time
MEASURED = 5  # steps measured before the derived timeout applies
LONG_PHASE_S = 1800.0  # a validation pass or a checkpoint save inside the loop
REPORT_S = 60.0  # the most the report may take before the process ends anyway
ERROR_PREFIX = "StepTimeout: "  # how the launcher finds the watchdog's report in torchrun's error file


class StepTimeout(Exception):
    """The report the watchdog leaves for the launcher (its str is JSON: rank, step, seconds, waited: the
    phase and the collective, collective: the collective alone or "")."""


class StepWatchdog:
    """The watchdog thread of one rank (see the module docstring).

    Args:
        timeout: training.step_timeout in seconds; 0 derives it from the measured steps.
        rank: This process's rank.
        folder: Where the stacks and the flight recorder's dump go (made when they are written).
        backend: The process group's backend ("gloo", "nccl"), or "" without one.
        exit: Ends the process with a status (os._exit; a test passes its own).
        clock: The clock (time.monotonic; a test passes its own).
    """

    def __init__(
        self,
        timeout: float,
        *,
        rank: int,
        folder: Path,
        backend: str = "",
        exit: Callable[[int], Any] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured = timeout
        self.rank, self.folder, self.backend, self._exit, self._clock = rank, folder, backend, exit, clock
        self.step = 0
        self.phase = ""
        self.allowed = 0.0
        self._deadline: float | None = None
        self._began = 0.0
        self._apart = 0.0  # seconds of this step spent `apart` (not measured)
        self._steps = 0  # steps this attempt has begun
        self._times: deque[float] = deque(maxlen=50)  # the measured steps (the attempt's first left out)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="titanrush-watchdog", daemon=True)
        self._thread.start()

    def step_allowance(self) -> float:
        """The seconds the next step may take."""
        first = self._steps == 0
        if self.configured > 0:
            return max(self.configured, FIRST_STEP_S) if first else self.configured
        if first or len(self._times) < MEASURED:
            return FIRST_STEP_S
        return max(MIN_DERIVED_S, FACTOR * statistics.median(self._times))

    def begin(self, step: int) -> None:
        """Arm for `step` (its first phase: data loading)."""
        self.allowed = self.step_allowance()
        self.step, self.phase = step, "data loading"
        self._began, self._apart = self._clock(), 0.0
        self._deadline = self._began + self.allowed
        self._steps += 1

    def mark(self, phase: str) -> None:
        """The phase the step is in now (named in the line if the step does not finish)."""
        self.phase = phase

    def end(self) -> None:
        """The step finished: its time is measured (the attempt's first left out), the watchdog disarmed."""
        if self._deadline is None:
            return
        if self._steps > 1:
            self._times.append(self._clock() - self._began - self._apart)
        self._deadline = None

    @contextlib.contextmanager
    def apart(self, phase: str, seconds: float = LONG_PHASE_S) -> Iterator[None]:
        """A phase of the step with its own allowance (a validation pass, a checkpoint save): its time is
        not measured as the step's, and the step's own deadline moves on by it."""
        phase_before, allowed, deadline = self.phase, self.allowed, self._deadline
        t0 = self._clock()
        self.phase, self.allowed = phase, max(seconds, allowed)
        self._deadline = t0 + self.allowed
        try:
            yield
        finally:
            spent = self._clock() - t0
            self._apart += spent
            self.phase, self.allowed = phase_before, allowed
            self._deadline = None if deadline is None else deadline + spent

    def close(self) -> None:
        """Stop the thread (the loop is over)."""
        self._deadline = None
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.is_set():
            deadline = self._deadline
            now = self._clock()
            if deadline is not None and now >= deadline:
                self.expire()
                return
            self._stop.wait(min(1.0, deadline - now) if deadline is not None else 1.0)

    def expire(self) -> None:
        """The step did not finish: stacks, flight recorder, one line, the launcher told, the exit (which
        comes whatever the report meets: an error, or a lock it waits on for REPORT_S)."""
        backstop = threading.Timer(REPORT_S, self._exit, (HANG_STATUS,))
        backstop.daemon = True
        backstop.start()
        try:
            self._report()
        finally:
            backstop.cancel()
            self._exit(HANG_STATUS)

    def _report(self) -> None:
        pending = pending_collectives(self.backend) if self.backend else []
        collective = describe_collective(pending, self.backend) if pending else ""
        waited = self.phase + (f", in {collective}" if collective else "")
        seconds = f"{self.allowed:.1f}".removesuffix(".0")
        line = f"rank {self.rank}: step {self.step} did not finish in {seconds} s (waiting in {waited}"
        where = self._write_report(line, pending)
        print(f"titanrush: {line}; {where})", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        report = {
            "rank": self.rank,
            "step": self.step,
            "seconds": seconds,
            "waited": waited,
            "collective": collective,
        }
        tell_launcher(StepTimeout(json.dumps(report)))
        sys.stderr.flush()

    def _write_report(self, line: str, pending: list[dict[str, Any]]) -> str:
        """`<folder>/rank<R>.txt` (the line, every thread's stack, the pending collectives) and the flight
        recorder's dump; returns where they went, for the line."""
        path = self.folder / f"rank{self.rank}.txt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{line})\n\nPython stacks (every thread):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.write("\nPending collectives (flight recorder):\n")
                f.write(json.dumps(pending, indent=1) + "\n")
            dump = flight_recorder_dump(self.backend)
            if dump:
                (self.folder / f"fr_trace_rank_{self.rank}").write_bytes(dump)
        except OSError as e:
            return f"the stacks could not be written to {path} ({e.strerror}): they follow"
        return f"stacks in {path}"


def tell_launcher(error: Exception) -> None:
    """Leave `error` in torchrun's error file for this worker (a no-op outside torchrun)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):  # (the report is a courtesy; the exit status is what counts)
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)


def _recorder(backend: str, suffix: str) -> Callable[..., bytes] | None:
    """torch's flight recorder reader for `backend` (private, so looked up with care), or None."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    names = [f"_dump_nccl_trace{suffix}"] if backend == "nccl" else []
    return next((f for n in [*names, f"_dump_fr_trace{suffix}"] if (f := getattr(c10d, n, None))), None)


def pending_collectives(backend: str) -> list[dict[str, Any]]:
    """The flight recorder's collectives that have not completed, oldest first ([] when it has none or
    cannot be read)."""
    reader = _recorder(backend, "_json")
    if reader is None:
        return []
    try:
        trace = json.loads(reader(True, False))
    except Exception:  # (a torch without it, or a recorder turned off)
        return []
    groups = {name: cfg.get("desc") or name for name, cfg in trace.get("pg_config", {}).items()}
    pending = []
    for e in trace.get("entries", []):
        if e.get("retired") or e.get("state") == "completed":
            continue
        pg = e.get("process_group") or ["", ""]
        e["group"] = pg[1] or groups.get(pg[0], pg[0])
        pending.append(e)
    return sorted(pending, key=lambda e: e.get("record_id", 0))


def describe_collective(pending: list[dict[str, Any]], backend: str) -> str:
    """The collective a rank waits in: under NCCL the oldest pending one (the GPU's stream is stuck there,
    the later ones queue behind it); under gloo the newest (the host thread blocks in the collective it
    called last; an older one may be an asynchronous one in flight)."""
    e = pending[0] if backend == "nccl" else pending[-1]
    more = f" ({len(pending)} pending)" if len(pending) > 1 else ""
    name, seq = e.get("profiling_name", "a collective"), e.get("collective_seq_id")
    return f"{name} on {e['group']}, collective {seq}{more}"


def flight_recorder_dump(backend: str) -> bytes:
    """The flight recorder's full dump in torch's pickle format (b"" where not available)."""
    reader = _recorder(backend, "")
    if reader is None:
        return b""
    try:
        return reader()
    except Exception:
        return b""
