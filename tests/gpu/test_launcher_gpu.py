"""On GPUs: the launcher checks the config in a child it forks, which reads the GPUs' memory through CUDA; a
config whose plan fits no GPU ends there, before any worker starts. (A run that passes the check:
test_console_gpu.py and test_hang_gpu.py launch theirs through the launcher.)"""

from __future__ import annotations

import os
import subprocess
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


def test_a_plan_that_fits_no_gpu_ends_before_any_worker_starts(tmp_path):
    """The 405B on two GPUs: the check, in the launcher's child, reads the GPUs' memory and refuses it."""
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--model.flavor", "405B"]
    res = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("titanrush: config error: "), lines
    assert "GiB" in lines[0] and "[rank" not in res.stdout + res.stderr, lines
    assert list(tmp_path.iterdir()) == []
