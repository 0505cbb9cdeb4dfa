"""Parallelisms on 2 GPUs (NCCL): fp32 parity with one GPU, bf16 meshes (compile, AC, CPU offload) train.

Run on the GPU machine: `pytest tests/gpu/test_parallel_gpu.py` (needs 2 GPUs). Each test drives the real
trainer under torchrun on the debug model with synthetic data and compares the per-step loss and
gradient norm from metrics.jsonl with a one-GPU run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpu_launch import launch, torchrun
from gpu_launch import max_dev as dev

pytestmark = pytest.mark.multigpu
HERE = Path(__file__).parent

STEPS = 8
# fp32 on GPU (TF32 off): only the order of the sums differs, as on CPU, but cuBLAS picks its kernels by
# shape, so a sharded matmul may accumulate in another order than the whole one.
FP32_RTOL = 1e-4
# bf16: one GPU autocasts, FSDP casts the gathered parameters; TP splits the bf16 matmuls differently.
BF16_RTOL = 2e-2


def train(tmp: Path, name: str, ngpu: int, dp: int, *overrides: str) -> list[dict]:
    args = [
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        str(8 // dp),
        "--training.global_batch_size",
        "8",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--no-metrics.tensorboard",
        "--data.dataset",
        "synthetic",
        *overrides,
    ]
    rows, _ = launch(tmp, name, ngpu, args, timeout=900)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return {
        "fp32": train(tmp, "fp32", 1, 1, "--training.deterministic"),
        "bf16": train(tmp, "bf16", 1, 1, "--training.precision", "bf16"),
    }


FP32 = {
    "fsdp2": (2, []),
    "ddp2": (2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]),
    "tp2": (1, ["--parallelism.tp", "2"]),
}


@pytest.mark.parametrize("name", list(FP32))
def test_fp32_matches_one_gpu(name, tmp_path, refs):
    dp, over = FP32[name]
    rows = train(tmp_path, name, 2, dp, "--training.deterministic", *over)
    for key in ("loss", "grad_norm"):
        assert dev(rows, refs["fp32"], key) <= FP32_RTOL, (key, [r[key] for r in rows])
    ref = refs["fp32"]
    print(f"{name}: loss {dev(rows, ref, 'loss'):.2e} grad_norm {dev(rows, ref, 'grad_norm'):.2e}")


BF16 = {
    "fsdp2": (2, []),
    "fsdp2_compile_ac_op": (2, ["--compile.enable", "--activation_checkpoint.mode", "selective"]),
    "fsdp2_cpu_offload": (2, ["--parallelism.fsdp_cpu_offload"]),
}


@pytest.mark.parametrize("name", list(BF16))
def test_bf16_meshes_train_like_one_gpu(name, tmp_path, refs):
    dp, over = BF16[name]
    rows = train(tmp_path, name, 2, dp, "--training.precision", "bf16", *over)
    assert dev(rows, refs["bf16"], "loss") <= BF16_RTOL, [r["loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]
    print(f"{name}: loss {dev(rows, refs['bf16'], 'loss'):.2e}")


def _tp_probe(tmp: Path, name: str, *overrides: str) -> dict:
    """Rank 0's report of `async_tp_probe.py` for a compiled bf16 TP 2 run of STEPS steps."""
    args = [
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "8",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--no-metrics.tensorboard",
        "--data.dataset",
        "synthetic",
        "--training.precision",
        "bf16",
        "--parallelism.tp",
        "2",
        "--compile.enable",
        "--job.dump_folder",
        str(tmp),
        "--job.name",
        name,
        *overrides,
    ]
    torchrun(2, [str(HERE / "async_tp_probe.py"), str(tmp / name / "probe"), *args], timeout=900)
    return json.loads((tmp / name / "probe" / "rank0.json").read_text())


def test_async_tp_fuses_the_collectives_and_trains_alike(tmp_path, refs):
    """experimental.async_tp: the compiled blocks call the fused symmetric-memory kernels in place of the
    sequence-parallel collectives, and the losses follow the one-GPU run as plain TP's do."""
    plain = _tp_probe(tmp_path, "tp2", "--no-compile.overlap_collectives")
    fused = _tp_probe(tmp_path, "tp2_async", "--experimental.async_tp")
    assert plain["fused_all_gather_matmul"] == plain["fused_matmul_reduce_scatter"] == 0, plain
    assert plain["all_gather_into_tensor"] > 0 and plain["reduce_scatter"] > 0, plain
    assert fused["fused_all_gather_matmul"] > 0 and fused["fused_matmul_reduce_scatter"] > 0, fused
    ref = [r["loss"] for r in refs["bf16"]]
    for run in (plain, fused):
        assert len(run["losses"]) == STEPS
        assert max(abs(a - b) / b for a, b in zip(run["losses"], ref)) <= BF16_RTOL, (run["losses"], ref)
    print(f"async TP: {fused}")


def test_overlapped_collectives_train_like_one_gpu(tmp_path, refs):
    """compile.overlap_collectives (the default) only reorders: compiled TP 2's losses follow the one-GPU
    run's (`test_async_tp_fuses_the_collectives_and_trains_alike` runs TP 2 with the overlap off)."""
    rows = train(
        tmp_path,
        "tp2_overlap",
        2,
        1,
        "--training.precision",
        "bf16",
        "--parallelism.tp",
        "2",
        "--compile.enable",
        "--compile.overlap_collectives",
    )
    assert dev(rows, refs["bf16"], "loss") <= BF16_RTOL, [r["loss"] for r in rows]
