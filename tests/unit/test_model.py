"""The native Llama: parameter counts, RoPE, attention, initialization, losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from titanrush.models.llama import FLAVORS, Llama, model_args
from titanrush.models.llama.loss import chunked_cross_entropy, cross_entropy
from titanrush.models.llama.model import apply_rope, rope_cache, rope_frequencies


def count(flavor: str, **over) -> int:
    with torch.device("meta"):
        model = Llama(model_args(flavor, **over))
    return sum(p.numel() for p in model.parameters())


# Published sizes (Meta's model cards / config.json arithmetic), in billions, to the precision published.
@pytest.mark.parametrize(
    "flavor, published, digits",
    [("1B", 1.24, 2), ("3B", 3.21, 2), ("8B", 8.03, 2), ("70B", 70.6, 1), ("405B", 405.9, 1)],
)
def test_parameter_counts_match_published(flavor, published, digits):
    assert round(count(flavor) / 1e9, digits) == published


def test_8b_shapes_match_the_reference_layout():
    a = FLAVORS["8B"]
    with torch.device("meta"):
        m = Llama(a)
    assert m.layers["0"].feed_forward.w1.weight.shape == (14336, 4096)
    assert m.layers["0"].attention.wk.weight.shape == (8 * 128, 4096)
    assert m.output.weight.shape == (128256, 4096)
    assert len(m.layers) == 32


def test_tied_embeddings_share_one_tensor():
    with torch.device("meta"):
        m = Llama(FLAVORS["1B"])
    assert m.output.weight is m.tok_embeddings.weight
    with torch.device("meta"):
        small = Llama(model_args("debug", tie_embeddings=True))
    small.to_empty(device="cpu")
    small.init_weights(seed=0)  # materialized and initialized: still one tensor
    assert small.output.weight is small.tok_embeddings.weight
    assert len(list(small.parameters())) == len(list(small.named_parameters()))
    assert count("1B", tie_embeddings=False) - count("1B") == 128256 * 2048


def test_rope_matches_complex_rotation():
    args = model_args("debug")
    T, D = 16, args.head_dim
    x = torch.randn(2, T, 3, D)
    freqs = rope_frequencies(args)
    # Direct formula: pair (x[2i], x[2i+1]) as a complex number times exp(i * pos * freq_i).
    xc = torch.view_as_complex(x.reshape(2, T, 3, D // 2, 2))
    pos = torch.arange(T, dtype=torch.float32)
    rot = torch.polar(torch.ones(T, D // 2), torch.outer(pos, freqs))
    expect = torch.view_as_real(xc * rot[None, :, None, :]).reshape(2, T, 3, D)
    torch.testing.assert_close(apply_rope(x, rope_cache(args, T)), expect, atol=1e-5, rtol=1e-5)


def test_rope_position_ids_select_rows():
    args = model_args("debug")
    rope = rope_cache(args, 32)
    x = torch.randn(1, 4, 2, args.head_dim)
    pos = torch.tensor([[5, 6, 0, 1]])
    out = apply_rope(x, rope[pos])
    torch.testing.assert_close(out[:, :2], apply_rope(x[:, :2], rope[5:7]))
    torch.testing.assert_close(out[:, 2:], apply_rope(x[:, 2:], rope[0:2]))


def test_llama31_rope_scaling_formula():
    args = model_args("8B")
    scaled = rope_frequencies(args).double()
    base = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    for f, s in zip(base.tolist(), scaled.tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want = f
        elif wavelen > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert s == pytest.approx(want, rel=1e-6)
    assert scaled[0] == pytest.approx(1.0)  # highest frequency untouched
    assert scaled[-1] == pytest.approx(base[-1].item() / 8, rel=1e-6)  # lowest scaled by 8


def test_ffn_hidden_follows_multiplier_and_multiple_of():
    assert FLAVORS["8B"].ffn_hidden == 14336
    assert FLAVORS["70B"].ffn_hidden == 28672
    assert FLAVORS["1B"].ffn_hidden == 8192


def build(seed: int = 0, **over) -> Llama:
    with torch.device("meta"):
        m = Llama(model_args("debug", **over))
    m.to_empty(device="cpu")
    m.init_weights(seed=seed)
    return m


def test_same_seed_same_weights_and_meta_equals_eager():
    a, b, c = build(1), build(1), build(2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.dim() > 1:
            assert not torch.equal(p, r), n
    eager = Llama(model_args("debug"))
    eager.init_weights(seed=1)
    for p, q in zip(a.parameters(), eager.parameters()):
        assert torch.equal(p, q)


def test_every_parameter_is_initialized():
    m = build(3)
    inits = m.param_inits()
    assert set(inits) == {n for n, _ in m.named_parameters()}
    assert torch.isfinite(torch.cat([p.flatten() for p in m.parameters()])).all()


def test_causality_future_tokens_do_not_change_past_logits():
    m = build(0)
    x = torch.randint(0, 8192, (1, 32))
    y = x.clone()
    y[0, 20:] = torch.randint(0, 8192, (12,))
    with torch.no_grad():
        torch.testing.assert_close(m(x)[:, :20], m(y)[:, :20])


def loss_and_grads(model: Llama, x, labels, chunked: bool = False):
    model.zero_grad()
    if chunked:
        loss = model(x, labels=labels)
    else:
        loss = cross_entropy(model(x), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(g1: dict, g2: dict) -> None:
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def test_math_backend_matches_sdpa_in_loss_and_gradients():
    x = torch.randint(0, 8192, (2, 64))
    labels = torch.randint(0, 8192, (2, 64))
    l1, g1 = loss_and_grads(build(0, attn_backend="sdpa"), x, labels)
    l2, g2 = loss_and_grads(build(0, attn_backend="math"), x, labels)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    assert_same_grads(g1, g2)


def _fake_flash_attn(returns_lse: bool):
    """A flash-attn module with the package's documented interface, computed by explicit softmax:
    flash_attn_func(q, k, v, causal=True) on (B, T, H, D) with fewer K/V heads (GQA) allowed; FA2
    returns the output, FA3's hopper build (out, softmax_lse)."""
    import types

    def flash_attn_func(q, k, v, causal=False):
        assert causal and q.shape[-1] == k.shape[-1] and q.shape[2] % k.shape[2] == 0
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        t = q.shape[1]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return (out, scores.logsumexp(-1)) if returns_lse else out

    return types.SimpleNamespace(flash_attn_func=flash_attn_func)


