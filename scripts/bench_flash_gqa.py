"""Causal attention at the 8B's shapes on one GPU: flash-attn-4 with grouped K/V heads against the same
kernels on K/V repeated to the query heads, and cuDNN's SDPA; forward and forward + backward.

FA4's backward on grouped heads adds every query head's dK/dV into fp32 buffers with atomics, then
converts them in a second kernel; on repeated K/V each head writes its own dK/dV and autograd sums the
group (one reduction). Which is faster is measured here, with the gradients of each method checked
against the grouped run's.

Usage: python scripts/bench_flash_gqa.py [--batch 2 --seq 8192 --heads 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_copy_in import time_ms as _timed  # noqa: E402  (CUDA events around the calls)

from titanrush.models.llama.attention import flash_attn_func, flash_kernels  # noqa: E402


class _GroupedFwdRepeatedBwd(torch.autograd.Function):
    """FA4's forward on grouped K/V, its backward on K/V repeated to the query heads (dK/dV summed)."""

    @staticmethod
    def forward(ctx, q, k, v, n_rep):  # noqa: ANN001, ANN205
        fwd, _ = flash_kernels()
        out, lse = fwd(q, k, v, causal=True, return_lse=True)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.n_rep = n_rep
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        _, bwd = flash_kernels()
        q, k, v, out, lse = ctx.saved_tensors
        b, t, h, d = k.shape
        r = ctx.n_rep
        kr, vr = (x[:, :, :, None, :].expand(b, t, h, r, d).reshape(b, t, h * r, d) for x in (k, v))
        dq, dk, dv = bwd(q, kr, vr, out, dout.contiguous(), lse, softmax_scale=None, causal=True)[:3]
        return dq, dk.view(b, t, h, r, d).sum(3), dv.view(b, t, h, r, d).sum(3), None


def methods(n_rep: int) -> dict[str, Callable[..., torch.Tensor]]:
    fa = flash_attn_func()

    def first(out: object) -> torch.Tensor:
        return out[0] if isinstance(out, tuple) else out

    def repeated(k: torch.Tensor) -> torch.Tensor:  # (B, T, Hkv, D) -> (B, T, Hkv * n_rep, D), autograd sums
        b, t, h, d = k.shape
        return k[:, :, :, None, :].expand(b, t, h, n_rep, d).reshape(b, t, h * n_rep, d)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        return out.transpose(1, 2)

    return {
        "fa4 grouped K/V": lambda q, k, v: first(fa(q, k, v, causal=True)),
        "fa4 grouped forward, repeated backward": lambda q, k, v: _GroupedFwdRepeatedBwd.apply(
            q, k, v, n_rep
        ),
        "fa4 repeated K/V": lambda q, k, v: first(fa(q, repeated(k), repeated(v), causal=True)),
        "cudnn sdpa grouped": sdpa,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shape_q = (a.batch, a.seq, a.heads, a.head_dim)
    shape_kv = (a.batch, a.seq, a.kv_heads, a.head_dim)
    q, k, v = (torch.randn(s, device=dev, dtype=torch.bfloat16) for s in (shape_q, shape_kv, shape_kv))
    dout = torch.randn(shape_q, device=dev, dtype=torch.bfloat16)
    # causal: half the score matrix; 2 matmuls forward, 5 backward (2.5x forward)
    fwd_flops = 4 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; q {tuple(shape_q)}, "
        f"k/v {tuple(shape_kv)}, bf16, causal"
    )
    print(
        "\n| method | forward ms | forward TFLOP/s | forward + backward ms | backward TFLOP/s "
        "| grads vs grouped |"
    )
    print("|---|---:|---:|---:|---:|---|")
    ref = None
    for name, fn in methods(a.heads // a.kv_heads).items():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            with torch.no_grad():
                t_fwd = _timed(lambda fn=fn, lv=leaves: fn(*lv), a.iters)

            def step(fn=fn, lv=leaves) -> None:
                for t in lv:
                    t.grad = None
                fn(*lv).backward(dout)

            t_all = _timed(step, a.iters)
        except Exception as e:  # noqa: BLE001 - a method this machine cannot run is reported, not fatal
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | | |")
            continue
        grads = [t.grad.float() for t in leaves]
        if ref is None:
            ref, check = grads, "reference"
        else:
            errs = [(g - r).abs().max().item() / r.abs().max().item() for g, r in zip(grads, ref)]
            check = "max rel err dq {:.1e} dk {:.1e} dv {:.1e}".format(*errs)
        bwd_ms = t_all - t_fwd
        print(
            f"| {name} | {t_fwd:.2f} | {fwd_flops / t_fwd / 1e9:.0f} | {t_all:.2f} | "
            f"{2.5 * fwd_flops / bwd_ms / 1e9:.0f} | {check} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
