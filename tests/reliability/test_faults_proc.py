"""Process faults of long runs (issue #48), each reproduced on CPU with the debug model, and the one line and
exit status each must end with: a rank killed with `kill -9` during a save (the launcher names the signal,
the rank left says one line, no gloo traceback), a second Ctrl-C to a job of several processes (it stops at
once, as one process does), a reader that closes the pipe (`--help | head -1`: a quiet exit 141), and a
signal to `titanrush sweep` or `rush` while a run of theirs is in progress (passed on to the run, whose
processes all end, then one line and 128 + N).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import TINY
from loop_helpers import Child, alive, children, small_args

from titanrush.run.launch import first_failure

ROOT = Path(__file__).resolve().parents[2]
CPU_RUN = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--data.dataset",
    "synthetic",
    *TINY,
]


def two_ranks(dump: Path, name: str, *extra: str, tiny: bool = True) -> Child:
    """A long run in two processes under titanrush's launcher (what `NGPU=2 ./run_train.sh` runs once the
    config is checked), read line by line; of the one-layer model, or with `tiny=False` the debug model."""
    args = small_args(dump, name, "--training.steps", "1000", *extra, tiny=tiny)
    launch = [sys.executable, "-m", "titanrush.run.launch", "--standalone", "--nproc_per_node=2"]
    return Child([*launch, "-m", "titanrush.train", *args])


def titanrush_lines(log: str) -> list[str]:
    return [x for x in log.splitlines() if x.startswith("titanrush:")]


def tree(pid: int) -> list[int]:
    """The pids of every process under `pid` (Linux /proc)."""
    return [p for child in children(pid) for p in (child, *tree(child))]


def kill_left(pids: list[int]) -> None:
    """Never leave a process of a test running."""
    for pid in filter(alive, pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------
# kill -9 of one rank during a save


@pytest.mark.parallel
def test_a_rank_killed_during_a_save_is_named_with_its_signal_and_the_other_says_one_line(tmp_path):
    """The launcher used to say `rank 1 ended first, its lines above say why` of a rank that could print
    nothing, under some 55 lines of gloo traceback from rank 0."""
    child = two_ranks(tmp_path, "killed", "--checkpoint.enable", "--checkpoint.interval", "2")
    child.wait_for("step 2  loss")  # (both ranks go on into step 2's save)
    workers = children(child.proc.pid)
    try:
        rank1 = [p for p in workers if "RANK=1" in Path(f"/proc/{p}/environ").read_text().split("\0")]
        os.kill(rank1[0], signal.SIGKILL)
        status, log = child.finish(timeout=120)
    finally:
        kill_left(workers)
    assert status == 128 + signal.SIGKILL, log[-3000:]
    assert "Traceback" not in log and "RuntimeError" not in log, log[-3000:]
    lines = titanrush_lines(log)
    assert lines[-1] == (
        "titanrush: the job ended with exit status 137: rank 1 ended first, killed by signal 9 "
        "(SIGKILL: a kill -9, or the host's out-of-memory killer)"
    ), log[-3000:]
    lost = [x for x in lines if x.startswith("titanrush: error: rank 0 lost another rank of the job")]
    assert len(lost) == 1, log[-3000:]  # (in place of gloo's traceback)
    assert not [p for p in (tmp_path / "killed" / "checkpoint").glob("step-*") if p.suffix != ".tmp"]


def test_the_first_failure_is_a_rank_killed_by_sigkill_among_those_of_its_second():
    """torchrun dates failures in whole seconds: the ranks that lost a killed one fail in its second."""

    class Failure:
        def __init__(self, exitcode: int, timestamp: int) -> None:
            self.exitcode, self.timestamp = exitcode, timestamp

    lost, killed = Failure(1, 100), Failure(-9, 100)
    assert first_failure({0: lost, 3: killed, 1: lost}) == (3, killed)
    assert first_failure({0: Failure(2, 99), 3: killed})[0] == 0  # (an earlier second: that one)
    assert first_failure({1: Failure(130, 100), 0: Failure(-15, 100)})[0] == 1  # (torchrun's order)


# ------------------------------------------------------------------------------------------------
# A second Ctrl-C to a job of several processes


@pytest.mark.parallel
def test_a_second_ctrl_c_stops_a_job_of_two_processes_at_once(tmp_path):
    """torchrun passes a second Ctrl-C on to its workers as SIGTERM, which they took as one more request to
    stop after the step: the job finished its step and saved (2-3 s) where one process stops at once."""
    # (steps of a second or so: the second Ctrl-C comes well within the step that the first one ends)
    slower = ["--training.local_batch_size", "8"]
    child = two_ranks(
        tmp_path, "twice", "--checkpoint.enable", "--checkpoint.interval", "500", *slower, tiny=False
    )
    child.wait_for("step 2  loss")
    workers = children(child.proc.pid)
    try:
        child.proc.send_signal(signal.SIGINT)
        child.wait_for("SIGINT received")
        child.wait_for("SIGINT received")  # (both ranks are stopping after their step)
        child.proc.send_signal(signal.SIGINT)
        status, log = child.finish(timeout=120)
    finally:
        kill_left(workers)
    assert status == 128 + signal.SIGINT, log[-3000:]
    assert "Traceback" not in log and "stopped by SIGINT after step" not in log, log[-3000:]
    lines = titanrush_lines(log)
    assert "titanrush: interrupted: stopped at once, nothing saved (exit status 130)" in lines, log[-3000:]
    assert lines[-1] == (
        "titanrush: the launcher got a second SIGINT: its workers stopped at once, without saving"
    ), log[-3000:]
    assert not [p for p in (tmp_path / "twice" / "checkpoint").glob("step-*") if p.suffix != ".tmp"]


# ------------------------------------------------------------------------------------------------
# A reader that closes the pipe


@pytest.mark.parametrize(
    "cmd",
    [
        ["./run_train.sh", "--help"],
        [sys.executable, "-m", "titanrush", "--help"],
        [sys.executable, "-m", "titanrush.tools.rush", "--help"],
    ],
    ids=["train", "titanrush", "rush"],
)
def test_help_into_a_closed_pipe_exits_quietly_with_141(cmd):
    """`--help | head -1` once head has gone (the pipe's reading end closed): a BrokenPipeError traceback
    used to follow the first line. (argparse's own --help writes through such a pipe quietly.)"""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        res = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)
    assert (res.returncode, res.stderr) == (128 + signal.SIGPIPE, "")


# ------------------------------------------------------------------------------------------------
# Signals to titanrush sweep and rush


def run_log(out: Path) -> str:
    """The output of the tool's run in progress so far ('' before it starts)."""
    logs = list((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []
    return logs[0].read_text() if logs else ""


@pytest.mark.parallel
@pytest.mark.parametrize(
    ("tool", "sig"),
    [
        (["sweep", "--ngpu", "2", "--grid", "tp=1"], signal.SIGTERM),  # a run of 2 ranks under the launcher
        (["rush", "ladder"], signal.SIGINT),  # one training process
    ],
    ids=["sweep-SIGTERM", "rush-SIGINT"],
)
def test_a_signal_to_a_tool_stops_its_run_and_every_process_of_it(tmp_path, tool, sig):
    """The tools used to die of SIGTERM at once, leaving their run (in a session of its own) and its ranks
    running, and to end a Ctrl-C with a KeyboardInterrupt traceback."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "titanrush", *tool, "--config", "train_configs/debug.toml", "--steps", "500"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        [*cmd, "--output", str(out), *CPU_RUN],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    run: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while "step 1  loss" not in run_log(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        run = tree(proc.pid)
        assert run and proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        out_text, err = proc.communicate(timeout=180)
        time.sleep(0.5)  # (the run's processes have ended before the tool: it waits for them)
        left = [p for p in run if alive(p)]
    finally:
        kill_left([*run, proc.pid])
    assert proc.returncode == 128 + sig, out_text + err
    assert "Traceback" not in out_text + err and not left, (left, out_text + err)
    prog, name = f"titanrush {tool[0]}", signal.Signals(sig).name
    assert err == f"{prog}: stopped by {name}; its run in progress stopped too (exit status {128 + sig})\n"
    assert f"titanrush: stopped by {name} after step" in run_log(out), run_log(out)[-2000:]