def _install_flash(monkeypatch, module: str, fake) -> None:
    """Make `fake` the only flash-attn interface that imports (as `module`), for this test."""
    import sys

    for name in ("flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)  # None: "not importable"
    monkeypatch.setitem(sys.modules, module, fake)
    _clear_flash_caches()


def _clear_flash_caches() -> None:
    """Forget which flash-attn interface imported (each test installs its own stand-in)."""
    from titanrush.models.llama import attention as attn

    attn.flash_attn_func.cache_clear()
    attn.flash_kernels.cache_clear()


@pytest.mark.parametrize("module, returns_lse", [("flash_attn", False), ("flash_attn_interface", True)])
def test_flash_backend_calls_the_packages_interface_right(monkeypatch, module, returns_lse):
    # The flash-attn package is not installable on our machines (no wheel; GPU.md): this checks our
    # adapter (layout, causality, grouped K/V heads, FA3's tuple) against the documented interface.

    _install_flash(monkeypatch, module, _fake_flash_attn(returns_lse))
    try:
        x = torch.randint(0, 8192, (2, 64))
        labels = torch.randint(0, 8192, (2, 64))
        l1, g1 = loss_and_grads(build(0, attn_backend="sdpa"), x, labels)
        l2, g2 = loss_and_grads(build(0, attn_backend="flash"), x, labels)
    finally:
        _clear_flash_caches()
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    assert_same_grads(g1, g2)


def test_flash_backend_turns_on_the_kernel_cache_unless_told(monkeypatch):
    """FA4 reads FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED when imported: set before the import, kept if set."""
    import os

    from titanrush.models.llama import attention as attn

    key = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
    seen = {}

    class Spy:  # a stand-in `flash_attn.cute` whose import records the variable at that moment
        def __getattr__(self, name):
            seen[name] = os.environ.get(key)
            return lambda *a, **k: None

    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
        _install_flash(monkeypatch, "flash_attn.cute", Spy())
        try:
            attn.flash_attn_func()
        finally:
            _clear_flash_caches()
        assert seen.pop("flash_attn_func") == (value or "1")


def test_compiled_blocks_run_the_flash_package_between_graphs(monkeypatch):
    # The package's kernels cannot be traced (FA4's CuTe kernels are autograd Functions over a JIT):
    # a compiled block must run the call eagerly, and the model must train as the eager one does.
    import types

    from titanrush.config import ActivationCheckpoint, Compile, Float8, Parallelism
    from titanrush.models.llama.parallelize import parallelize_llama
    from titanrush.parallel.parallel_dims import ParallelDims

    calls = []
    fa3 = _fake_flash_attn(True).flash_attn_func

    def traced_flash(q, k, v, causal=False):
        calls.append(torch.compiler.is_compiling())
        return fa3(q, k, v, causal=causal)

    _install_flash(monkeypatch, "flash_attn_interface", types.SimpleNamespace(flash_attn_func=traced_flash))
    torch._dynamo.reset()
    try:
        x = torch.randint(0, 8192, (2, 64))
        labels = torch.randint(0, 8192, (2, 64))
        l1, g1 = loss_and_grads(build(0, attn_backend="flash"), x, labels)
        compiled = build(0, attn_backend="flash")
        parallelize_llama(
            compiled,
            ParallelDims(1, 1, 1, 1, 1, 1),
            None,
            parallelism=Parallelism(),
            compile=Compile(enable=True, fullgraph=True),
            ac=ActivationCheckpoint(mode="none"),
            float8=Float8(),
            precision="fp32",
        )
        calls.clear()
        l2, g2 = loss_and_grads(compiled, x, labels)
    finally:
        _clear_flash_caches()
        torch._dynamo.reset()
    assert calls and not any(calls)  # called once per block, never inside a traced graph
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    g2 = {n.replace("_orig_mod.", ""): g for n, g in g2.items()}
    assert_same_grads(g1, g2)


def _fake_flash4(calls: dict):
    """A stand-in for flash-attn-4's `flash_attn.cute.interface`: `_flash_attn_fwd` and `_flash_attn_bwd`
    with the package's argument order and results (out, logsumexp (B, H, T) fp32; dq, dk, dv laid out
    like q, k, v), computed by explicit softmax; `calls` counts each."""
    import types

    math_attn = _fake_flash_attn(True).flash_attn_func

    def _flash_attn_fwd(q, k, v, causal=False, return_lse=False):
        calls["fwd"] += 1
        assert causal and return_lse
        out, lse = math_attn(q, k, v, causal=True)
        return out.contiguous(), lse.float().contiguous(), None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False):
        calls["bwd"] += 1
        assert causal and softmax_scale is None and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        # (runs below autograd, as the real kernel does): the softmax rebuilt from the saved logsumexp
        b, t, h, d = q.shape
        rep = h // k.shape[2]
        kr, vr = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(d)
        p = (scores - lse[..., None]).exp().masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), 0)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
        ds = p * (dp - (dout * out).sum(-1).transpose(1, 2)[..., None]) / math.sqrt(d)
        dq, dk = torch.einsum("bhqk,bkhd->bqhd", ds, kr), torch.einsum("bhqk,bqhd->bkhd", ds, q)
        grouped = [g.unflatten(2, (h // rep, rep)).sum(3) for g in (dk, dv)]
        return tuple(torch.empty_like(x).copy_(g) for x, g in zip((q, k, v), (dq, *grouped)))

    interface = types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)
    return types.SimpleNamespace(flash_attn_func=math_attn, interface=interface), interface


def _use_fake_flash4(monkeypatch, calls: dict):
    """Install the FA4 stand-in (counting into `calls`) as the only flash-attn that imports; its module."""
    import sys

    cute, interface = _fake_flash4(calls)
    _install_flash(monkeypatch, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    torch._dynamo.reset()
    return cute


def test_flash4_runs_as_one_operator_compiled_whole_and_kept_by_selective_checkpointing(monkeypatch):
    # FA4 through titanrush's custom operator: trains as SDPA does; a compiled block with selective op
    # checkpointing compiles whole (fullgraph) and keeps the attention output, so that backward runs the
    # package's backward once per block and its forward never again (the recompute skips it).
    from titanrush.config import ActivationCheckpoint, Compile, Float8, Parallelism
    from titanrush.models.llama import attention as attn
    from titanrush.models.llama.parallelize import parallelize_llama
    from titanrush.parallel.parallel_dims import ParallelDims

    calls = {"fwd": 0, "bwd": 0}
    _use_fake_flash4(monkeypatch, calls)
    x = torch.randint(0, 8192, (2, 64))
    labels = torch.randint(0, 8192, (2, 64))
    try:
        l1, g1 = loss_and_grads(build(0, attn_backend="sdpa"), x, labels)
        for compiled in (False, True):
            model = build(0, attn_backend="flash")
            assert not attn.uses_graph_break("flash")
            parallelize_llama(
                model, ParallelDims(1, 1, 1, 1, 1, 1), None, parallelism=Parallelism(),
                compile=Compile(enable=compiled, fullgraph=True), ac=ActivationCheckpoint(mode="selective"),
                float8=Float8(), precision="fp32",
            )  # fmt: skip
            loss_and_grads(model, x, labels)  # (the compiled model's first step compiles)
            calls.update(fwd=0, bwd=0)
            l2, g2 = loss_and_grads(model, x, labels)
            n = len(model.layers)
            assert calls == {"fwd": n, "bwd": n}, (compiled, calls)
            torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
            assert_same_grads(g1, {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): g
                                   for k, g in g2.items()})  # fmt: skip
    finally:
        _clear_flash_caches()
        torch._dynamo.reset()


def test_flash4_between_graphs_calls_the_packages_function_and_compiles_with_a_break(monkeypatch):
    # model.flash_in_graph = false: FA4's own autograd function (the stand-in's flash_attn_func), between
    # the compiled graphs of each block, trains as SDPA does; titanrush's operator never runs.
    from titanrush.config import ActivationCheckpoint, Compile, Float8, Parallelism
    from titanrush.models.llama import attention as attn
    from titanrush.models.llama.parallelize import parallelize_llama
    from titanrush.parallel.parallel_dims import ParallelDims

    calls = {"fwd": 0, "bwd": 0, "func": 0}
    cute = _use_fake_flash4(monkeypatch, calls)
    package_func = cute.flash_attn_func

    def counted(*a, **kw):
        calls["func"] += 1
        return package_func(*a, **kw)

    cute.flash_attn_func = counted  # (read at the first flash call, after this)
    x = torch.randint(0, 8192, (2, 64))
    labels = torch.randint(0, 8192, (2, 64))
    try:
        l1, g1 = loss_and_grads(build(0, attn_backend="sdpa"), x, labels)
        assert attn.uses_graph_break("flash", flash_in_graph=False) and not attn.uses_graph_break("flash")
        model = build(0, attn_backend="flash", flash_in_graph=False)
        parallelize_llama(
            model, ParallelDims(1, 1, 1, 1, 1, 1), None, parallelism=Parallelism(),
            compile=Compile(enable=True, fullgraph=True), ac=ActivationCheckpoint(mode="none"),
            float8=Float8(), precision="fp32",
        )  # fmt: skip
        assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in model.layers.values())
        l2, g2 = loss_and_grads(model, x, labels)  # compiles without fullgraph (it would raise at the break)
        n = len(model.layers)
        assert calls == {"fwd": 0, "bwd": 0, "func": n}
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
        assert_same_grads(g1, {k.replace("_orig_mod.", ""): g for k, g in g2.items()})
    finally:
        _clear_flash_caches()
        torch._dynamo.reset()


def _traced_fake_flash4(monkeypatch, *, warm_up_fails: bool = False) -> list[tuple]:
    """The FA4 stand-in, each call noted as (kind, thread, q's shape, k's shape); its first forward (the
    warm-up's) takes 0.3 s, as a kernel compile would, or fails."""
    import threading
    import time

    cute = _use_fake_flash4(monkeypatch, {"fwd": 0, "bwd": 0})
    fwd, bwd = cute.interface._flash_attn_fwd, cute.interface._flash_attn_bwd
    seen: list[tuple] = []

    def traced_fwd(q, k, v, **kw):
        seen.append(("fwd", threading.current_thread().name, tuple(q.shape), tuple(k.shape)))
        if len(seen) == 1:
            time.sleep(0.3)
            if warm_up_fails:
                raise RuntimeError("no kernel for this GPU")
        return fwd(q, k, v, **kw)

    def traced_bwd(q, k, *a, **kw):
        seen.append(("bwd", threading.current_thread().name, tuple(q.shape), tuple(k.shape)))
        return bwd(q, k, *a, **kw)

    monkeypatch.setattr(cute.interface, "_flash_attn_fwd", traced_fwd)
    monkeypatch.setattr(cute.interface, "_flash_attn_bwd", traced_bwd)

    class PackageFunction(torch.autograd.Function):  # the package's own function calls the same two
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = cute.interface._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return cute.interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=True)

    monkeypatch.setattr(cute, "flash_attn_func", lambda q, k, v, causal: PackageFunction.apply(q, k, v))
    return seen


