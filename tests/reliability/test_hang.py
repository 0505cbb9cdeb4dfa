"""A hang ends (issue #48): a rank that stops responding does not hold the job. Each rank's step watchdog
(`training.step_timeout`) ends a step that does not finish in time with the rank's stacks, a line naming
the step, the phase and the collective it waited in, and exit status 4; the launcher ends with 4 and one
line naming the rank that stalled. Here the watchdog alone, in this process; `kill -STOP` of one worker
of a two-process job is the last of the three faults in tests/reliability/test_restart.py, and
tests/gpu/test_hang_gpu.py the same on NCCL.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from titanrush.run import watchdog as wd
from titanrush.run.watchdog import HANG_STATUS, StepWatchdog

# ------------------------------------------------------------------------------------------------
# The watchdog alone


def wait_for(codes: list[int], seconds: float) -> None:
    end = time.monotonic() + seconds
    while not codes and time.monotonic() < end:
        time.sleep(0.05)


def test_a_step_that_does_not_finish_ends_the_process_with_4_and_its_stacks(tmp_path, capfd):
    codes: list[int] = []
    dog = StepWatchdog(0.3, rank=3, folder=tmp_path / "hang", exit=codes.append)
    try:
        dog.begin(1)  # (the attempt's first step is allowed FIRST_STEP_S)
        dog.end()
        dog.begin(2)
        dog.mark("optimizer step")
        wait_for(codes, 10)
    finally:
        dog.close()
    assert codes == [HANG_STATUS]
    err = capfd.readouterr().err
    line = (
        f"titanrush: rank 3: step 2 did not finish in 0.3 s (waiting in optimizer step; stacks in {tmp_path}"
    )
    assert line + "/hang/rank3.txt)\n" in err, err
    assert "test_a_step_that_does_not_finish" in err  # this thread's stack
    text = (tmp_path / "hang" / "rank3.txt").read_text()
    assert "step 2 did not finish" in text and "wait_for" in text, text


def test_a_step_that_finishes_and_a_long_save_do_not_end_the_process(tmp_path):
    codes: list[int] = []
    dog = StepWatchdog(0.3, rank=0, folder=tmp_path, exit=codes.append)
    try:
        dog.begin(1)
        dog.end()
        for step in (2, 3):
            dog.begin(step)
            with dog.apart("checkpoint save", seconds=30):  # (its own allowance, and the step's moves on)
                time.sleep(0.5)
            time.sleep(0.1)
            dog.end()
        time.sleep(1.5)  # (disarmed between steps)
    finally:
        dog.close()
    assert codes == [] and not list(tmp_path.iterdir())


def test_the_derived_timeout_follows_the_measured_steps():
    clock = [0.0]
    dog = StepWatchdog(
        0, rank=0, folder=Path("/nonexistent"), exit=lambda status: None, clock=lambda: clock[0]
    )
    try:
        allowed = []
        for step, seconds in enumerate([100.0, 30.0, 30.0, 31.0, 29.0, 30.0, 30.0], start=1):
            dog.begin(step)
            allowed.append(dog.allowed)
            clock[0] += seconds
            dog.end()
        assert allowed == [wd.FIRST_STEP_S] * 6 + [wd.FACTOR * 30.0]  # (5 measured after the first)
        configured = StepWatchdog(5, rank=0, folder=Path("/nonexistent"), exit=lambda status: None)
        assert configured.step_allowance() == wd.FIRST_STEP_S  # (the attempt's first step: compilation)
        configured.begin(1)
        configured.end()
        assert configured.step_allowance() == 5
        configured.close()
    finally:
        dog.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (after the exit)
def test_the_process_ends_even_when_its_report_fails(tmp_path, monkeypatch):
    def broken(backend: str) -> list:
        raise RuntimeError("the flight recorder is gone")

    monkeypatch.setattr(wd, "pending_collectives", broken)
    codes: list[int] = []
    dog = StepWatchdog(0.2, rank=0, folder=tmp_path, backend="gloo", exit=codes.append)
    try:
        dog.begin(1)
        dog.end()
        dog.begin(2)
        wait_for(codes, 10)
    finally:
        dog.close()
    assert codes == [HANG_STATUS]
