"""A checkpoint saved under one mesh resumes under another, data position included.

FSDP2 (2 ranks) saves at step 3 of 6; the run then resumes from that checkpoint as one process, as TP2 and
as PP2, each time with the same global batch: the resumed run must train on the batches the original
would have seen next, so its losses at steps 4-6 match the uninterrupted FSDP2 run's (to the parity
suite's tolerance: the meshes differ only in the order of floating-point sums).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT, STEPS, child_env, failure, free_port, read_metrics, run_train, train_args
from test_parity import RTOL

pytestmark = pytest.mark.parallel


def launch(dump, name: str, nproc: int, dp: int, *overrides: str) -> list[dict]:
    args = train_args(dump, name, dp, *overrides)
    if nproc == 1:
        cmd = [sys.executable, "-m", "titanrush.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "titanrush.train",
               *args]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, failure(cmd, res.stdout + res.stderr)
    return read_metrics(dump / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    dump = tmp_path_factory.mktemp("reshard")
    rows = run_train(dump, "fsdp2", 2, "--checkpoint.enable", "--checkpoint.interval", "3", dp=2)
    return dump, {r["step"]: r for r in rows}


TARGETS = {
    "one_process": (1, 1, []),
    "tp2": (2, 1, ["--parallelism.tp", "2"]),
    "pp2": (2, 1, ["--parallelism.pp", "2"]),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fsdp2_checkpoint_resumes_on_another_mesh(saved, target):
    dump, ref = saved
    nproc, dp, overrides = TARGETS[target]
    ckpt = dump / "fsdp2" / "checkpoint" / "step-3"
    rows = launch(dump, f"resume_{target}", nproc, dp, "--checkpoint.load_path", str(ckpt), *overrides)
    assert [r["step"] for r in rows] == list(range(4, STEPS + 1))  # continued at step 4
    for r in rows:
        for key in ("loss", "grad_norm"):
            assert abs(r[key] - ref[r["step"]][key]) <= RTOL * abs(ref[r["step"]][key]), (target, r, key)