def _backward_on_a_device_thread(monkeypatch) -> None:
    """Tensor.backward runs the graph on a thread of its own, as autograd's engine does for CUDA tensors
    (its device threads); CPU tensors would otherwise run it on the caller's thread."""
    import threading

    backward = torch.Tensor.backward

    def on_device_thread(self, *a, **kw):
        errors: list[BaseException] = []

        def run():
            try:
                backward(self, *a, **kw)
            except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                errors.append(e)

        t = threading.Thread(target=run, name="autograd device thread", daemon=True)
        t.start()
        t.join(timeout=20)
        assert not t.is_alive(), "backward did not finish: its thread waits for the caller"
        if errors:
            raise errors[0]

    monkeypatch.setattr(torch.Tensor, "backward", on_device_thread)


@pytest.mark.parametrize("in_graph", [True, False])
@pytest.mark.parametrize("warm_up_fails", [False, True])
def test_flash4_kernels_warm_up_beside_the_set_up_and_training_waits(monkeypatch, caplog, warm_up_fails,
                                                                     in_graph):  # fmt: skip
    """prepare_flash_in_background runs one forward and backward at the training's shapes on its thread
    (FA4 compiles each kernel at its first call); the first flash call of training waits for it. A warm-up
    that fails is logged, and training then calls the kernels itself. Backward runs on a thread of its
    own, as on CUDA: titanrush's operator's backward (in_graph) waits for the preparing thread, so the
    warm-up must not reach it through autograd (it did, and CUDA runs hung at their first step)."""
    import logging

    from titanrush.models.llama import attention as attn

    seen = _traced_fake_flash4(monkeypatch, warm_up_fails=warm_up_fails)
    _backward_on_a_device_thread(monkeypatch)
    # the warm-up on this thread (a child process's: test_flash_warm_up)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    dims = dict(batch=2, seq_len=16, n_heads=4, n_kv_heads=2, head_dim=8)
    # (the stand-in computes in fp32)
    shapes = attn.FlashShapes(torch.device("cpu"), **dims, in_graph=in_graph, dtype=torch.float32)
    logging.getLogger("titanrush").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="titanrush"):
            attn.prepare_flash_in_background(shapes)
            attn._PREPARING.join(timeout=20)
            assert not attn._PREPARING.is_alive(), "the warm-up did not finish"
            q = torch.randn(1, 8, 4, 8, requires_grad=True)
            k, v = torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
            out = attn.attention(q, k, v, backend="flash", n_rep=2, flash_in_graph=in_graph)
            out.sum().backward()
            assert q.grad is not None
    finally:
        _clear_flash_caches()
        torch._dynamo.reset()
        attn._PREPARING = None
    # titanrush's backward operator runs on the warm-up's own thread; the package's autograd function
    # (between graphs) on the device thread, as in training, where it does not wait
    warm_bwd_thread = "flash-attn prepare" if in_graph else "autograd device thread"
    warm = ((2, 16, 4, 8), (2, 16, 2, 8))
    main = ((1, 8, 4, 8), (1, 8, 2, 8))
    fwd_main, bwd_main = ("fwd", "MainThread", *main), ("bwd", "autograd device thread", *main)
    if warm_up_fails:
        assert seen == [("fwd", "flash-attn prepare", *warm), fwd_main, bwd_main]
        assert "warm-up failed (RuntimeError: no kernel for this GPU); step 1 compiles" in caplog.text
    else:
        warm_up = [("fwd", "flash-attn prepare", *warm), ("bwd", warm_bwd_thread, *warm)]
        assert seen == [*warm_up, fwd_main, bwd_main]
        assert "flash-attn-4's kernels compiled in" in caplog.text
    assert "flash-attn imported in" in caplog.text


