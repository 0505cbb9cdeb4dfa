"""Parallelisms on 2 GPUs (NCCL): fp32 parity with one GPU, bf16 meshes (compile, async TP, AC) train.

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

STEPS = 8
# fp32 on GPU (TF32 off): only the order of the sums differs, as on CPU, but cuBLAS picks its kernels by
# shape, so a sharded matmul may accumulate in another order than the whole one.
FP32_RTOL = 1e-4
# bf16: one GPU autocasts, FSDP casts the gathered parameters; TP splits the bf16 matmuls differently.
BF16_RTOL = 2e-2


def train(tmp: Path, name: str, ngpu: int, dp: int, *overrides: str) -> list[dict]:
    args = [
        "--training.steps", str(STEPS), "--training.seq_len", "256", "--training.local_batch_size",
        str(8 // dp), "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--no-metrics.tensorboard", "--data.dataset", "synthetic", *overrides,
    ]  # fmt: skip
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
    "tp2_compile_async": (1, ["--parallelism.tp", "2", "--compile.enable", "--parallelism.async_tp"]),
    "fsdp2_cpu_offload": (2, ["--parallelism.fsdp_cpu_offload"]),
}


@pytest.mark.parametrize("name", list(BF16))
def test_bf16_meshes_train_like_one_gpu(name, tmp_path, refs):
    dp, over = BF16[name]
    rows = train(tmp_path, name, 2, dp, "--training.precision", "bf16", *over)
    assert dev(rows, refs["bf16"], "loss") <= BF16_RTOL, [r["loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]
    print(f"{name}: loss {dev(rows, refs['bf16'], 'loss'):.2e}")


def _fsdp_probe(tmp_path: Path, free: bool, pool: bool) -> dict:
    path = tmp_path / f"free{free}_pool{pool}.json"
    probe = str(Path(__file__).with_name("fsdp_memory_probe.py"))
    torchrun(2, [probe, str(path), str(free).lower(), str(pool).lower()], timeout=300)
    return json.loads(path.read_text())


def test_early_release_of_reduce_scatter_inputs(tmp_path):
    """On NCCL, as the last block's backward starts, the output layer's fp32 reduce-scatter input is gone
    with the early release and still held without it; the gradients are the same either way."""
    early, late = _fsdp_probe(tmp_path, True, False), _fsdp_probe(tmp_path, False, False)
    head_input = 4 * 131072 * 256  # bytes: the output layer's unsharded fp32 gradient
    drop = late["allocated_at_last_block_backward"] - early["allocated_at_last_block_backward"]
    print(f"torch {early['torch']}: released {early['released']}, {drop / 2**20:.0f} MiB less at the moment")
    assert early["released"] == 3 * 4, early  # 3 steps x (the head's, blocks 3, 2, 1's at blocks 3-0)
    assert late["released"] is None, late
    assert drop >= 0.9 * head_input, (early, late)
    # (separate runs: attention's backward is not bitwise deterministic)
    assert early["losses"] == pytest.approx(late["losses"], rel=1e-4)
    assert early["grad_norm"] == pytest.approx(late["grad_norm"], rel=1e-3)


def test_gradients_in_the_compute_pool(tmp_path):
    """The sharded gradients come from the compute stream's pool, no longer from the reduce-scatter
    stream's, which then reserves that much less (the next forward reuses the memory; on the 8B FSDP4 rows
    the side by side measures what that buys); the same training otherwise."""
    pool, own = _fsdp_probe(tmp_path, True, True), _fsdp_probe(tmp_path, True, False)
    grads = sum(own["grad_bytes"].values())
    freed = own["reserved"]["other"] - pool["reserved"]["other"]
    print(
        f"torch {pool['torch']}: {pool['rs_calls']} reduce-scatters; gradients by pool {pool['grad_bytes']}"
        f" against FSDP's {own['grad_bytes']}; the other streams reserve {freed / 2**20:.0f} MiB less, "
        f"peak reserved {(own['max_reserved'] - pool['max_reserved']) / 2**20:.0f} MiB less"
    )
    assert pool["rs_calls"] == 3 * 6, pool  # 3 steps x (embedding, 4 blocks, [norm, output])
    assert grads >= 4 * 131072 * 256, own  # (fp32, the two 131072 x 256 tables sharded over 2, and more)
    assert pool["grad_bytes"] == {"compute": grads, "other": 0}, pool
    assert own["grad_bytes"] == {"compute": 0, "other": grads}, own
    assert freed >= grads, (pool["reserved"], own["reserved"])
    assert pool["losses"] == pytest.approx(own["losses"], rel=1e-4)
    assert pool["grad_norm"] == pytest.approx(own["grad_norm"], rel=1e-3)


def test_optimizer_step_beside_the_forward_trains_like_the_plain_step(tmp_path):
    """optimizer.overlap_step on NCCL: each FSDP unit's update runs on a side stream, and the compute
    stream waits for it only before that unit's all-gather (and its float8 scales). Ordered right, the run
    is the plain step's, within the run-to-run noise; an all-gather that read weights before or during
    their update would be off by far more (the learning rate moves them by ~1e-3 a step)."""
    cases = {  # (both measured bitwise equal on torch 2.11, call AR)
        "fp32": (0.0, ["--training.deterministic"]),
        "float8": (1e-5, ["--training.precision", "bf16", "--float8.enable", "--float8.min_size", "16"]),
    }
    for name, (rtol, extra) in cases.items():
        plain = train(tmp_path, f"{name}_plain", 2, 2, *extra)
        overlap = train(tmp_path, f"{name}_overlap", 2, 2, *extra, "--optimizer.overlap_step")
        loss, norm = dev(overlap, plain, "loss"), dev(overlap, plain, "grad_norm")
        print(f"{name}: loss {loss:.2e} grad_norm {norm:.2e}")
        assert loss <= rtol, ([r["loss"] for r in overlap], [r["loss"] for r in plain])
        assert norm <= max(10 * rtol, 0.0)
