"""Attention backends on the GPU: loss and gradient parity of every backend with the unfused baseline,
and FlexAttention's block-causal training."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.loss import cross_entropy

BACKENDS = ["sdpa", "cudnn", "flex", "math"]
HAVE_FLASH = bool(importlib.util.find_spec("flash_attn") or importlib.util.find_spec("flash_attn_interface"))
if HAVE_FLASH:
    BACKENDS.append("flash")


def build(backend: str, **over) -> Llama:
    with torch.device("meta"):
        m = Llama(model_args("debug", attn_backend=backend, n_layers=2, **over))
    m.to_empty(device="cuda")
    m.init_weights(seed=0, buffer_device=torch.device("cuda"))
    return m


def loss_and_grads(model: Llama, x, y, **kw):
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = cross_entropy(model(x, **kw), y)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_math_in_loss_and_gradients(backend):
    torch.manual_seed(0)
    x = torch.randint(0, 8192, (4, 256), device="cuda")
    y = torch.randint(0, 8192, (4, 256), device="cuda")
    ref_loss, ref_grads = loss_and_grads(build("math"), x, y)
    loss, grads = loss_and_grads(build(backend), x, y)
    # bf16 attention kernels differ from the fp32-softmax baseline by bf16 rounding (~1e-2 relative).
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for n in ref_grads:
        rel = (grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()
        assert rel < 3e-2, (n, rel.item())


def test_flex_block_causal_training_isolates_documents():
    """Two documents in one window: the second's loss and gradients equal training on it alone."""
    torch.manual_seed(0)
    model = build("flex")
    x = torch.randint(0, 8192, (2, 256), device="cuda")
    y = torch.randint(0, 8192, (2, 256), device="cuda")
    docs = torch.cat([torch.zeros(2, 100), torch.ones(2, 156)], dim=1).int().cuda()
    pos = torch.cat([torch.arange(100), torch.arange(156)]).expand(2, -1).cuda()
    model.zero_grad()
    logits = model(x, position_ids=pos, document_ids=docs)
    alone = build("sdpa")(x[:, 100:])
    torch.testing.assert_close(logits[:, 100:].float(), alone.float(), rtol=1e-3, atol=1e-3)
    cross_entropy(logits, y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.skipif(not HAVE_FLASH, reason="flash-attn (FA2, FA3 or flash-attn-4) is not installed")
@pytest.mark.parametrize("compiled", ["eager", "compiled", "compiled_ac_op"])
def test_flash_package_at_llama_head_dim(compiled):
    """The package at Llama's head dim (128) with grouped K/V heads, eager and in compiled blocks (FA4 as
    titanrush's operator inside the graph, fullgraph; FA3 and FA2 between graphs), also under selective op
    checkpointing, against the unfused baseline."""
    from titanrush.models.llama.flash import flash_attn_func, uses_graph_break
    from titanrush.parallel.activation_checkpoint import ACPlan, apply_ac
    from titanrush.parallel.compile import CompilePlan, apply_compile

    print("flash interface:", flash_attn_func().__module__)
    if flash_attn_func().__module__.startswith("flash_attn.cute"):  # FA4: through titanrush's operator
        assert not uses_graph_break("flash")
    torch.manual_seed(0)
    shape = dict(dim=512, n_heads=4, n_kv_heads=2)
    x = torch.randint(0, 8192, (2, 1024), device="cuda")
    y = torch.randint(0, 8192, (2, 1024), device="cuda")
    ref_loss, ref_grads = loss_and_grads(build("math", **shape), x, y)
    model = build("flash", **shape)
    if compiled == "compiled_ac_op":
        apply_ac(model, ACPlan(mode="selective"), compiled=True)
    if compiled != "eager":
        torch._dynamo.reset()
        apply_compile(model, CompilePlan(enable=True, fullgraph=not uses_graph_break("flash")))
    for _ in range(2):  # the second call runs the compiled graphs (and FA4's cached kernels)
        loss, grads = loss_and_grads(model, x, y)
    strip = ("_orig_mod.", "_checkpoint_wrapped_module.")
    grads = {functools.reduce(lambda k, w: k.replace(w, ""), strip, n): g for n, g in grads.items()}
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for n in ref_grads:
        rel = (grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()
        assert rel < 3e-2, (n, rel.item())