def test_flex_forward_matches_sdpa_on_cpu_and_respects_documents():
    x = torch.randint(0, 8192, (2, 128))
    sdpa, flex = build(0, attn_backend="sdpa"), build(0, attn_backend="flex")
    with torch.no_grad():
        torch.testing.assert_close(flex(x), sdpa(x), rtol=1e-4, atol=1e-4)
        # Two documents: the second one's logits equal those of the document alone, with positions restarted.
        docs = torch.cat([torch.zeros(2, 50), torch.ones(2, 78)], dim=1).int()
        pos = torch.cat([torch.arange(50), torch.arange(78)]).expand(2, -1)
        both = flex(x, position_ids=pos, document_ids=docs)
        alone = sdpa(x[:, 50:])
        torch.testing.assert_close(both[:, 50:], alone, rtol=1e-4, atol=1e-4)


def test_chunked_loss_matches_plain_loss_and_gradients():
    x = torch.randint(0, 8192, (2, 64))
    labels = torch.randint(0, 8192, (2, 64))
    l1, g1 = loss_and_grads(build(0), x, labels)
    l2, g2 = loss_and_grads(build(0, loss_chunk_size=48), x, labels, chunked=True)  # uneven last chunk
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    assert_same_grads(g1, g2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cross_entropy_function_equals_f_cross_entropy(compiled):
    h = torch.randn(3, 10, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 10))
    labels[0, :4] = -100  # ignored tokens: no loss, no gradient, not in the mean's count
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten())
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = chunked_cross_entropy(h, w, labels, chunk_size=7, compiled=compiled)
    # compiled: the chunk math ran as dynamo graphs (full chunks and the shorter last one), not eager
    assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs) == compiled
    torch.testing.assert_close(got, ref)
    # An upstream gradient other than 1 (the trainer divides by the accumulation steps) scales both.
    gh, gw = torch.autograd.grad(got * 0.25, (h, w))
    rh, rw = torch.autograd.grad(ref * 0.25, (h, w))
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)
    assert gh[0, :4].abs().max() == 0  # the ignored tokens' hidden states get no gradient


