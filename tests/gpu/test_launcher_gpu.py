"""On GPUs: the launcher checks the config in a child it forks (which reads the GPUs' memory through CUDA)
and starts the workers; the launcher itself holds no CUDA context, and no GPU memory, for the run's life.
A config whose plan fits no GPU ends before any worker starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multigpu


def env() -> dict[str, str]:
    return dict(
        os.environ,
        NGPU="2",
        NCCL_NVLS_ENABLE="0",
        NVSHMEM_DISABLE_NVLS="1",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    )


def gpu_files(pid: int) -> list[str]:
    """The GPU device files the process holds open."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:  # (closed meanwhile)
            continue
    return sorted({link for link in links if link.startswith("/dev/nvidia")})


def has_cuda_context(pid: int) -> bool:
    """Whether the process has a CUDA context: the CUDA runtime opens the unified memory device for one
    (NVML, which torch may ask for the GPUs' count, opens the control and GPU files only)."""
    return "/dev/nvidia-uvm" in gpu_files(pid)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_the_launcher_holds_no_gpu_while_its_workers_train(tmp_path):
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--job.name", "run"]
    cmd += ["--training.steps", "400", "--data.dataset", "synthetic", "--metrics.log_freq", "1"]
    proc = subprocess.Popen(  # (run_train.sh execs the launcher: this pid is the launcher's)
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        rows = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (rows.exists() and any("loss" in json.loads(x) for x in rows.read_text().splitlines())):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.5)
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        assert all(has_cuda_context(w) for w in workers), [gpu_files(w) for w in workers]
        assert not has_cuda_context(proc.pid), gpu_files(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]


def test_a_plan_that_fits_no_gpu_ends_before_any_worker_starts(tmp_path):
    """The 405B on two GPUs: the check, in the launcher's child, reads the GPUs' memory and refuses it."""
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--model.flavor", "405B"]
    res = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("titanrush: config error: "), lines
    assert "GiB" in lines[0] and "[rank" not in res.stdout + res.stderr, lines
    assert list(tmp_path.iterdir()) == []
