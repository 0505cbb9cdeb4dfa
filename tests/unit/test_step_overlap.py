"""The optimizer step unit by unit (step_overlap): the same update as one step, each unit's float8 scales
computed after its update, in the order the forward gathers the units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titanrush.parallel.grad_clip import clip_coefficient, clip_grad_norm_
from titanrush.parallel.step_overlap import OverlappedStep, param_groups


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))


def _adamw(groups: list[list[nn.Parameter]], **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW([{"params": g} for g in groups], **kw)


def _backward(model: nn.Module) -> None:
    model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()


def test_unit_steps_match_one_step_and_scales_follow_each_update():
    ref, model = _model(), _model()
    units = [[m] for m in model]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=True)
    opt = _adamw(param_groups(units, model), lr=0.1, foreach=True)
    assert len(opt.param_groups) == 4  # the root holds nothing of its own
    calls: list[tuple[int, bool]] = []  # (unit, its weight already updated when its scales are computed)
    before = {id(m): m.weight.detach().clone() for m in model}

    def scales(module: nn.Module) -> None:
        calls.append((list(model).index(module), not torch.equal(module.weight, before[id(module)])))

    overlap = OverlappedStep(opt, root=model, units=units, scales=scales)
    for _ in range(2):
        for m in (ref, model):
            _backward(m)
        total = clip_grad_norm_(ref.parameters(), 0.5)
        assert total > 0.5  # the clip scales
        norm = clip_grad_norm_(model.parameters(), 0.5, scale=False)
        opt_ref.step()
        opt_ref.zero_grad()
        overlap.step(clip_coefficient(norm, 0.5))  # (no zero_grad: the forward frees each unit's)
        assert calls == []  # nothing yet: the next forward asks for each unit as it gathers it
        assert overlap.pending == {0, 1, 2, 3} and all(p.grad is not None for p in model.parameters())
        with torch.no_grad():
            model(torch.zeros(1, 8))
        assert all(p.grad is None for p in model.parameters())
        # the root asks for unit 0; unit i for itself and the unit it prefetches (i + 1)
        assert calls == [(0, True), (1, True), (2, True), (3, True)] and not overlap.pending
        calls.clear()
        before = {id(m): m.weight.detach().clone() for m in model}
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_finish_readies_what_no_forward_asked_for_and_a_step_without_forward_is_an_error():
    model = _model()
    units = [[m] for m in model]
    seen: list[int] = []
    opt = _adamw(param_groups(units, model), lr=0.1)
    overlap = OverlappedStep(opt, root=model, units=units, scales=lambda m: seen.append(list(model).index(m)))
    _backward(model)
    overlap.step(None)
    overlap.finish()  # (as before a validation pass or a checkpoint)
    assert seen == [0, 1, 2, 3] and not overlap.pending
    assert all(p.grad is None for p in model.parameters())
    _backward(model)  # (its forward finds nothing to wait for)
    overlap.step(None)
    assert seen == [0, 1, 2, 3] and overlap.pending == {0, 1, 2, 3}
    for p in model.parameters():  # gradients again with no forward between: they would add up
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"parameter groups \[0, 1, 2, 3\] were never waited for"):
        overlap.step(None)


def test_a_unit_without_trainable_parameters_keeps_its_group():
    model = _model()
    model[1].requires_grad_(False)
    units = [[m] for m in model]
    groups = param_groups(units, model)
    assert [len(g) for g in groups] == [2, 0, 2, 2]  # group i stays unit i's
    opt = _adamw(groups, lr=0.1)
    before = [m.weight.detach().clone() for m in model]
    overlap = OverlappedStep(opt, root=model, units=units, scales=None)
    _backward(model)
    overlap.step(None)
    with torch.no_grad():
        model(torch.zeros(1, 8))
    changed = [not torch.equal(m.weight, b) for m, b in zip(model, before)]
    assert changed == [True, False, True, True]


def test_root_parameters_of_its_own_come_first_and_groups_must_match_units():
    model = _model()
    model.register_parameter("table", nn.Parameter(torch.zeros(3)))  # held by no unit (a tied table)
    units = [[m] for m in list(model)[:3]]
    groups = param_groups(units, model)
    # the root's own first: the table and the Linear no unit holds; then the 3 units'
    assert [len(g) for g in groups] == [3, 2, 2, 2] and groups[0][0] is model.table
    with pytest.raises(ValueError, match="4 parameter groups for 2 FSDP units"):
        OverlappedStep(_adamw(groups), root=model, units=units[:2], scales=None)


def test_build_optimizer_takes_parameter_groups():
    from titanrush.optim import build_optimizer

    model = _model()
    kw = dict(name="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="foreach")
    opt = build_optimizer(param_groups([[m] for m in model], model), **kw)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2, 2, 2]
    assert len(build_optimizer(model.parameters(), **kw).param_groups) == 1


def test_scales_beside_follow_each_update_within_the_step():
    model = _model()
    units = [[m] for m in model]
    seen: list[tuple[int, bool]] = []
    before = {id(m): m.weight.detach().clone() for m in model}

    def scales(module: nn.Module) -> torch.Tensor:
        i = list(model).index(module)
        updated = [not torch.equal(m.weight, before[id(m)]) for m in model]
        assert updated == [j <= i for j in range(4)]  # right after its own update, before the next unit's
        seen.append((i, updated[i]))
        return torch.ones(1)

    opt = _adamw(param_groups(units, model), lr=0.1)
    overlap = OverlappedStep(opt, root=model, units=units, scales=scales, scales_beside=True)
    _backward(model)
    overlap.step(None)
    assert seen == [(0, True), (1, True), (2, True), (3, True)]  # each right after its own update
    with torch.no_grad():
        model(torch.zeros(1, 8))
    assert len(seen) == 4 and not overlap.pending  # the forward's hooks only wait
