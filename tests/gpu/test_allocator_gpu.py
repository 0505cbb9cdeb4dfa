"""training.expandable_segments reaches CUDA's caching allocator, also where the run's checks start CUDA
before the trainer does (float8's check of the GPU's compute capability)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, torch
from titanrush import train
assert train.main(sys.argv[1:]) == 0
print("expandable:", any(s.get("is_expandable") for s in torch.cuda.memory_snapshot()))
"""


@pytest.mark.parametrize("expandable", [True, False])
def test_expandable_segments_reach_the_allocator_with_float8(tmp_path, expandable):
    pytest.importorskip("torchao", reason="float8 is torchao's (carried as a wheel to the GPU machine)")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    args = [
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "2",
        "--training.seq_len",
        "64",
        "--training.precision",
        "bf16",
        "--float8.enable",
        "--float8.min_size",
        "0",
        "--training.expandable_segments",
        str(expandable).lower(),
        "--no-metrics.tensorboard",
    ]
    env = {k: v for k, v in __import__("os").environ.items() if "ALLOC_CONF" not in k}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"expandable: {expandable}" in res.stdout, res.stdout[-2000:]
    assert "not applied" not in res.stderr
