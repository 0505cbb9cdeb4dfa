"""A run cut off after a checkpoint and resumed repeats the uninterrupted run's losses, on GPUs.

The CPU suite checks this bitwise in fp32 with deterministic settings (tests/unit/test_checkpoint.py);
here the same on 2 GPUs under FSDP2 (NCCL), in fp32 (TF32 off, SDPA): cuBLAS and SDPA kernels may
reassociate sums between runs, so the bound is the GPU parity suite's fp32 tolerance, 1e-4 relative.
Each async mode is run: the save path differs (pinned staging for async_pinned), the state must not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gpu_launch import launch, max_dev

pytestmark = pytest.mark.multigpu

STEPS = 6
FP32_RTOL = 1e-4
ARGS = [
    "--training.steps", str(STEPS), "--training.seq_len", "256", "--training.local_batch_size", "4",
    "--training.precision", "fp32", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
    "--no-metrics.tensorboard", "--model.attn_backend", "sdpa",
]  # fmt: skip
STOP_AT = str(Path(__file__).with_name("stop_at.py"))


def steps(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict[int, dict]:
    rows, _ = launch(tmp_path_factory.mktemp("full"), "full", 2, ARGS)
    return steps(rows)


@pytest.mark.parametrize("mode", ["disabled", "async", "async_pinned"])
def test_resume_repeats_the_uninterrupted_losses(tmp_path, full, mode):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.async_mode", mode]
    launch(tmp_path, "split", 2, [*ARGS, *ckpt], entry=(STOP_AT, "3"))  # cut off after step 3
    rows, log = launch(tmp_path, "split", 2, [*ARGS, *ckpt])  # resumes from step-3
    resumed = steps(rows)
    assert "resumed from" in log.lower() or any("ckpt_load_s" in r for r in rows), log[-2000:]
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoint").iterdir()) == ["step-3", "step-6"]
    later = range(4, STEPS + 1)
    got, want = [resumed[s] for s in later], [full[s] for s in later]
    assert max_dev(got, want, "loss") < FP32_RTOL
    assert max_dev(got, want, "grad_norm") < FP32_RTOL


def test_several_async_pinned_saves_in_one_run_then_resume(tmp_path, full):
    """torch 2.11's DCP stager cannot serve a second save (pytorch#183413): every save of one run must
    still land, and a run resumed from a middle one must repeat the uninterrupted losses."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async_pinned"]
    launch(tmp_path, "many", 2, [*ARGS, *ckpt])  # three saves in one process: steps 2, 4, 6
    folder = tmp_path / "many" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]
    shutil.rmtree(folder / "step-6")  # resume from step 4 and train steps 5-6 again
    rows, _ = launch(tmp_path, "many", 2, [*ARGS, *ckpt])
    resumed = steps(rows)
    assert max_dev([resumed[s] for s in (5, 6)], [full[s] for s in (5, 6)], "loss") < FP32_RTOL
