"""Llama 4's mixture of experts on CUDA: the grouped GEMM against the per-expert loop, and expert parallel
over NCCL against one GPU.

Run on the GPU machine: `pytest tests/gpu/test_moe_gpu.py` (EP2, FSDP2 and TP2 need 2 GPUs; EP2 x FSDP2,
EP2 x CP2 and EP2 x TP2 need 4; float8 experts need torchao and compute capability >= 9.0). The trainer
runs llama4_debug (every layer MoE, 8 experts, top-1) on synthetic data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_launch import launch
from gpu_launch import max_dev as dev

from titanrush.models.llama4.grouped_gemm import (
    KERNEL,
    float8_grouped_mm,
    grouped_mm,
    grouped_mm_supported,
    loop_mm,
)

STEPS = 8
# fp32 on CUDA (the per-expert loop: the grouped kernel takes bf16): only the order of sums differs, but
# cuBLAS's reassociation (~1e-6) can flip a near-tied top-1 choice (the CPU suite, at ~1e-7, sees none),
# and a flip can move an expert's count across the mean and so its bias: 10x the dense suite's 1e-4.
FP32_RTOL = 1e-3
# bf16: one GPU autocasts, FSDP casts the gathered parameters; a bf16 rounding can flip a near-tied
# top-1 choice now and then, which moves the loss by about its own rounding.
BF16_RTOL = 2e-2


@pytest.mark.parametrize("counts", [[37, 0, 101, 6, 256, 1, 0, 111], [64] * 8])
def test_grouped_gemm_matches_the_loop_in_bf16(counts):
    """bf16 on CUDA: both against an fp32 reference; the grouped kernel within the loop's own error."""
    assert KERNEL is not None, f"torch {torch.__version__} has no grouped GEMM"
    gen = torch.Generator(device="cuda").manual_seed(0)
    c = torch.tensor(counts, device="cuda")
    x = torch.randn(int(c.sum()), 512, device="cuda", generator=gen)
    w = torch.randn(8, 512, 768, device="cuda", generator=gen) / 512**0.5
    g = torch.randn(int(c.sum()), 768, device="cuda", generator=gen)
    assert grouped_mm_supported(x.bfloat16(), w.bfloat16())
    results = {}
    for name, grouped, dtype in (
        ("grouped", True, torch.bfloat16),
        ("loop", False, torch.bfloat16),
        ("fp32", False, torch.float32),
    ):
        xi = x.to(dtype).requires_grad_()
        wi = w.to(dtype).requires_grad_()
        out = grouped_mm(xi, wi, c, grouped=grouped) if grouped else loop_mm(xi, wi, c)
        out.backward(g.to(dtype))
        results[name] = [t.float() for t in (out, xi.grad, wi.grad)]
    for i, what in enumerate(("out", "x.grad", "w.grad")):
        ref = results["fp32"][i]
        err = {k: ((results[k][i] - ref).abs().max() / ref.abs().max()).item() for k in ("grouped", "loop")}
        assert err["grouped"] <= max(2 * err["loop"], 1e-2), (what, err)


def _float8_ready() -> str | None:
    """Why float8 experts cannot run here, or None."""
    if torch.cuda.get_device_capability() < (9, 0):
        return f"float8 grouped GEMMs need compute capability >= 9.0, not {torch.cuda.get_device_name()}"
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError:
        return "torchao with its MoE training prototype is not installed"
    return None


@pytest.mark.parametrize("counts", [[37, 0, 101, 6, 256, 1, 0, 111], [64] * 8])
def test_float8_grouped_gemm_is_float8_and_close(counts):
    """float8 (rowwise) against fp32: within float8's own rounding (e4m3: 3 mantissa bits), and further
    off than bf16 is (so the float8 kernel, not the bf16 one, ran), for the output and both gradients;
    groups of any size, empty ones included (padded to 16 rows inside)."""
    if (why := _float8_ready()) is not None:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(0)
    c = torch.tensor(counts, device="cuda")
    x = torch.randn(int(c.sum()), 512, device="cuda", generator=gen)
    w = torch.randn(8, 512, 768, device="cuda", generator=gen) / 512**0.5
    g = torch.randn(int(c.sum()), 768, device="cuda", generator=gen)
    results = {}
    for name in ("float8", "bf16", "fp32"):
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        xi, wi = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        out = float8_grouped_mm(xi, wi, c) if name == "float8" else loop_mm(xi, wi, c)
        out.backward(g.to(out.dtype))
        results[name] = [t.float() for t in (out, xi.grad, wi.grad)]
    for i, what in enumerate(("out", "x.grad", "w.grad")):
        ref = results["fp32"][i]
        err = {k: ((results[k][i] - ref).abs().max() / ref.abs().max()).item() for k in ("float8", "bf16")}
        assert 2 * err["bf16"] < err["float8"] <= 0.1, (what, err)


