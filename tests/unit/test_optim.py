"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from titanrush.optim import build_lr_scheduler, build_optimizer, lr_factor

KW = dict(warmup_steps=4, total_steps=20, decay_ratio=0.25, min_lr_factor=0.1)


def test_warmup_is_linear_to_the_peak():
    for decay in ("linear", "cosine", "wsd"):
        assert [lr_factor(s, decay=decay, **KW) for s in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_linear_and_cosine_decay_values():
    for s in range(5, 21):
        p = (s - 4) / 16
        assert lr_factor(s, decay="linear", **KW) == pytest.approx(1 - 0.9 * p)
        assert lr_factor(s, decay="cosine", **KW) == pytest.approx(
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))
        )
    assert lr_factor(20, decay="cosine", **KW) == pytest.approx(0.1)


def test_wsd_is_stable_then_decays_over_the_last_share():
    # 16 steps after warmup, 25% of them (4) decay: steps 17..20.
    values = [lr_factor(s, decay="wsd", **KW) for s in range(5, 21)]
    assert values[:12] == [1.0] * 12
    assert values[12:] == pytest.approx([1 - 0.9 * k / 4 for k in range(1, 5)])


def test_scheduler_applies_factor_per_optimizer_step():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = build_lr_scheduler(opt, decay="linear", **KW)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * lr_factor(s, decay="linear", **KW) for s in range(1, 21)])


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_implementations_agree(impl):
    torch.manual_seed(0)
    ref_w = torch.randn(8, 8)
    grads = [torch.randn(8, 8) for _ in range(3)]

    def run(implementation: str) -> torch.Tensor:
        w = torch.nn.Parameter(ref_w.clone())
        opt = build_optimizer(
            [w],
            name="adamw",
            lr=1e-2,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            implementation=implementation,
        )
        for g in grads:
            w.grad = g.clone()
            opt.step()
        return w.detach()

    torch.testing.assert_close(run(impl), run("for-loop"), rtol=1e-5, atol=1e-6)


def test_unknown_decay_is_an_error():
    with pytest.raises(ValueError, match="lr_scheduler.decay"):
        lr_factor(10, decay="step", **KW)


@pytest.mark.parametrize("name, rtol", [("adamw8bit", 0.05), ("adamw4bit", 0.15)])
def test_low_bit_adamw_tracks_fp32_adamw(name, rtol):
    """torchao's quantized optimizer states: the first updates stay close to fp32 AdamW's."""
    pytest.importorskip("torchao", reason="low-bit AdamW is torchao's (a project dependency)")
    torch.manual_seed(0)
    ref_w = torch.randn(256, 256)  # torchao quantizes states of tensors with >= 4096 elements
    grads = [torch.randn(256, 256) for _ in range(3)]

    def run(opt_name: str) -> torch.Tensor:
        w = torch.nn.Parameter(ref_w.clone())
        opt = build_optimizer(
            [w],
            name=opt_name,
            lr=1e-2,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
            implementation="for-loop",
        )
        for g in grads:
            w.grad = g.clone()
            opt.step()
        return w.detach() - ref_w  # the total update

    ref, got = run("adamw"), run(name)
    assert (got - ref).norm() / ref.norm() < rtol
    assert (got - ref).norm() > 0  # states really are quantized
