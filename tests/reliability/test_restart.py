"""Restarts of a failed job (issue #48, `job.max_restarts`): the launcher starts the job again after a
failure, the restarted job resumes from the newest complete checkpoint, and each restart is one console
line and one metrics.jsonl row; the final losses are those of a run that was never interrupted, bitwise.
A hang (`kill -STOP` of a worker) ends the job like any failure, and with no restart left ends it with
status 4 and one line naming the rank that stalled; a worker killed (`kill -9`) on one of two nodes restarts
both.
A config error, a non-finite stop and a stop by signal are never restarted. (Without `job.max_restarts` a
failure ends the job as before: tests/reliability/test_faults_proc.py.)

The runs are a one-layer debug model in two processes on CPU (gloo) under titanrush's launcher, a worker
killed with `kill -9` or stopped with `kill -STOP` from here; the launcher's choices are also tested with
a stand-in worker of a few lines, and as functions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from loop_helpers import Child, alive, children, free_port, read_rows, run_ok, small_args

from titanrush.run.launch import outcome, restartable
from titanrush.run.watchdog import ERROR_PREFIX, HANG_STATUS

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
RUN = ["--training.steps", str(STEPS), "--data.dataset", "synthetic", "--checkpoint.enable"]
# Saves every 4th step, steps of ~0.1 s: a worker stopped just after a save is stopped inside a step, as a
# hang is (one stopped inside a save leaves its peer the save's 30 minutes, run/watchdog.py).
RUN += ["--checkpoint.interval", "4", "--training.seq_len", "64", "--training.local_batch_size", "8"]


def launch(dump: Path, name: str, *extra: str) -> Child:
    """The debug run `dump/name` in two processes under titanrush's launcher (what `NGPU=2 ./run_train.sh`
    runs once the config is checked), read line by line."""
    cmd = [sys.executable, "-m", "titanrush.run.launch", "--standalone", "--nproc_per_node=2"]
    return Child([*cmd, "-m", "titanrush.train", *small_args(dump, name, *RUN, *extra)])


def worker(child: Child, rank: int) -> int:
    """The pid of the launcher's worker of `rank`."""
    for pid in children(child.proc.pid):
        if f"RANK={rank}" in Path(f"/proc/{pid}/environ").read_text().split("\0"):
            return pid
    raise AssertionError(f"no worker of rank {rank}")


def finish(child: Child, timeout: float = 300) -> tuple[int, str]:
    """(status, output) of the launcher, no process of it left behind."""
    workers = children(child.proc.pid)
    try:
        return child.finish(timeout=timeout)
    finally:
        for pid in filter(alive, workers):
            os.kill(pid, signal.SIGKILL)


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of the run's series: for each step the row of its latest attempt."""
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