def train(tmp: Path, name: str, ngpu: int, dp: int, *overrides: str) -> list[dict]:
    args = [
        "--model.flavor",
        "llama4_debug",
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
    tmp = tmp_path_factory.mktemp("moe_ref")
    return {
        "fp32": train(tmp, "fp32", 1, 1, "--training.deterministic"),
        "bf16": train(tmp, "bf16", 1, 1, "--training.precision", "bf16"),
    }


@pytest.mark.multigpu
@pytest.mark.parametrize("name", ["ep2", "fsdp2", "tp2"])
def test_fp32_ep2_matches_one_gpu(name, tmp_path, refs):
    """EP2; FSDP2; TP2 (the MoE layers' own FSDP units over the tp ranks, each routing its sequence
    shard)."""
    over = {"ep2": ["--parallelism.ep", "2"], "fsdp2": [], "tp2": ["--parallelism.tp", "2"]}[name]
    rows = train(tmp_path, name, 2, 1 if name == "tp2" else 2, "--training.deterministic", *over)
    for key in ("loss", "grad_norm"):
        assert dev(rows, refs["fp32"], key) <= FP32_RTOL, (key, [r[key] for r in rows])
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.multigpu
@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_ep2_trains_like_one_gpu(compiled, tmp_path, refs):
    """bf16 (the grouped kernel), eager and compiled (graph breaks at the all-to-alls)."""
    extra = ["--compile.enable"] if compiled else []
    rows = train(tmp_path, "ep2_bf16", 2, 2, "--training.precision", "bf16", "--parallelism.ep", "2", *extra)
    assert dev(rows, refs["bf16"], "loss") <= BF16_RTOL, [r["loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.multigpu(4)
@pytest.mark.parametrize("name", ["ep2_fsdp2", "ep2_cp2", "ep2_tp2"])
def test_four_gpu_meshes_match_one_gpu(name, tmp_path, refs):
    """EP2 x FSDP2: experts sharded by FSDP over the pairs that are not EP peers. EP2 x CP2: each rank
    routes its share of the sequence; the experts are FSDP-sharded over cp. EP2 x TP2: each tp rank
    routes its sequence shard through its EP group."""
    cp = name == "ep2_cp2"
    over = ["--parallelism.ep", "2"] + (["--parallelism.cp", "2"] if cp else [])
    over += ["--parallelism.tp", "2"] if name == "ep2_tp2" else []
    rows = train(tmp_path, name, 4, 4 if name == "ep2_fsdp2" else 2, "--training.deterministic", *over)
    # Under CP the ring's online softmax reassociates attention's sums too: the CP suite's tolerances.
    tolerance = {"loss": 2e-3, "grad_norm": 2e-2} if cp else {"loss": FP32_RTOL, "grad_norm": FP32_RTOL}
    for key, rtol in tolerance.items():
        assert dev(rows, refs["fp32"], key) <= rtol, (key, [r[key] for r in rows])


# float8 experts change the experts' GEMMs by float8's rounding (a few percent per product), which a
# short run's loss feels at the percent level.
FLOAT8_RTOL = 5e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_float8_experts_train_like_bf16(compiled, tmp_path, refs):
    """One GPU, eager and compiled: the run says it converted every MoE layer and tracks bf16's losses."""
    if (why := _float8_ready()) is not None:
        pytest.skip(why)
    extra = ["--compile.enable"] if compiled else []
    args = [
        "--model.flavor",
        "llama4_debug",
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
        "--float8.experts",
        *extra,
    ]
    rows, log = launch(tmp_path, "float8_experts", 1, args, timeout=900)
    assert "float8 experts: the routed experts of 4 MoE layers" in log, log[-3000:]
    assert dev(rows, refs["bf16"], "loss") <= FLOAT8_RTOL, [r["loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.multigpu
def test_float8_experts_ep2_matches_one_gpu_float8(tmp_path, refs):
    """EP2 compiled with float8 experts (each rank quantizes the rows it received): bf16's EP tolerance
    against bf16's one-GPU run plus float8's."""
    if (why := _float8_ready()) is not None:
        pytest.skip(why)
    rows = train(
        tmp_path,
        "ep2_float8",
        2,
        2,
        "--training.precision",
        "bf16",
        "--parallelism.ep",
        "2",
        "--compile.enable",
        "--float8.experts",
    )
    assert dev(rows, refs["bf16"], "loss") <= FLOAT8_RTOL + BF16_RTOL, [r["loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "name", ["tp2_float8", "tp2_float8_experts", "pp2_float8_experts", "cp2_float8_experts"]
)
def test_float8_under_tp_pp_cp_trains_like_bf16(name, tmp_path, refs):
    """A Llama 4's float8 linears under TP2 (the float8 TP styles on attention; `llama4_debug` has no
    dense FFN; the MoE layers' own linears data-parallel over tp), and float8 experts under TP2, PP2 and
    CP2: each against bf16 on one GPU within float8's tolerance plus bf16's mesh tolerance, with its
    conversion logged."""
    if (why := _float8_ready()) is not None:
        pytest.skip(why)
    mesh = ["--parallelism." + name[:2], "2"]
    f8 = ["--float8.enable", "--float8.min_size", "0"] if name == "tp2_float8" else ["--float8.experts"]
    rows = train(tmp_path, name, 2, 1, "--training.precision", "bf16", *mesh, *f8)
    log = (tmp_path / name / "console.log").read_text()
    said = "linear layers converted" if name == "tp2_float8" else "float8 experts: the routed experts of"
    assert said in log, log[-3000:]
    assert dev(rows, refs["bf16"], "loss") <= FLOAT8_RTOL + BF16_RTOL, [r["loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]
