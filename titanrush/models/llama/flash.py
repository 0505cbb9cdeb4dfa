"""The flash-attn package's causal attention (`model.attn_backend = "flash"`): FA4 (cute) as a custom
operator that compiles inside the block and that selective checkpointing keeps, FA3 (hopper) or FA2
eagerly between two compiled graphs. Imported on the first flash call, so that a run on another backend
never imports the compiler for it."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def flash_attn_func() -> Callable[..., Any]:
    """The newest flash-attn interface that imports (FA4, FA3, FA2).

    FA4 compiles its CuTe kernels at their first call (20+ s of an 8B run's first step); its disk cache of
    compiled kernels (`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`, read when it is imported) is turned on
    here unless the environment says otherwise, as inductor's cache is, so later runs load them.
    """
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    for module, name in (("flash_attn.cute", "flash_attn_func"), ("flash_attn_interface", "flash_attn_func")):
        try:
            mod = __import__(module, fromlist=[name])
            return getattr(mod, name)
        except (ImportError, AttributeError, OSError):
            continue
    try:
        from flash_attn import flash_attn_func as fa2
    except ImportError as e:
        raise ImportError(
            "model.attn_backend = 'flash' needs the flash-attn package (pip install flash-attn, or the "
            "flash-attn-4 / FA3 hopper build); use attn_backend = 'sdpa' or 'cudnn' without it"
        ) from e
    return fa2


@functools.cache
def flash_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """FA4's forward and backward functions (`flash_attn.cute.interface`), or None where the flash-attn
    package that imports is FA3's or FA2's."""
    flash_attn_func()  # the kernel cache's variable first; the clear error where nothing imports
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except (ImportError, AttributeError, OSError):
        return None
    return _flash_attn_fwd, _flash_attn_bwd


@torch.compiler.assume_constant_result
def _fa4_available() -> bool:
    """Whether FA4 runs the flash backend (compiled code takes the answer as a constant of the graph)."""
    return flash_kernels() is not None


def _fa4() -> tuple[Callable[..., Any], Callable[..., Any]]:
    kernels = flash_kernels()
    if kernels is None:
        raise RuntimeError(
            "titanrush::flash_attn needs flash-attn-4 (flash_attn.cute.interface), which does not import; "
            "use model.attn_backend = 'cudnn' or 'sdpa'"
        )
    return kernels


# FA4 as one opaque operator (torch.library): dynamo and inductor place it in the compiled block's graph
# from its shapes (`register_fake`), so the block compiles whole, and selective checkpointing sees it as
# one op whose outputs it keeps (`activation_checkpoint`), as it keeps SDPA's.
@torch.library.custom_op("titanrush::flash_attn", mutates_args=())
def flash_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (B, T, H, D) over k, v (B, T, Hkv, D) by FA4: (out, logsumexp (B, H, T))."""
    fwd, _ = _fa4()
    out, lse = fwd(q, k, v, causal=True, return_lse=True)[:2]
    return out, lse


@flash_attn_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, h, _ = q.shape
    return q.new_empty(b, t, h, v.shape[-1]), q.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op("titanrush::flash_attn_backward", mutates_args=())
def flash_attn_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's backward of `flash_attn_op`: (dq, dk, dv)."""
    _, bwd = _fa4()
    dq, dk, dv = bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=True)[:3]
    return dq, dk, dv


@flash_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs, *output)


def _flash_backward(ctx: Any, dout: torch.Tensor, dlse: Any) -> tuple[torch.Tensor, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    return flash_attn_backward_op(dout.contiguous(), q, k, v, out, lse)


flash_attn_op.register_autograd(_flash_backward, setup_context=_flash_setup)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The flash-attn package's causal attention: FA4 through `flash_attn_op`, FA3 and FA2 eagerly."""
    if _fa4_available():
        return flash_attn_op(q, k, v)[0]
    return _flash_attention_eager(q, k, v)


@torch.compiler.disable
def _flash_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FA3's hopper build or FA2, kept out of compiled graphs:
    autograd Functions that dynamo cannot trace and fake tensors cannot run, so the call runs eagerly
    between two compiled graphs of the block (one graph break per block: compile drops `fullgraph`, see
    `uses_graph_break`)."""
    out = flash_attn_func()(q, k, v, causal=True)
    return out[0] if isinstance(out, tuple) else out


def uses_graph_break(backend: str) -> bool:
    """Whether a block with this attention backend must compile without `fullgraph` (FA3, FA2)."""
    return backend == "flash" and flash_kernels() is None