def titanrush_lines(log: str) -> list[str]:
    return [x for x in log.splitlines() if x.startswith("titanrush:")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the run that the tests interrupt, never interrupted."""
    dump = tmp_path_factory.mktemp("uninterrupted")
    run_ok(["-m", "titanrush.train", *small_args(dump, "ref", *RUN)], 2)  # (the same ranks, no launcher)
    return losses(dump / "ref")


# ------------------------------------------------------------------------------------------------
# The real trainer: a worker killed, a worker stopped


@pytest.mark.parallel
def test_a_hang_restarts_the_job_and_with_no_restart_left_ends_it_naming_the_stalled_rank(
    tmp_path, uninterrupted
):
    """Two hangs in one job of two workers, `job.max_restarts 1`:

    1. a worker stopped (`kill -STOP`): the other rank's step watchdog ends that attempt (status 4), the
       launcher kills the stopped worker at once and restarts the job;
    2. the same again with no restart left: the job ends with status 4 and one line naming the rank that
       stalled and the collective the other waited in, the waiting rank's stacks and pending collectives
       in the run folder.

    The restart resumes from the newest complete checkpoint and is one line and one metrics row naming
    its cause; every step logged equals the uninterrupted run's, bitwise. (A worker killed with `kill -9`:
    the two-node test below, which carries its restarted run to the end.)"""
    child = launch(tmp_path, "hangs", "--job.max_restarts", "1", "--training.step_timeout", "3")
    child.wait_for("step 5  loss")
    stalled = worker(child, 1)
    os.kill(stalled, signal.SIGSTOP)
    child.wait_for("titanrush: restart 1 of 1")
    child.wait_for("checkpoint (sync save)")  # (the restarted job's first save: the next is 4 steps on)
    stalled = worker(child, 1)
    os.kill(stalled, signal.SIGSTOP)
    stopped = time.monotonic()
    status, log = finish(child)
    took = time.monotonic() - stopped
    assert status == HANG_STATUS, log[-3000:]
    assert took < 60 and not alive(stalled), took  # (torchrun alone waits 30 s before it kills a stopped one)
    lines = titanrush_lines(log)
    restarts = [x for x in lines if x.startswith("titanrush: restart")]
    stall = (
        "rank 1 stalled: the launcher found it stopped (a kill -STOP, or a debugger) and killed it; rank 0 "
    )
    assert len(restarts) == 1, log[-3000:]
    assert restarts[0].startswith(f"titanrush: restart 1 of 1 (job.max_restarts) after {stall}"), restarts
    assert restarts[0].endswith(": the job starts again and resumes from its newest complete checkpoint")
    assert "rank 0 waited 3 s at step" in restarts[0] and "gloo:" in restarts[0], restarts
    assert lines[-1].startswith(
        f"titanrush: the job ended with exit status 4 (a hang: a step did not finish in time): {stall}waited "
        "3 s at step "
    ), lines
    assert ", in gloo:" in lines[-1] and " on default_pg, collective " in lines[-1], lines[-1]
    own = [x for x in lines if x.startswith("titanrush: rank 0: step ")]
    report = tmp_path / "hangs" / "hang" / "rank0.txt"
    assert len(own) == 2 and " did not finish in 3 s (waiting in " in own[-1], lines
    assert own[-1].endswith(f"; stacks in {report})"), own
    text = report.read_text()
    assert "Python stacks (every thread)" in text and "in train_step" in text, text[:3000]
    assert "Pending collectives (flight recorder)" in text and '"profiling_name": "gloo:' in text, text
    assert 'File "' in log.split(own[-1])[1]  # (the stacks on stderr too)
    assert (tmp_path / "hangs" / "hang" / "fr_trace_rank_0").stat().st_size > 0
    rows = read_rows(tmp_path / "hangs")
    rows_restarts = [r for r in rows if "restart" in r]
    assert [(r["restart"], r["attempt"]) for r in rows_restarts] == [(1, 2)], rows_restarts
    assert rows_restarts[0]["cause"].startswith(stall), rows_restarts
    resumed = rows_restarts[0]["step"]  # (the step resumed after: a checkpoint's, the stop came after step 5)
    assert resumed % 4 == 0 and 4 <= resumed < STEPS, rows_restarts
    assert "Traceback" not in log, log[-3000:]
    after = [r["step"] for r in rows if r.get("attempt") == 2 and "loss" in r]
    assert after and min(after) == resumed + 1, (resumed, after)  # the restarted attempt trained on
    assert max(after) >= resumed + 4, (resumed, after)  # (to its first save at least)
    logged = losses(tmp_path / "hangs")
    assert logged == {step: uninterrupted[step] for step in logged}  # (every step logged, bitwise)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))


@pytest.mark.parallel
def test_on_two_nodes_a_killed_worker_restarts_every_launcher_and_the_job_meets_again(
    tmp_path, uninterrupted
):
    """Two launchers as two nodes of one job (c10d rendezvous on this host, one worker each): a worker
    killed (`kill -9`) on one node, every launcher restarts its own (the others' workers lost a peer), its
    own launcher naming the signal; the restarted job meets in a rendezvous of its own, resumes from the
    newest complete checkpoint and ends as if never interrupted, bitwise."""
    port = free_port()
    cmd = [sys.executable, "-m", "titanrush.run.launch", "--nnodes=2", "--nproc_per_node=1"]
    cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=restart-test"]
    args = small_args(tmp_path, "nodes", *RUN, "--job.max_restarts", "1")
    nodes = [Child([*cmd, f"--node_rank={n}", "-m", "titanrush.train", *args]) for n in (0, 1)]
    log = tmp_path / "nodes" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and any(r.get("step") == 5 for r in read_rows(log.parent))):
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes)
        time.sleep(0.2)
    workers = {n: children(node.proc.pid) for n, node in enumerate(nodes)}
    rank1 = next(
        p for p in sum(workers.values(), []) if "RANK=1" in Path(f"/proc/{p}/environ").read_text().split("\0")
    )
    killed_node = next(n for n, pids in workers.items() if rank1 in pids)  # (c10d orders nodes as they come)
    os.kill(rank1, signal.SIGKILL)
    results = [finish(n) for n in nodes]
    for status, out in results:
        assert status == 0, out[-3000:]
        assert out.count("titanrush: restart 1 of 1 (job.max_restarts) after rank ") == 1, out[-3000:]
    killed = "rank 1 was killed by signal 9 (SIGKILL: a kill -9, or the host's out-of-memory killer)"
    assert (
        f"titanrush: restart 1 of 1 (job.max_restarts) after {killed}: the job starts again and resumes from "
        "its newest complete checkpoint"
    ) in titanrush_lines(results[killed_node][1]), results[killed_node][1][-3000:]
    rows_restarts = [r for r in read_rows(tmp_path / "nodes") if "restart" in r]
    assert [(r["restart"], r["attempt"]) for r in rows_restarts] == [(1, 2)], rows_restarts
    assert rows_restarts[0]["step"] % 4 == 0 and 4 <= rows_restarts[0]["step"] < STEPS, rows_restarts
    assert losses(tmp_path / "nodes") == uninterrupted


@pytest.mark.parallel
def test_a_config_error_ends_the_job_before_any_worker_starts_and_is_not_restarted(tmp_path):
    """A checkpoint to load that does not exist: the launcher's check of the config refuses it (status 2,
    its one line) before any worker starts, and nothing is restarted. (A config error that only the
    workers find, after the launch: the stand-in below, and tests/parallel/test_launch.py.)"""
    child = launch(
        tmp_path, "bad", "--job.max_restarts", "2", "--checkpoint.load_path", str(tmp_path / "none")
    )
    status, log = finish(child)
    assert status == 2, log[-3000:]
    lines = titanrush_lines(log)
    assert lines == [
        f"titanrush: config error: checkpoint folder {tmp_path / 'none'} does not exist; check "
        "checkpoint.load_path"
    ], log
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------------
# The launcher's choices, with a stand-in worker: rank 1 ends with the status given (a negative one: killed
# by that signal) on the job's first start, and with 0 once restarted; rank 0 after it with 0.

WORKER = """
import os, signal, sys, time
rank, how = int(os.environ["RANK"]), int(os.environ["HOW"])
restart = os.environ.get("TITANRUSH_RESTART", "")
if rank == 1:
    print(f"worker: start {restart or 0}: {os.environ.get('TITANRUSH_RESTART_CAUSE', '')}", flush=True)
