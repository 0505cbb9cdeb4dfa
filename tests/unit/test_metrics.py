"""FLOPs, the peak table, MFU's honesty, and the metrics sinks."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from titanrush.metrics import MetricsLogger, Throughput, flops_per_token, matmul_params, peak_tflops
from titanrush.models.llama import Llama, model_args


def test_flops_per_token_for_8b_by_hand():
    args = model_args("8B")
    with torch.device("meta"):
        model = Llama(args)
    n = matmul_params(model)
    # By hand: per layer 4096*(4096 + 2*1024 + 4096) attention + 3*4096*14336 MLP; plus the output.
    per_layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    assert n == 32 * per_layer + 128256 * 4096
    seq = 8192
    assert flops_per_token(args, n, seq) == 6 * n + 12 * 32 * 32 * 128 * seq


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_equals_torchs_flop_counter(tied):
    """The formula against an independent count: torch's FlopCounterMode over one forward and backward of
    the debug model, with the unfused attention (its score and weighted-sum matmuls over the full T x T
    square, as the formula counts them)."""
    from torch.utils.flop_counter import FlopCounterMode

    args = model_args("debug", attn_backend="math", tie_embeddings=tied)
    model = Llama(args)
    model.init_weights(seed=0)
    batch, seq = 2, 96
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(args, matmul_params(model), seq) * batch * seq


def test_tied_output_projection_is_counted():
    with torch.device("meta"):
        tied = Llama(model_args("1B"))
        untied = Llama(model_args("1B", tie_embeddings=False))
    assert matmul_params(tied) == matmul_params(untied)


@pytest.mark.parametrize(
    "name, precision, expect",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H200 NVL", "bf16", 835.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA GH200 480GB", "bf16", 989.0),
        ("Some Future GPU 9000", "bf16", None),
        ("NVIDIA A100-SXM4-80GB", "fp8", None),  # no float8 on A100: no guess
    ],
)
def test_peak_table(name, precision, expect):
    assert peak_tflops(name, precision) == expect


def test_throughput_has_no_mfu_without_a_peak():
    t = Throughput(flops_per_token=1e9, peak=None)
    t.add(1000, 0.0)
    out = t.read()
    assert out["mfu"] is None and out["tflops"] > 0
    t2 = Throughput(flops_per_token=1e9, peak=100.0)
    t2.add(1000, 0.0)
    out2 = t2.read()
    assert out2["mfu"] == pytest.approx(100 * out2["tflops"] / 100.0)


def test_metrics_logger_writes_jsonl_console_and_tensorboard(tmp_path, caplog):
    log = MetricsLogger(tmp_path, enabled=True, tensorboard=True, rank=0)
    with caplog.at_level(logging.INFO, logger="titanrush"):
        logging.getLogger("titanrush").propagate = True
        log.log(3, {"loss": 2.5, "mfu": None, "tps": 1234.0})
    log.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec == {"step": 3, "attempt": 1, "loss": 2.5, "mfu": None, "tps": 1234.0}
    assert "loss 2.5000" in caplog.text and "mfu" not in caplog.text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "attempt-1"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "tps"}
    assert acc.Scalars("loss")[0].value == pytest.approx(2.5)


def test_non_finite_numbers_are_null_in_json_and_absent_from_tensorboard(tmp_path, caplog):
    log = MetricsLogger(tmp_path, enabled=True, tensorboard=True, rank=0, attempt=2)
    with caplog.at_level(logging.INFO, logger="titanrush"):
        logging.getLogger("titanrush").propagate = True
        log.log(4, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    log.close()
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    rec = json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}"))
    assert rec == {"step": 4, "attempt": 2, "loss": None, "grad_norm": None, "lr": 1e-3}
    assert "loss nan" in caplog.text and "gnorm inf" in caplog.text  # the console shows what happened
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "attempt-2"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"lr"}


def test_throughput_leaves_paused_time_out():
    import time

    t = Throughput(flops_per_token=1e9, peak=None)
    t.add(1000, 0.0)
    time.sleep(0.05)
    with t.paused(torch.device("cpu")):
        time.sleep(0.3)  # a validation or a checkpoint save
    out = t.read()
    assert 0.04 < out["step_time"] < 0.2, out
    assert out["tps"] == pytest.approx(1000 / out["step_time"], rel=1e-6)


def test_the_synchronous_checkpoint_mode_is_not_called_disabled():
    from titanrush.metrics import format_line

    line = format_line({"step": 5, "ckpt_mode": "disabled", "ckpt_blocking_s": 1.16, "ckpt_save_s": 1.2})
    assert "disabled" not in line and "checkpoint (sync save)" in line and "training blocked 1.16s" in line
    assert "checkpoint (async save)" in format_line({"step": 5, "ckpt_mode": "async"})


def test_throughput_totals_cover_every_window_of_the_run_paused_time_left_out():
    """The run summary's tokens/s: every window's tokens over every window's training time (a validation
    or a save left out), the window in progress included."""
    import time

    t = Throughput(flops_per_token=1e9, peak=None)
    t.add(1000, 0.0)
    time.sleep(0.05)
    first = t.read()["step_time"]
    t.reset()
    t.add(3000, 0.0)
    time.sleep(0.05)
    with t.paused(torch.device("cpu")):
        time.sleep(0.5)
    tokens, seconds = t.totals()
    assert tokens == 4000
    assert first + 0.05 <= seconds < 0.45, (first, seconds)
