"""A job of several processes ends like a one-process run: with the workers' own exit status (2 a config
error, 3 a non-finite stop, 128 + N a signal) and one line, not torchrun's ChildFailedError traceback and
status 1 (`titanrush.run.launch`, which run_train.sh starts)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import child_env

from titanrush.checkpoint import integrity
from titanrush.run.launch import check_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.parallel

# A worker of its own: rank 1 exits with the status given, rank 0 after it with 0; or both wait for a signal.
WORKER = """
import os, sys, time
rank, how = int(os.environ["RANK"]), sys.argv[1]
if how == "wait":
    open(sys.argv[2] + f".{rank}", "w").close()
    time.sleep(60)
time.sleep(0.5 if rank == 1 else 2)
sys.exit(int(how) if rank == 1 else 0)
"""


def launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "titanrush.run.launch",
        "--standalone",
        "--nproc_per_node=2",
        str(tmp_path / "worker.py"),
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def ended(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in out + err and "ChildFailedError" not in err, out + err
    return proc.returncode, err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--training.steps", "2_0"], "training.steps must be an integer, got '2_0'"),  # (read, no torch)
        (["--training.seq_len", "1"], "training.seq_len must be >= 2, got 1"),  # (no torch either)
        (
            ["--training.local_batch_size", "3", "--training.global_batch_size", "4"],
            "x dp = 3 x 2 = 6",
        ),  # (the whole check's)
    ],
    ids=["parse", "value", "world_size"],
)
def test_the_launcher_checks_the_config_once_before_any_worker_starts(tmp_path, args, said):
    """A config error ends the job with status 2 and the check's one line, before a worker exists: no
    line of the workers or of the launcher's end. The check is that of the job's world size (a global
    batch of 4 is no multiple of 3 x 2 on two ranks; on one it would be 3 x 1)."""
    cmd = [sys.executable, "-m", "titanrush.run.launch", "--standalone", "--nproc_per_node=2"]
    common = ["--job.dump_folder", str(tmp_path), "--data.dataset", "synthetic"]
    res = subprocess.run(
        [*cmd, "-m", "titanrush.train", *common, *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
    )
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and said in lines[0], res.stderr
    assert lines[0].startswith("titanrush: config error: ") and res.stdout == "", res.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_process_count_that_torchrun_resolves_is_left_to_the_workers_checks():
    """`--nproc_per_node=gpu` (or auto): the world size is torchrun's to find, so the launcher does not
    check the config for a guessed one (each worker checks it at start, as before)."""
    args = SimpleNamespace(
        module=True,
        training_script="titanrush.train",
        training_script_args=["--training.seq_len", "1"],  # (refused by a check of any world size)
        nnodes="1",
        nproc_per_node="gpu",
    )
    assert check_config(args) == 0  # (with a number, this config is refused: the tests above)


@pytest.mark.parametrize("status", [2, 3])
def test_the_launcher_ends_with_the_failed_workers_status_and_one_line(tmp_path, status):
    code, err = ended(launch(tmp_path, str(status)))
    assert code == status, err
    lines = [x for x in err.splitlines() if x.startswith("titanrush:")]
    assert len(lines) == 1 and f"exit status {status}" in lines[0] and "rank 1 ended first" in lines[0], err


def test_a_signal_to_the_launcher_ends_it_with_128_plus_n(tmp_path):
    proc = launch(tmp_path, "wait", str(tmp_path / "up"))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"up.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, err = ended(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "titanrush: the launcher got SIGTERM and stopped its workers" in err, err


def test_two_process_runs_end_with_the_trainers_status(tmp_path):
    """`NGPU=2 ./run_train.sh`: a non-finite stop is status 3; a resume under another optimizer is refused
    by the launcher's check, once; one that only the trainer can refuse (another optimizer's state in a
    checkpoint whose record names none; --check builds no optimizer) is status 2, with the trainer's
    line once per rank and the launcher's, and no abort of a process group left up."""
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    env["NGPU"] = "2"
    base = [
        "./run_train.sh",
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "r",
        "--training.steps",
        "4",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--data.dataset",
        "synthetic",
        "--no-metrics.tensorboard",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
    ]
    blowup = ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]
    res = subprocess.run(base + blowup, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 3 and "Traceback" not in out, out
    assert "titanrush: stopped: step 2: non-finite" in out and "exit status 3 (a non-finite" in out, out
    assert out.count("MFU: not reported (CPU") == 1, out  # rank 0 says it for the job, once
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoint").iterdir()) == ["step-1"]

    other = base + ["--optimizer.name", "adamw8bit"]
    res = subprocess.run(other, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and out.count("titanrush: config error: checkpoint") == 1, out
    assert "optimizer: saved by 'adamw', this run's is 'adamw8bit'" in out, out

    step = tmp_path / "r" / "checkpoint" / "step-1"
    info = json.loads((step / "titanrush.json").read_text())
    del info["optimizer"]
    (step / "titanrush.json").write_text(json.dumps(info))
    integrity.record_folder(step)  # (a healthy checkpoint that names no optimizer)
    res = subprocess.run(other, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out and "terminate called" not in out, out
    assert "titanrush: config error: checkpoint" in out and "optimizer" in out, out
    assert "exit status 2 (a config error)" in out, out
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoint").iterdir()) == ["step-1"]
