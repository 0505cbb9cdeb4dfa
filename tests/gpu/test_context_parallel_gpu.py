"""Context parallel on GPUs, via the real trainer: CP2 (both rotate methods), CP2 x TP2, CP2 x FSDP2 and
CP2 x PP2 (with and without TP and FSDP) train like CP1 on one GPU (the same global batch of 4 sequences
of 512 tokens, 6 steps, fp32 with TF32 off, SDPA).

With cp > 1 FSDP shards the weights over dp_shard x cp, so CP2 on 2 GPUs is FSDP over the two cp ranks;
CP2 x TP2 (4 GPUs) is that FSDP x TP mesh with each sequence split over cp and, under sequence parallel,
again over tp (seq_len divisible by 2 x cp x tp = 8); CP2 x FSDP2 (4 GPUs) adds a data-parallel dimension:
each rank holds 2 of the 4 sequences and half of each.

CP x PP: the pipeline's step runs inside context parallel, the batch and every stage's RoPE table
sharded once for all micro-batches. It needs pp x cp >= 4 GPUs: on 2 GPUs cp > 1 and pp > 1 cannot both
hold, and the pipeline path needs pp > 1 (titanrush has no single-rank pipeline). What 2 GPUs do exercise
is the sharding both paths share (`context_parallel_step` with the model's RoPE table, the same function
for one stage or several): CP2 here, and its bf16 compiled run, whose blocks must compile without a
complex tensor (inductor's "complex operators" warning, printed by every rank before the real-valued
RoPE). On 4 GPUs CP2 x PP2 with a one-stage (1F1B) and a two-stage-per-rank, split-backward schedule
(ZBVZeroBubble), a bf16 compiled CP2 x PP2 run and CP2 x PP2's validation loss; on 8, CP2 x PP2 x
TP2 and CP2 x PP2 x FSDP2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_launch import launch

# fp32 on GPU: SDPA's flash/efficient kernels and the ring's online softmax reassociate sums.
LOSS_RTOL = 2e-3
GRAD_NORM_RTOL = 2e-2


def run(tmp: Path, name: str, nproc: int, *extra: str) -> list[dict]:
    args = [
        "--training.steps",
        "6",
        "--training.seq_len",
        "512",
        "--training.global_batch_size",
        "4",
        "--training.precision",
        "fp32",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--model.attn_backend",
        "sdpa",
        *extra,
    ]
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
    cp2 = run(
        tmp_path,
        f"cp2_{rotate}",
        2,
        "--parallelism.cp",
        "2",
        "--parallelism.cp_rotate_method",
        rotate,
        "--training.local_batch_size",
        "4",
    )
    assert_matches(cp2, cp1)


@pytest.mark.multigpu(4)
def test_cp2_tp2_4gpu_matches_cp1(tmp_path, cp1):
    """CP x TP: ring attention over the cp ranks on the heads this tp rank holds."""
    rows = run(
        tmp_path,
        "cp2_tp2",
        4,
        "--parallelism.cp",
        "2",
        "--parallelism.tp",
        "2",
        "--parallelism.dp_shard",
        "1",
        "--training.local_batch_size",
        "4",
    )
    assert_matches(rows, cp1)


@pytest.mark.multigpu(4)
def test_cp2_fsdp2_4gpu_matches_cp1(tmp_path, cp1):
    """CP x FSDP with a data-parallel dimension: 2 sequences per rank, FSDP over dp_shard x cp = 4."""
    rows = run(
        tmp_path,
        "cp2_fsdp2",
        4,
        "--parallelism.cp",
        "2",
        "--parallelism.dp_shard",
        "2",
        "--training.local_batch_size",
        "2",
    )
    assert_matches(rows, cp1)


@pytest.mark.multigpu(4)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_cp2_pp2_4gpu_matches_cp1(tmp_path, schedule, cp1):
    """CP x PP: each pipeline rank's stages attend over the cp group, micro-batch by micro-batch."""
    rows = run(
        tmp_path,
        f"cp2_pp2_{schedule}",
        4,
        "--parallelism.cp",
        "2",
        "--parallelism.pp",
        "2",
        "--parallelism.pp_schedule",
        schedule,
        "--parallelism.dp_shard",
        "1",
        "--training.local_batch_size",
        "4",
    )
    assert_matches(rows, cp1)