def test_chunked_cross_entropy_under_autocast_matches_the_bf16_projection():
    """Under autocast the chunks run in bf16 like autocast's own matmul; the gradients come back in the
    inputs' dtypes (fp32 here), the weight's summed over chunks in fp32."""
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = (0.2 * torch.randn(300, 32)).requires_grad_()
    labels = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(h, w, labels, chunk_size=16)
        ref = cross_entropy((h @ w.t()).unsqueeze(0), labels.unsqueeze(0))
    gh, gw = torch.autograd.grad(got, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    for a, b in ((gh, rh), (gw, rw)):  # bf16 rounding of the logits' gradient, relative to the largest entry
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_chunked_cross_entropy_in_fp64_passes_gradcheck():
    h = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 10, 7, 1])
    assert torch.autograd.gradcheck(lambda a, b: chunked_cross_entropy(a, b, labels, chunk_size=4), (h, w))


def test_chunked_cross_entropy_rejects_negative_labels_other_than_ignore_index():
    with pytest.raises((RuntimeError, IndexError)):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, -1, 2, 3]), 2)


def test_chunked_cross_entropy_rejects_a_chunk_size_below_one():
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), 0)


def test_chunked_cross_entropy_keeps_the_weight_gradient_in_the_weight_dtype():
    """bf16 weights (FSDP's mixed precision): the fp32 sum over chunks is cast before it is saved for
    backward, so what waits for backward is half the size; the gradient equals cast-then-scale."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(40, 16, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(96, 16, generator=gen).bfloat16().requires_grad_()
    y = torch.randint(0, 96, (40,), generator=gen)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = chunked_cross_entropy(h, w, y, chunk_size=16)
    weight_shaped = [t for t in saved if t.shape == w.shape]
    assert [t.dtype for t in weight_shaped] == [torch.bfloat16]
    (loss * 0.5).backward()
    # fp32 reference of the same math: the fp32 sum of the chunks' products, cast, then scaled
    logits = h.detach().float() @ w.detach().float().t()
    g = (torch.softmax(logits, -1) - F.one_hot(y, 96).float()) / 40
    ref = (g.t() @ h.detach().float()).bfloat16() * 0.5
    torch.testing.assert_close(w.grad, ref, atol=2e-2, rtol=2e-2)
