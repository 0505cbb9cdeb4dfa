"""The native Llama: parameter counts, RoPE, attention, initialization, losses."""

from __future__ import annotations

import math
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titanrush.models.llama import FLAVORS, Llama, model_args
from titanrush.models.llama.loss import chunked_cross_entropy, cross_entropy
from titanrush.models.llama.model import (
    TransformerBlock,
    apply_rope,
    rope_cache,
    rope_frequencies,
    to_matmul_dtype,
)


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


def test_rope_table_is_fp32_cos_sin_of_the_complex_rotation_and_not_checkpointed():
    args = model_args("debug", rope_scaling=True, rope_original_max_len=64)
    table = rope_cache(args, 96)
    assert table.dtype == torch.float32 and table.shape == (96, args.head_dim // 2, 2)
    # Bit for bit the complex table it replaces, exp(i * position * frequency), as (real, imaginary).
    angles = torch.outer(torch.arange(96, dtype=torch.float32), rope_frequencies(args))
    assert torch.equal(table, torch.view_as_real(torch.polar(torch.ones_like(angles), angles)))
    with torch.device("meta"):
        model = Llama(args)
    assert "rope" not in model.state_dict() and model.rope.dtype == torch.float32


def _rope_complex_numbers(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The reference: each consecutive pair as a complex number times exp(i * angle), in float64."""
    xc = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    rot = torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())
    rot = rot[None, :, None] if rot.dim() == 2 else rot[:, :, None]
    return torch.view_as_real(xc * rot).flatten(-2)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["table", "position_ids"])
def test_rope_eager_and_compiled_paths_rotate_alike(per_sequence):
    # The eager path multiplies complex views; under compile the same rotation runs in real numbers.
    # Both must give the reference rotation, forward and backward, in bf16 and fp32.
    args = model_args("debug")
    table = rope_cache(args, 32)
    pos = torch.tensor([[5, 6, 7, 0], [1, 2, 3, 4]]) if per_sequence else torch.arange(4)
    rope = table[pos] if per_sequence else table[:4]
    angles = torch.outer(torch.arange(32, dtype=torch.float32), rope_frequencies(args))[pos]
    compiled = torch.compile(apply_rope, backend="eager", fullgraph=True)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(2, 4, 3, args.head_dim).to(dtype)
        want = _rope_complex_numbers(x, angles)
        outs, grads = [], []
        for fn in (apply_rope, compiled):
            xg = x.clone().requires_grad_(True)
            out = fn(xg, rope)
            out.float().square().sum().backward()
            assert out.dtype == dtype
            outs.append(out)
            grads.append(xg.grad)
        for out in outs:
            torch.testing.assert_close(out.double(), want.to(out.dtype).double(), atol=tol, rtol=tol)
        torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
        torch.testing.assert_close(grads[0], grads[1], atol=tol, rtol=tol)


def _block_and_input(batch: int = 3) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small block, its input (batch, 16, 64) and the model's whole RoPE table (64 positions): the
    sequence, the table's size and every width are powers of two, and the batch is 3, so a saved tensor
    with the batch in it has a multiple of 3 elements and a copy of (part of) the table does not."""
    args = model_args("debug", dim=64, n_heads=4, n_kv_heads=2, vocab_size=128)
    torch.manual_seed(0)
    block = TransformerBlock(0, args)
    return block, torch.randn(batch, 16, args.dim, requires_grad=True), rope_cache(args, 64)


def test_compiled_block_graphs_hold_no_complex_tensor():
    """Forward and backward graphs of a compiled block, as AOTAutograd hands them to the compiler: no
    input, output or intermediate is complex (inductor cannot generate code for complex operators)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    dtypes: list[torch.dtype] = []

    def inspect(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in gm.graph.nodes:
            vals = node.meta.get("val")
            for v in vals if isinstance(vals, (list, tuple)) else [vals]:
                if isinstance(v, torch.Tensor):
                    dtypes.append(v.dtype)
        return make_boxed_func(gm.forward)

    block, x, table = _block_and_input()
    compiled = torch.compile(
        block, backend=aot_autograd(fw_compiler=inspect, bw_compiler=inspect), fullgraph=True
    )
    compiled(x, table).sum().backward()
    assert torch.float32 in dtypes  # the graphs were seen (forward and backward)
    assert not [d for d in dtypes if d.is_complex]
    # The eager block, by contrast, multiplies complex views (one kernel instead of six).
    seen: list[torch.dtype] = []

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(
                t.dtype
                for t in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(t, torch.Tensor)
            )
            return out

    with Dtypes():
        block(x, table)
    assert any(d.is_complex for d in seen)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on CPU needs a C++ compiler"
)
def test_inductor_compiles_the_block_without_the_complex_operator_warning():
    block, x, table = _block_and_input()
    want = block(x, table)
    want.sum().backward()
    want_grad, x.grad = x.grad, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(block, backend="inductor", fullgraph=True)(x, table)
        out.sum().backward()
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "complex" in m], messages
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, want_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_block_keeps_no_copy_of_the_rope_table_for_backward(compiled):
    """What a block saves for backward: the table itself (the model's one fp32 buffer) or its slice, never
    a copy of it. With inductor's partitioner (no-op compilers, so on CPU) as in a compiled run."""
    block, x, table = _block_and_input()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    fn = torch.compile(block, backend="aot_eager_decomp_partition", fullgraph=True) if compiled else block
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params and t.numel() > 1:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, table).sum().backward()
    table_ptr = table.untyped_storage().data_ptr()
    shares = [t for t in saved if t.untyped_storage().data_ptr() == table_ptr]
    copies = [tuple(t.shape) for t in saved if t.untyped_storage().data_ptr() != table_ptr and t.numel() % 3]
    assert shares  # the rotation's backward reads the table where it is
    assert not copies, f"saved tensors without the batch dimension (copies of the table?): {copies}"


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
    from titanrush.models.llama import flash as attn

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

    from titanrush.models.llama import flash as attn

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

    from titanrush import config
    from titanrush.models.llama.parallelize import parallelize_llama
    from titanrush.run.plan import build_plan

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
        cfg = config.load(None, ["--model.attn_backend", "flash", "--compile.enable"])
        plan = build_plan(cfg, 1, machine=False)  # (the stand-in package has no import spec to find)
        assert plan.compile.enable and not plan.compile.fullgraph  # flash-attn runs between graphs
        parallelize_llama(compiled, None, plan.parallelize_plan)
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
    from titanrush.models.llama import flash as attn
    from titanrush.models.llama.parallelize import parallelize_llama
    from titanrush.parallel.activation_checkpoint import ACPlan
    from titanrush.parallel.compile import CompilePlan
    from titanrush.run.plan import RunPlan

    calls = {"fwd": 0, "bwd": 0}
    _use_fake_flash4(monkeypatch, calls)
    x = torch.randint(0, 8192, (2, 64))
    labels = torch.randint(0, 8192, (2, 64))
    try:
        l1, g1 = loss_and_grads(build(0, attn_backend="sdpa"), x, labels)
        for compiled in (False, True):
            model = build(0, attn_backend="flash")
            assert not attn.uses_graph_break("flash")
            plan = RunPlan(
                args=model.args,
                local_batch=2,
                seq_len=64,
                compile=CompilePlan(enable=compiled),
                ac=ACPlan(mode="selective"),
            )
            parallelize_llama(model, None, plan.parallelize_plan)
            loss_and_grads(model, x, labels)  # (the compiled model's first step compiles)
            calls.update(fwd=0, bwd=0)
            l2, g2 = loss_and_grads(model, x, labels)
            n = len(model.layers)
            assert calls == {"fwd": n, "bwd": n}, (compiled, calls)
            torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
            assert_same_grads(
                g1,
                {
                    k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): g
                    for k, g in g2.items()
                },
            )
    finally:
        _clear_flash_caches()
        torch._dynamo.reset()


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


def test_block_under_autocast_casts_each_norm_output_once():
    """Under autocast a block hands its linears the norms' outputs already in bf16 (one cast each, before
    sequence parallel's all-gather): the linears see what they would have cast themselves, so the block's
    output is the one of feeding them the fp32 norms; without autocast nothing is cast."""
    torch.manual_seed(0)
    args = model_args("debug")
    block, rope, x = TransformerBlock(0, args), rope_cache(args, 16), torch.randn(2, 16, args.dim)
    seen: list[torch.dtype] = []
    for part in (block.attention, block.feed_forward):
        part.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x, rope)
        assert seen == [torch.bfloat16, torch.bfloat16]  # (the hooks also see the reference's fp32 below)
        h = x + block.attention(block.attention_norm(x), rope)
        ref = h + block.feed_forward(block.ffn_norm(h))
        assert to_matmul_dtype(block.attention_norm(x)).dtype == torch.bfloat16
    assert torch.equal(out, ref)
    assert to_matmul_dtype(x) is x
