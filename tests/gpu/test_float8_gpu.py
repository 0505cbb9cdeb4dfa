"""Float8 training on a GPU with float8 tensor cores (H100/H200): close to bf16, and it trains."""

from __future__ import annotations

import pytest
import torch

from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.loss import cross_entropy

torchao = pytest.importorskip("torchao", reason="float8 needs torchao (carried as a wheel to the GPU box)")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_close_to_bf16(recipe):
    from titanrush.parallel.float8 import Float8Plan, apply_float8, float8_supported

    if not float8_supported():
        pytest.skip("this GPU has no float8 tensor cores")
    torch.manual_seed(0)

    def build(f8: bool) -> Llama:
        with torch.device("meta"):
            m = Llama(model_args("debug", dim=1024, n_heads=8, n_kv_heads=8, n_layers=2, multiple_of=256))
        if f8:
            names = apply_float8(
                m, Float8Plan(enable=True, recipe=recipe, filter_fqns=("output",), min_size=256)
            )
            assert "layers.0.attention.wq" in names and "output" not in names
        m.to_empty(device="cuda")
        m.init_weights(seed=0, buffer_device=torch.device("cuda"))
        return m

    x = torch.randint(0, 8192, (4, 512), device="cuda")
    y = torch.randint(0, 8192, (4, 512), device="cuda")
    losses = []
    for f8 in (False, True):
        m = build(f8)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(m(x), y)
        loss.backward()
        losses.append(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
