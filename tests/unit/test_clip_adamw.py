"""The clip folded into AdamW (`optimizer.implementation = fused_clip`): where it runs, the factor it
scales by, and what the estimator charges for it. Its Triton kernel runs on CUDA only:
tests/gpu/test_optim_gpu.py holds it against torch's fused AdamW after the clip."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from titanrush import clip_adamw
from titanrush.clip_adamw import ClipAdamW, clip_coefficient, unavailable
from titanrush.models.llama import model_args
from titanrush.optim import build_optimizer
from titanrush.run.memory_model import analyze
from titanrush.run.plan import RunPlan

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-machine", "cuda-machine"])
def test_cpu_parameters_take_torchs_fused_adamw_said_where_cuda_is(caplog, monkeypatch, cuda):
    """Without CUDA torch's kernel is the expected one (nothing said); with it, a run whose parameters
    cannot take the kernel (here: on the host, as under FSDP's CPU offload) says why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(logging.getLogger("titanrush"), "propagate", True)  # (init_logging may stop it)
    w = torch.nn.Parameter(torch.randn(4, 4))
    with caplog.at_level(logging.INFO, logger="titanrush"):
        opt = build_optimizer([w], name="adamw", implementation="fused_clip", **HYPER)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    said = (
        "fused_clip: the parameters live on cpu, the kernel needs CUDA; torch's fused AdamW, the clip apart"
    )
    assert (said in caplog.text) == cuda


class _Subclass(torch.Tensor):
    pass


def test_unavailable_names_what_is_missing(monkeypatch):
    assert "needs CUDA" in unavailable([torch.empty(3, device="meta")])
    assert "needs CUDA" in unavailable([torch.nn.Parameter(torch.empty(3))])
    # a tensor subclass (float8's weights under FSDP's float8 all-gather) keeps torch's kernel
    sub = torch.Tensor._make_subclass(_Subclass, torch.empty(3))
    assert "_Subclass (a tensor subclass" in unavailable([sub, torch.empty(3)])
    monkeypatch.setattr(clip_adamw, "triton", None)
    assert "needs CUDA" in unavailable([torch.empty(3)])  # (on CPU the device is the reason)
    monkeypatch.setattr(clip_adamw, "_unfit", lambda t: None)  # (as CUDA fp32 tensors would be)
    assert unavailable([torch.empty(3)]) == "Triton is not installed"


def test_low_bit_optimizers_ignore_the_implementation():
    pytest.importorskip("torchao")
    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = build_optimizer([w], name="adamw8bit", implementation="fused_clip", **HYPER)
    assert not isinstance(opt, ClipAdamW) and type(opt).__name__ == "AdamW8bit"


@pytest.mark.parametrize("scale", [10.0, 1e-3], ids=["clipped", "below-max-norm"])
def test_the_factor_is_the_one_clip_grads_with_norm_scales_by(scale):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300)]
    grads = [torch.randn(n) * scale for n in (7, 300)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    coef = clip_coefficient(norm, 1.0)
    assert coef.shape == (1,) and coef.dtype == torch.float32
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * coef, p.grad, rtol=1e-6, atol=0)
    assert (float(coef) < 1.0) == (scale > 1.0)


def test_no_clipping_is_a_factor_of_one():
    assert float(clip_coefficient(torch.tensor(1e6), 0.0)) == 1.0


def test_the_estimator_charges_fused_clip_no_optimizer_temporaries():
    s = RunPlan(args=model_args("debug"), local_batch=8, seq_len=256)
    peaks = {
        impl: analyze(dataclasses.replace(s, optimizer_impl=impl)).moments["optimizer step"]
        for impl in ("fused_clip", "fused", "foreach")
    }
    assert peaks["fused_clip"] == peaks["fused"]
    assert sum(peaks["foreach"].values()) > sum(peaks["fused"].values())