time.sleep(0.3 if rank == 1 else 1.2)
if rank == 1 and not restart:
    os.kill(os.getpid(), -how) if how < 0 else sys.exit(how)
"""


def stand_in(tmp_path: Path, how: int, restarts: int) -> tuple[int, str]:
    """(status, output) of the launcher over two stand-in workers, the config allowing `restarts`."""
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "titanrush.run.launch", "--standalone", "--nproc_per_node=2"]
    cmd += [str(tmp_path / "worker.py"), "--job.max_restarts", str(restarts)]  # (the launcher reads it)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env["HOW"] = str(how)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.parallel
def test_a_config_error_is_not_restarted(tmp_path):
    status, log = stand_in(tmp_path, 2, restarts=2)
    assert status == 2, log
    assert titanrush_lines(log) == [
        "titanrush: the job ended with exit status 2 (a config error): rank 1 ended first, its lines above "
        "say why"
    ], log
    assert log.count("worker: start") == 1, log


@pytest.mark.parallel
def test_a_restarted_job_is_told_its_restart_and_cause(tmp_path):
    status, log = stand_in(tmp_path, 1, restarts=3)
    assert status == 0, log
    cause = "rank 1 ended with exit status 1 (an error; its lines above say why)"
    assert f"worker: start 1: {cause}" in log, log  # (what rank 0 of a trainer writes into metrics.jsonl)
    assert log.count("worker: start") == 2 and log.count("titanrush: restart") == 1, log


# ------------------------------------------------------------------------------------------------
# The launcher's choices as functions


@pytest.mark.parametrize(
    ("exitcode", "again"),
    [
        (1, True),  # an error, a crash, a lost peer
        (HANG_STATUS, True),
        (-signal.SIGKILL, True),  # kill -9, the out-of-memory killer
        (-signal.SIGSEGV, True),
        (-signal.SIGABRT, True),
        (2, False),  # a config error
        (3, False),  # a non-finite stop
        (128 + signal.SIGTERM, False),  # the worker's own stop on SIGTERM (preemption)
        (128 + signal.SIGINT, False),
        (-signal.SIGTERM, False),  # SIGTERM before the worker's handler was in place
        (-signal.SIGINT, False),
    ],
)
def test_what_is_restarted(exitcode, again):
    assert restartable(exitcode) is again


def failure(exitcode: int, timestamp: int = 100, report: dict | None = None) -> SimpleNamespace:
    """torchrun's ProcessFailure as the launcher reads it (a watchdog's report in its error file)."""
    message = {"message": ERROR_PREFIX + json.dumps(report), "extraInfo": {}} if report else ""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message=message)


def test_a_hang_names_the_rank_that_never_reported_and_where_the_others_waited():
    waited = "forward and backward, in gloo:all_reduce on default_pg, collective 71"
    report = {"rank": 0, "step": 7, "seconds": 5, "waited": waited, "collective": "gloo:all_reduce ..."}
    failures = {0: failure(HANG_STATUS, report=report), 1: failure(-signal.SIGKILL), 2: failure(1)}
    status, cause, again = outcome(failures, stopped={1})
    assert (status, again) == (HANG_STATUS, True)
    assert cause == (
        "rank 1 stalled: the launcher found it stopped (a kill -STOP, or a debugger) and killed it; rank 0 "
        f"waited 5 s at step 7 in {waited}"
    )
    # a rank that hung where its watchdog could not run, killed at the launcher's teardown
    cause = outcome({0: failure(HANG_STATUS, report=report), 1: failure(-signal.SIGKILL, 130)}, set())[1]
    assert cause.startswith("rank 1 stalled: it never reported a timeout of its own; rank 0 waited 5 s"), (
        cause
    )
    # every rank reported: the one outside any collective is the one the others wait for
    busy = {**report, "rank": 1, "waited": "forward and backward", "collective": ""}
    failures = {0: failure(HANG_STATUS, report=report), 1: failure(HANG_STATUS, report=busy)}
    assert outcome(failures, set())[1].startswith("rank 1 stalled outside any collective; rank 0 waited")


def test_a_restarted_job_waits_for_the_failed_attempts_lock(tmp_path, monkeypatch):
    """A worker of the failed attempt (rank 0, holding the run folder's lock) may take a moment to be gone
    after the launcher killed it: the restarted job waits for the lock, where a new run is refused."""
    from titanrush.config import ConfigError
    from titanrush.run import run_dir

    held = run_dir.RunLock()
    assert held.acquire(tmp_path) == ""
    with pytest.raises(ConfigError, match="is in use by another run"):
        run_dir.check(tmp_path, overwrite=True, rank=0)
    monkeypatch.setenv("TITANRUSH_RESTART", "1")
    timer = threading.Timer(1.0, held.release)
    timer.start()
    started = time.monotonic()
    lock = run_dir.check(tmp_path, overwrite=True, rank=0)
    assert lock.fd is not None and 0.5 < time.monotonic() - started < run_dir.RESTART_LOCK_WAIT_S
    lock.release()
    timer.join()
