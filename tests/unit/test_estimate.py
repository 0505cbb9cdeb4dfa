"""The memory estimator: analytic states against hand arithmetic, the fake-tensor trace against a real CPU
step, the two methods against each other, fits / max batch, and the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from titanrush import config
from titanrush.models.llama import model_args
from titanrush.tools import estimate as est_mod
from titanrush.tools.memory_model import GIB, Setup, analyze, rank_plans, states
from titanrush.tools.memory_trace import trace, trace_rank

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug.toml")
LLAMA8B = str(ROOT / "train_configs" / "llama8b_fsdp.toml")
P8B = 8_030_261_248  # Llama 3.1 8B: 32 x 218,112,000 + 2 x 128256 x 4096 + 4096


def first_rank_states(**kw: object) -> dict[str, int]:
    flavor = kw.pop("flavor", "8B")
    s = Setup(args=model_args(flavor), local_batch=1, seq_len=2048, **kw)
    return states(s, rank_plans(s)[0])


def test_states_8b_match_hand_arithmetic():
    # fp32 AdamW on 4-way FSDP: 4 bytes/param of weights and of gradients, 8 of Adam states, each / 4.
    st = first_rank_states(fsdp_shard=4)
    assert st["params"] == P8B * 4 // 4 and st["grads"] == P8B * 4 // 4 and st["master_weights"] == 0
    assert abs(st["optimizer"] - 2 * P8B * 4 // 4) < 1e4  # + one 4-byte step counter per tensor
    # bf16 under FSDP: the fp32 shards are the master weights; the bf16 copies live in FSDP's buffers.
    st = first_rank_states(fsdp_shard=4, precision="bf16")
    assert st["master_weights"] == P8B and st["params"] == 0 and st["grads"] == P8B
    # bf16 on one GPU (autocast): plus a bf16 copy of every matmul weight (all but embedding and norms).
    st = first_rank_states(precision="bf16")
    matmul = P8B - 128256 * 4096 - (2 * 32 + 1) * 4096
    assert st["params"] == 2 * matmul and st["master_weights"] == 4 * P8B
    # torchao low-bit AdamW: ~2 bytes (8-bit) and ~1 byte (4-bit) per parameter, plus block scales.
    st8 = first_rank_states(fsdp_shard=4, optimizer="adamw8bit")["optimizer"]
    st4 = first_rank_states(fsdp_shard=4, optimizer="adamw4bit")["optimizer"]
    assert 2 * P8B / 4 < st8 < 2.05 * P8B / 4
    assert 1 * P8B / 4 < st4 < 1.1 * P8B / 4
    # The classic example: 1.5B fp32 parameters take 6 GB of weights, 6 of gradients, 12 of Adam states.
    n = 1_500_000_000
    assert 4 * n == 6e9 and 8 * n == 12e9  # the per-parameter bytes states() uses
    # TP shards the matmul weights and the vocabulary but not the norms.
    tp = first_rank_states(tp=2)["params"]
    assert tp == 4 * ((P8B - (2 * 32 + 1) * 4096) // 2 + (2 * 32 + 1) * 4096)


def test_pipeline_in_flight_microbatches():
    s = Setup(args=model_args("8B"), local_batch=8, seq_len=2048, pp=4)
    assert [p.in_flight for p in rank_plans(s)] == [4, 3, 2, 1]  # 1F1B: pp - rank
    gpipe = dataclasses.replace(s, pp_schedule="GPipe", pp_microbatches=8)
    assert [p.in_flight for p in rank_plans(gpipe)] == [8] * 4
    plans = rank_plans(s)
    assert plans[0].embedding and not plans[0].head and plans[-1].head
    assert sum(len(p.layers) for p in plans) == 32


def test_breakdown_sums_to_peak_and_activations_scale():
    s = Setup(args=model_args("debug"), local_batch=8, seq_len=256)
    b = analyze(s)
    assert sum(b.at_peak.values()) == b.peak
    full = analyze(dataclasses.replace(s, ac_mode="full"))
    op = analyze(dataclasses.replace(s, ac_mode="selective"))
    assert full.sizes["activations"] < op.sizes["activations"] < b.sizes["activations"]
    chunked = analyze(dataclasses.replace(s, loss="chunked", loss_chunk=512))
    assert chunked.sizes["logits"] < b.sizes["logits"] / 3


def _allocator_peak(prof: torch.profiler.profile) -> int:
    """Peak of the CPU allocator's bytes over the profiled region (allocations and frees in time order)."""
    events = getattr(prof.profiler, "kineto_results", None)
    if events is None:
        pytest.skip("this torch's profiler exposes no memory events")
    mem = sorted((e for e in events.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in mem:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("kw", [{}, {"precision": "bf16", "ac_mode": "selective"}])
def test_fake_trace_equals_real_cpu_step(kw):
    """The fake trace of the debug model gives the peak the same tracker measures on real tensors, and
    that tracker agrees with the CPU allocator's own accounting (the profiler's memory events)."""
    # No clipping: on CPU it takes fp64 norms, whose upcast copies live inside the kernel, where no
    # dispatch mode can see them (the CUDA path has none).
    s = Setup(args=model_args("debug"), local_batch=2, seq_len=64, max_norm=0.0, **kw)
    plan = rank_plans(s)[0]
    fake = trace_rank(s, plan)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    real = trace_rank(s, plan, fake=False, watch=prof)
    assert fake.peak == real.peak and fake.peak_phase == real.peak_phase
    steady = sum(real.at_peak[k] for k in ("param", "optimizer", "buffer"))  # allocated before the step
    assert abs(_allocator_peak(prof) - (real.peak - steady)) <= 0.02 * (real.peak - steady)


@pytest.mark.parametrize(
    "kw",
    [
        dict(local_batch=8, seq_len=256),
        dict(local_batch=16, seq_len=256, precision="bf16", fsdp_shard=4, ac_mode="selective",
             loss="chunked", loss_chunk=512),
        dict(local_batch=8, seq_len=256, precision="bf16", tp=2, ac_mode="full"),
        dict(local_batch=8, seq_len=256, pp=2, pp_schedule="GPipe", pp_microbatches=4),
        dict(local_batch=2, seq_len=256, precision="bf16", tp=2, cp=2, fsdp_shard=4, ac_mode="selective"),
    ],
)  # fmt: skip
def test_trace_agrees_with_analytic(kw):
    args = model_args("debug", loss_chunk_size=kw.get("loss_chunk", 0))
    s = Setup(args=args, **kw)
    traced, analytic = trace(s), analyze(s, as_traced=True)
    assert abs(analytic.peak - traced.peak) <= 0.10 * traced.peak


def test_8b_fsdp_estimate_fits_h200_not_h100():
    cfg = config.load(LLAMA8B)
    e = est_mod.estimate(cfg, 4, 80.0)  # traced: the analytic model and the trace agree
    assert e.warning is None and abs(e.trace_vs_analytic_pct) < 10
    assert not e.fits and e.max_local_batch_size == 1
    assert e.peak_allocated_gib == pytest.approx(sum(e.at_peak.values()))
    assert e.total_gib > e.peak_allocated_gib + e.cuda_context_gib
    big = est_mod.estimate(cfg, 4, 140.0, trace=False)
    assert big.fits and big.max_local_batch_size >= 2
    assert big.master_weights_gib == pytest.approx(P8B / GIB, rel=1e-6)  # fp32 / 4 shards = 4 B / 4


def test_max_batch_is_the_largest_that_fits():
    cfg = config.load(DEBUG)
    e = est_mod.estimate(cfg, 1, 1.5, trace=False)
    b = e.max_local_batch_size
    assert b >= 1
    over = lambda k: config.load(DEBUG, ["--training.local_batch_size", str(k)])  # noqa: E731
    assert est_mod.estimate(over(b), 1, 1.5, trace=False).fits
    assert not est_mod.estimate(over(b + 1), 1, 1.5, trace=False).fits
    assert est_mod.estimate(cfg, 1, 0.5, trace=False).max_local_batch_size == 0  # the context alone


def test_cli_json_keys(capsys):
    assert est_mod.main(["--config", DEBUG, "--json", "--ngpu", "1", "--gpu-mem", "24", "--no-trace"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"params_gib", "grads_gib", "optimizer_gib", "activations_gib", "total_gib", "fits", "warning",
            "max_local_batch_size", "master_weights_gib", "fsdp_buffers_gib", "logits_gib"}  # fmt: skip
    assert keys <= set(out) and out["fits"] is True and out["gpu_mem_gib"] == 24.0


def test_cli_text_and_overrides(capsys):
    argv = ["--config", DEBUG, "--ngpu", "1", "--training.local_batch_size", "2", "--no-trace"]
    assert est_mod.main(argv) == 0
    text = capsys.readouterr().out
    assert "local batch 2 x seq 256" in text and "fits" in text and "largest local batch size" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "missing.toml"],
        ["--config", DEBUG, "--training.nope", "1"],
        ["--config", DEBUG, "--ngpu", "two"],
        ["--config", DEBUG, "--ngpu", "3", "--parallelism.tp", "2"],
        ["--config", DEBUG, "--gpu-mem", "-1"],
    ],
)
def test_cli_config_errors_exit_2(argv, capsys):
    assert est_mod.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titanrush estimate: config error:") and "\n" not in err
