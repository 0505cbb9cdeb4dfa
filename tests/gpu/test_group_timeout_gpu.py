"""job.collective_timeout reaches every NCCL group of the mesh (issue #48), not only the default group:
a mesh group's timeout is the configured one, and a group given a timeout that way fails a collective one
rank never enters after it, not after NCCL's 10 minutes. The gloo version, on CPU, is
tests/parallel/test_group_timeout.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_launch import ROOT, free_port

pytestmark = pytest.mark.multigpu
PROBE = str(Path(__file__).with_name("group_timeout_gpu_probe.py"))


def _run(mode: str, timeout: float, limit: float) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", PROBE, mode, str(timeout)]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - start


def test_every_group_of_the_mesh_has_the_configured_timeout():
    status, log, _ = _run("mesh", 77.0, 300)
    assert status == 0, log[-4000:]
    groups = re.findall(r"rank (\d) group (\S+) size (\d) timeout ([\d.]+)", log)
    assert len({(r, g) for r, g, _, _ in groups}) >= 4, log[-4000:]  # (the dims of size 1, the views)
    assert {float(t) for *_, t in groups} == {77.0}, groups
    assert {int(s) for _, _, s, _ in groups} == {1, 2}, groups  # (groups of one rank and of both)


def test_a_collective_one_rank_never_enters_fails_after_the_timeout_given():
    """NCCL's watchdog names the timeout it applied and how long the collective ran; it then aborts the
    communicator (the waiting call returns) and, after its debug dump, ends the process."""
    status, log, took = _run("missed", 6.0, 400)
    caught = re.search(
        r"collective operation timeout: WorkNCCL\(.*Timeout\(ms\)=6000\) ran for (\d+) milli", log
    )
    assert caught, log[-4000:]
    assert 6000 <= int(caught.group(1)) < 60_000, caught.group(0)  # (NCCL's default would be 600,000)
    assert status != 0 and took < 300, (status, took, log[-4000:])
