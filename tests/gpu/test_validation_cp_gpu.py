"""Validation under context parallel, via the real trainer on GPUs: the loss of CP2 equals that of CP1 on
one GPU (plain and chunked loss), and each CP rank computes only its half of the sequence's logits.

Validation used to run the model on the whole sequence on every CP rank, outside the context-parallel
context, with the full-sequence logits (about 12 GiB at 8B and seq 8192) on each. It now takes the
training's loss path: the sequence sharded over the cp ranks and the configured loss (chunked: no
logits of the whole batch at all). Its peak memory is its own metric (`val_mem_active_gib`).
"""

from __future__ import annotations

import pytest
from gpu_launch import launch

# fp32 on GPU: SDPA's flash/efficient kernels and the ring's online softmax reassociate sums.
LOSS_RTOL = 2e-3


def val_rows(tmp, name: str, nproc: int, *extra: str) -> list[dict]:
    """Two steps of the debug model, seq 1024, 8 sequences per step, validation (1 batch: the embedded
    corpus's validation split holds 14 windows of 1024 tokens) at step 2."""
    args = [
        "--training.steps",
        "2",
        "--training.seq_len",
        "1024",
        "--training.local_batch_size",
        "8",
        "--training.precision",
        "fp32",
        "--metrics.log_freq",
        "1",
        "--model.attn_backend",
        "sdpa",
        "--validation.freq",
        "2",
        "--validation.steps",
        "1",
        *extra,
    ]
    rows = [r for r in launch(tmp, name, nproc, args)[0] if "val_loss" in r]
    assert [r["step"] for r in rows] == [2], rows
    return rows


@pytest.mark.multigpu
@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_validation_under_cp_matches_cp1(tmp_path, loss):
    over = ["--training.loss", loss, "--training.loss_chunk_size", "1024"]
    (one,) = val_rows(tmp_path, f"cp1_{loss}", 1, *over)
    (two,) = val_rows(tmp_path, f"cp2_{loss}", 2, *over, "--parallelism.cp", "2")
    assert abs(two["val_loss"] - one["val_loss"]) / one["val_loss"] < LOSS_RTOL, (two, one)
    if loss == "plain":
        # The validation's peak is dominated by its logits (8 x 1024 x 8192 fp32 = 256 MiB, and as much
        # again for the log-softmax): sharded over 2 cp ranks, each rank's peak is about half of one GPU's.
        assert two["val_mem_active_gib"] < 0.7 * one["val_mem_active_gib"], (two, one)
