"""A quiet console: a job of several processes prints each library warning once (rank 0), no launcher
banner and no DeviceMesh deprecation; `metrics.verbose` gives every rank's output back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import child_env, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.parallel


def torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        str(script),
        *args,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


WARNING = "UserWarning: a library warning every rank meets"


def test_library_warnings_once_on_rank_0_unless_verbose():
    res = torchrun(Path(__file__).parent / "console_probe.py")
    out, err = res.stdout, res.stderr
    assert err.count(WARNING) == 1, err
    assert err.count("a warning torch logs on every rank") == 1, err
    # titanrush's INFO lines: rank 0's, on stdout, with neither a level nor a rank (only rank 0 prints them)
    assert out.count("titanrush info line") == 1 and "INFO" not in out and "[rank" not in out, out
    assert "titanrush info line" not in err, err
    # A rank's own trouble still shows: titanrush's warnings come from every rank, on stderr.
    assert "[rank0] WARNING titanrush warning line" in err and "[rank1] WARNING titanrush warning line" in err
    assert "warning line" not in out, out

    res = torchrun(Path(__file__).parent / "console_probe.py", "--verbose")
    out, err = res.stdout, res.stderr
    assert err.count(WARNING) == 4, err  # twice per rank: Python's own rule, reset by the filter change
    assert err.count("a warning torch logs on every rank") == 2, err
    assert "[rank0] titanrush info line" in out and "[rank1] titanrush info line" in out, out


def test_two_process_run_prints_no_banner_and_no_mesh_deprecation(tmp_path):
    """`NGPU=2 ./run_train.sh` on CPU (gloo): torchrun's OMP_NUM_THREADS banner and DeviceMesh's
    "Slicing a flattened dim from root mesh" warning were printed once per rank before."""
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}  # run_train.sh sets it
    env["NGPU"] = "2"
    args = [
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "2",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--data.dataset",
        "synthetic",
        "--no-metrics.tensorboard",
    ]
    cmd = ["./run_train.sh", *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "OMP_NUM_THREADS" not in out and "Slicing a flattened dim" not in out, out
    assert "Warning" not in out, out  # no library warning at all on this run
    # rank 0's progress lines on stdout, once, through the launcher; and in the run folder's console.log
    assert res.stdout.count("step 2  loss") == 1 and "[rank" not in res.stdout, res.stdout
    assert os.path.exists(tmp_path / "debug" / "metrics.jsonl")
    console = (tmp_path / "debug" / "console.log").read_text()
    steps = re.compile(r"^\S+ step \d+  ")
    assert [x for x in console.splitlines() if steps.match(x)] == [
        x for x in res.stdout.splitlines() if steps.match(x)
    ], console
