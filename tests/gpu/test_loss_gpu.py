"""The chunked (fused linear) cross-entropy on a GPU: cuBLAS sums the weight's gradient in fp32 across
chunks, the result matches the plain compiled loss, and neither the logits nor their gradient are held
whole at any moment."""

from __future__ import annotations

import pytest
import torch

from titanrush.models.llama.loss import chunked_cross_entropy, cross_entropy

N, D, V = 8192, 1024, 32768  # tokens, model width, vocabulary: (N, V) bf16 logits are 0.5 GiB


def _inputs():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h = (torch.randn(N, D, device=dev) / D**0.5).bfloat16().requires_grad_()
    w = torch.randn(V, D, device=dev).bfloat16().requires_grad_()  # as FSDP's unsharded bf16 weight
    labels = torch.randint(0, V, (N,), device=dev)
    labels[:100] = -100
    return h, w, labels


def _run(fn):
    h, w, labels = _inputs()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fn(h, w, labels)
    (loss * 0.5).backward()
    torch.cuda.synchronize()
    return loss.detach(), h.grad, w.grad, torch.cuda.max_memory_allocated() - base


def _plain(h, w, labels):
    return torch.compile(cross_entropy)((h @ w.t()).unsqueeze(0), labels.unsqueeze(0))


def _fp32_reference():
    h, w, labels = _inputs()
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(hf @ wf.t(), labels)
    (loss * 0.5).backward()
    return loss.detach(), hf.grad, wf.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_loss_matches_plain_and_holds_no_full_logits(compiled):
    ref_loss, ref_gh, ref_gw = _fp32_reference()
    p_loss, p_gh, p_gw, p_peak = _run(_plain)
    c_loss, c_gh, c_gw, c_peak = _run(lambda h, w, y: chunked_cross_entropy(h, w, y, 512, compiled=compiled))
    torch.testing.assert_close(c_loss, ref_loss, rtol=2e-3, atol=2e-3)
    # Against fp32 math, the chunked gradients are at least as close as the plain bf16 loss's (which
    # rounds once, where the chunked sums the weight's gradient over 8 chunks in fp32).
    for got, plain, ref in ((c_gh, p_gh, ref_gh), (c_gw, p_gw, ref_gw)):
        err_c = (got.float() - ref).abs().max().item()
        err_p = (plain.float() - ref).abs().max().item()
        assert err_c <= 1.5 * err_p + 1e-6, (err_c, err_p)
    logits = 2 * N * V  # bytes of the (N, V) bf16 logits
    # plain: the logits and their gradient at once; chunked: a chunk's bf16 logits and gradient and (eager)
    # one fp32 (chunk, V) working tensor, the weight's fp32 and bf16 gradients, h's gradient twice (kept,
    # scaled)
    assert p_peak >= 2 * logits
    bound = 512 * V * (2 + 2 + 4) + V * D * (4 + 2) + 2 * 2 * N * D + (16 << 20)
    assert c_peak <= bound < 2 * logits, (c_peak / 2**20, bound / 2**20)


def test_chunked_loss_under_autocast_with_fp32_weights():
    """The single-GPU / DDP path: fp32 master weights under bf16 autocast. The weight's gradient comes
    back in fp32 (summed over chunks in fp32 by cuBLAS, then scaled), as close to fp32 math as autocast's
    own bf16 projection with the compiled plain loss."""
    ref_loss, ref_gh, ref_gw = _fp32_reference()

    def run(fn):
        h, w, labels = _inputs()
        hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(hf, wf, labels)
        (loss * 0.5).backward()
        return loss.detach(), hf.grad, wf.grad

    p_loss, p_gh, p_gw = run(_plain)
    c_loss, c_gh, c_gw = run(lambda h, w, y: chunked_cross_entropy(h, w, y, 512, compiled=True))
    assert c_gh.dtype == c_gw.dtype == torch.float32
    torch.testing.assert_close(c_loss, ref_loss, rtol=2e-3, atol=2e-3)
    for got, plain, ref in ((c_gh, p_gh, ref_gh), (c_gw, p_gw, ref_gw)):
        err_c = (got - ref).abs().max().item()
        err_p = (plain.float() - ref).abs().max().item()
        assert err_c <= 1.5 * err_p + 1e-6, (err_c, err_p)
