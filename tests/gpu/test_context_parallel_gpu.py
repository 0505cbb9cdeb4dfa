"""Context parallel on GPUs, via the real trainer: CP2 (both rotate methods), CP2 x TP2 and CP2 x FSDP2
train like CP1 on one GPU (the same global batch of 4 sequences of 512 tokens, 6 steps, fp32, SDPA).

With cp > 1 FSDP shards the weights over dp_shard x cp, so CP2 on 2 GPUs is FSDP over the two cp ranks;
CP2 x TP2 (4 GPUs) is that FSDP x TP mesh with each sequence split over cp and, under sequence parallel,
again over tp (seq_len divisible by 2 x cp x tp = 8); CP2 x FSDP2 (4 GPUs) adds a data-parallel dimension:
each rank holds 2 of the 4 sequences and half of each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_launch import launch

# fp32 on GPU: SDPA's flash/efficient kernels and the ring's online softmax reassociate sums.
LOSS_RTOL = 2e-3
GRAD_NORM_RTOL = 2e-2


def run(tmp: Path, name: str, nproc: int, *extra: str) -> list[dict]:
    args = ["--training.steps", "6", "--training.seq_len", "512", "--training.global_batch_size", "4",
            "--training.precision", "fp32", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
            "--model.attn_backend", "sdpa", *extra]  # fmt: skip
    return launch(tmp, name, nproc, args)[0]


@pytest.fixture(scope="module")
def cp1(tmp_path_factory) -> list[dict]:
    """The reference: one GPU, the whole batch and the whole sequence."""
    rows = run(tmp_path_factory.mktemp("cp1"), "cp1", 1, "--training.local_batch_size", "4")
    assert rows[-1]["loss"] < rows[0]["loss"]
    return rows


def assert_matches(rows: list[dict], ref: list[dict]) -> None:
    assert len(rows) == len(ref) == 6
    for a, b in zip(rows, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < LOSS_RTOL, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] < GRAD_NORM_RTOL


@pytest.mark.multigpu
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_cp2_matches_cp1(tmp_path, rotate, cp1):
    cp2 = run(tmp_path, f"cp2_{rotate}", 2, "--parallelism.cp", "2", "--parallelism.cp_rotate_method", rotate,
              "--training.local_batch_size", "4")  # fmt: skip
    assert_matches(cp2, cp1)


@pytest.mark.multigpu(4)
def test_cp2_tp2_4gpu_matches_cp1(tmp_path, cp1):
    """CP x TP: ring attention over the cp ranks on the heads this tp rank holds."""
    rows = run(tmp_path, "cp2_tp2", 4, "--parallelism.cp", "2", "--parallelism.tp", "2",
               "--parallelism.dp_shard", "1", "--training.local_batch_size", "4")  # fmt: skip
    assert_matches(rows, cp1)


@pytest.mark.multigpu(4)
def test_cp2_fsdp2_4gpu_matches_cp1(tmp_path, cp1):
    """CP x FSDP with a data-parallel dimension: 2 sequences per rank, FSDP over dp_shard x cp = 4."""
    rows = run(tmp_path, "cp2_fsdp2", 4, "--parallelism.cp", "2", "--parallelism.dp_shard", "2",
               "--training.local_batch_size", "2")  # fmt: skip
    assert_matches(rows, cp1)
