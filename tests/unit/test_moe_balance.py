"""Load balance at the shipped defaults: a short `llama4_debug` run ends balanced, and a collapsed
routing is said once (CPU)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from titanrush.models.llama4.balance import COLLAPSE_WINDOWS, ExpertBalance
from titanrush.models.llama4.moe import MoE


class _Part(nn.Module):
    """A model part with one MoE layer as `layers["0"].moe`, what `moe_modules` looks for."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        block = nn.Module()
        block.moe = moe
        self.layers = nn.ModuleDict({"0": block})


def _windows(first_expert: float, windows: int) -> list[str]:
    """Log `windows` windows of a top-1 layer of 8 experts whose gate favours expert 0 by
    `first_expert` (0: no preference), with the bias update off; the warnings logged."""
    torch.manual_seed(0)
    moe = MoE(16, 16, n_experts=8, top_k=1)
    with torch.no_grad():
        moe.router.gate.weight.normal_(std=0.01)
        moe.router.gate.weight[0] += first_expert  # inputs are positive: expert 0 wins every token
    balance = ExpertBalance([_Part(moe)], rate=0.0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("titanrush")
    logger.addHandler(handler)
    try:
        for _ in range(windows):
            for _ in range(5):
                moe(torch.rand(4, 64, 16) if first_expert else torch.randn(4, 64, 16))
                balance.step()
            balance.stats()
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_collapse_warning_once_on_a_collapsed_router():
    assert _windows(1.0, COLLAPSE_WINDOWS - 1) == []  # not yet: a few windows in a row
    said = _windows(1.0, COLLAPSE_WINDOWS + 4)
    assert len(said) == 1, said
    assert "layer 0" in said[0] and "moe.bias_update_rate" in said[0], said[0]


def test_no_collapse_warning_on_a_balanced_router():
    assert _windows(0.0, COLLAPSE_WINDOWS + 4) == []