@pytest.mark.multigpu(8)
def test_cp2_pp2_tp2_8gpu_matches_cp1(tmp_path, cp1):
    """The 4-D mesh without data parallel: pp x cp x tp, sequence parallel inside each cp shard."""
    rows = run(
        tmp_path,
        "cp2_pp2_tp2",
        8,
        "--parallelism.cp",
        "2",
        "--parallelism.pp",
        "2",
        "--parallelism.tp",
        "2",
        "--parallelism.dp_shard",
        "1",
        "--training.local_batch_size",
        "4",
    )
    assert_matches(rows, cp1)


@pytest.mark.multigpu(8)
def test_cp2_pp2_fsdp2_8gpu_matches_cp1(tmp_path, cp1):
    """CP x PP with a data-parallel dimension: 2 sequences per rank, FSDP over dp_shard x cp = 4."""
    rows = run(
        tmp_path,
        "cp2_pp2_fsdp2",
        8,
        "--parallelism.cp",
        "2",
        "--parallelism.pp",
        "2",
        "--parallelism.dp_shard",
        "2",
        "--training.local_batch_size",
        "2",
    )
    assert_matches(rows, cp1)


COMPLEX_WARNING = "does not support code generation for complex operators"
BF16_RTOL = 2e-2  # bf16 under FSDP's parameter cast against bf16 autocast on one GPU
BF16_COMPILED = [
    "--training.steps",
    "6",
    "--training.seq_len",
    "512",
    "--training.global_batch_size",
    "4",
    "--training.precision",
    "bf16",
    "--compile.enable",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--model.attn_backend",
    "sdpa",
]


@pytest.fixture(scope="module")
def bf16_compiled_1gpu(tmp_path_factory) -> list[dict]:
    """The bf16 reference: one GPU, compiled blocks (autocast, no FSDP)."""
    rows, log = launch(
        tmp_path_factory.mktemp("bf16"), "bf16_1gpu", 1, [*BF16_COMPILED, "--training.local_batch_size", "4"]
    )
    assert COMPLEX_WARNING not in log
    return rows


def assert_bf16_matches(rows: list[dict], ref: list[dict]) -> None:
    assert len(rows) == len(ref) == 6
    assert rows[-1]["loss"] < rows[0]["loss"]
    for a, b in zip(rows, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < BF16_RTOL, (a["loss"], b["loss"])


@pytest.mark.multigpu
def test_cp2_bf16_compiled_rope_has_no_complex_operators(tmp_path, bf16_compiled_1gpu):
    """Compiled blocks under FSDP's bf16 policy and ring attention: the fp32 RoPE table reaches every block
    uncast, inductor compiles the rotation (no complex-operator warning on any rank), and the run trains
    like one GPU."""
    rows, log = launch(
        tmp_path,
        "cp2_bf16_compiled",
        2,
        [*BF16_COMPILED, "--parallelism.cp", "2", "--training.local_batch_size", "4"],
    )
    assert COMPLEX_WARNING not in log
    assert_bf16_matches(rows, bf16_compiled_1gpu)


@pytest.mark.multigpu(4)
def test_cp2_pp2_bf16_compiled_4gpu(tmp_path, bf16_compiled_1gpu):
    """CP x PP, compiled, bf16 (each stage's root casts what it receives; the blocks cast nothing)."""
    rows, log = launch(
        tmp_path,
        "cp2_pp2_bf16_compiled",
        4,
        [
            *BF16_COMPILED,
            "--parallelism.cp",
            "2",
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--training.local_batch_size",
            "4",
        ],
    )
    assert COMPLEX_WARNING not in log
    assert_bf16_matches(rows, bf16_compiled_1gpu)


@pytest.mark.multigpu(4)
def test_cp2_pp2_4gpu_validation_matches_cp1(tmp_path):
    """The pipeline's forward-only validation pass runs sharded over cp like its training steps (the
    stages' buffers have the sharded shapes) and logs one GPU's validation loss."""
    val = ("--validation.freq", "3", "--validation.steps", "2", "--training.local_batch_size", "4")
    one = [r for r in run(tmp_path, "val_cp1", 1, *val) if "val_loss" in r]
    cp_pp = run(
        tmp_path,
        "val_cp2_pp2",
        4,
        "--parallelism.cp",
        "2",
        "--parallelism.pp",
        "2",
        "--parallelism.dp_shard",
        "1",
        *val,
    )
    cp_pp = [r for r in cp_pp if "val_loss" in r]
    assert [r["step"] for r in cp_pp] == [r["step"] for r in one] == [3, 6]
    for a, b in zip(cp_pp, one, strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) / b["val_loss"] < LOSS_RTOL, (a["val_loss"], b["val_loss"])
