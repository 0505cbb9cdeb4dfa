"""Attention kernels behind one call: `attention(q, k, v, backend=..., n_rep=..., mask=...)`.

q is (B, T, H, D), k and v are (B, T, Hkv, D); the result is (B, T, H, D). Backends:
- sdpa: `scaled_dot_product_attention`, PyTorch picks the kernel (flash, cuDNN, efficient, math); the
  kernel reads each K/V head for its group of query heads (`enable_gqa`), so K and V are never copied
  n_rep times (except under context parallel, whose ring attention wants equal head counts).
- cudnn: SDPA restricted to the cuDNN kernel (K/V heads repeated first).
- flash: the flash-attn package (FA4 cute, FA3 hopper, or FA2 interface, whichever imports); FA4 as a
  custom operator that compiles inside the block and that selective checkpointing keeps.
- flex: FlexAttention with a block-causal mask over document boundaries (see `build_mask`).
- math: the unfused baseline: scores materialized, masked, softmaxed in fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from titanrush.models import flash_warm_up

logger = logging.getLogger("titanrush")

BACKENDS = ("sdpa", "cudnn", "flash", "flex", "math")


_GROUPED_KV = True  # sdpa: pass K/V with their own head count (enable_gqa); see expanded_kv


@contextlib.contextmanager
def expanded_kv() -> Iterator[None]:
    """Within the block, sdpa repeats K/V heads to the query head count before the kernel (context
    parallel's ring attention shards and rotates K/V assuming one K/V head per query head)."""
    global _GROUPED_KV
    before, _GROUPED_KV = _GROUPED_KV, False
    try:
        yield
    finally:
        _GROUPED_KV = before


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, Hkv, D) -> (B, T, Hkv * n_rep, D), each KV head shared by n_rep query heads."""
    if n_rep == 1:
        return x
    b, t, h, d = x.shape
    return x[:, :, :, None, :].expand(b, t, h, n_rep, d).reshape(b, t, h * n_rep, d)


@functools.cache
def flash_attn_func() -> Callable[..., Any]:
    """The newest flash-attn interface that imports (FA4, FA3, FA2).

    FA4 compiles its CuTe kernels at their first call (20+ s of an 8B run's first step); its disk cache of
    compiled kernels (`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`, read when it is imported) is turned on
    here unless the environment says otherwise, as inductor's cache is, so later runs load them.
    """
    flash_warm_up.enable_disk_cache()
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


FLASH_MODULES = ("flash_attn", "flash_attn_interface")  # FA4 and FA2 (flash_attn), FA3 (hopper build)


def flash_installed() -> bool:
    """Whether a flash-attn package is installed (found, not imported: FA4's import takes seconds)."""
    return any(importlib.util.find_spec(m) is not None for m in FLASH_MODULES)


@dataclasses.dataclass(frozen=True)
class FlashShapes:
    """One rank's attention inputs in training: q (batch, seq_len, n_heads, head_dim), k and v with
    n_kv_heads, causal, in `dtype` (flash-attn computes in bf16 or fp16); `in_graph` picks titanrush's
    operator or the package's own function."""

    device: torch.device
    batch: int
    seq_len: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    in_graph: bool
    dtype: torch.dtype = torch.bfloat16


_PREPARING: threading.Thread | None = None  # the side thread of prepare_flash_in_background


def prepare_flash_in_background(
    shapes: FlashShapes | None = None, started: flash_warm_up.WarmUpProcess | None = None
) -> threading.Thread:
    """Import the flash-attn package on a side thread, which a launch runs beside the mesh, model and data
    set-up (FA4's CuTe DSL takes seconds to import); with `shapes`, then have FA4's kernels compiled at
    the training's shapes. FA4 compiles each kernel at its first call, seconds apiece on a fresh machine,
    keyed by dtype, head dims and causality and chosen by launch heuristics that read the batch, length
    and heads: at these shapes they are the kernels of training, now compiled before step 1. With FA4's
    disk cache on (the default), a child process compiles them (`flash_warm_up`: the compile is Python
    that would hold this process's interpreter) and training loads them from the cache: the child
    `started` at launch, or one started here where that one compiled other shapes (or none was started);
    a child that fails is logged and step 1 compiles them. Without the disk cache this thread runs one
    forward and backward itself. The first flash call of training waits for this thread; an import that
    fails raises its ImportError there."""
    env = dict(os.environ)  # (for a child started on the thread: the environment as of now)

    def run() -> None:
        t0 = time.perf_counter()
        try:
            kernels = flash_kernels()
            logger.info(f"flash-attn imported in {time.perf_counter() - t0:.1f} s, beside the set-up")
        except ImportError:  # (raised again at training's first flash call)
            kernels = None
        if shapes is None or kernels is None:  # (FA3 and FA2 ship compiled kernels)
            if started is not None:
                started.kill()
            return
        t1 = time.perf_counter()
        if flash_warm_up.disk_cache_enabled():
            try:
                _warm_up_by_a_child(shapes, started, env)
            except Exception as e:  # noqa: BLE001 - training then compiles them at its first call
                logger.warning(f"flash-attn-4's warm-up process: {type(e).__name__}: {e}; step 1 compiles")
            return
        try:
            warm_up(shapes)
        except Exception as e:  # noqa: BLE001 - training then compiles them at its first call
            why = f"{type(e).__name__}: {e}"
            logger.warning(f"flash-attn-4's warm-up failed ({why}); step 1 compiles its kernels")
            return
        logger.info(f"flash-attn-4's kernels compiled in {time.perf_counter() - t1:.1f} s, beside the set-up")

    global _PREPARING
    _PREPARING = threading.Thread(target=run, name="flash-attn prepare", daemon=True)
    _PREPARING.start()
    return _PREPARING


def _warm_up_by_a_child(
    shapes: FlashShapes, started: flash_warm_up.WarmUpProcess | None, env: dict[str, str]
) -> None:
    """Wait for the child started at launch to compile the kernels at `shapes` into FA4's disk cache,
    or for one started now where none was or it compiled others; logs the outcome."""
    t0 = time.perf_counter()
    failure, compiled = started.wait() if started is not None else (None, None)
    if started is not None and failure is None:
        if compiled == shapes:
            done = f"{time.perf_counter() - t0:.1f} s after the import"
            logger.info(f"flash-attn-4's kernels compiled by a process started at launch ({done})")
            return
        # (the trainer's shapes are the ones that count)
        what = "no kernels" if compiled is None else f"the kernels of {compiled}"
        logger.warning(f"flash-attn-4's launch warm-up compiled {what}; training runs {shapes}")
        t0 = time.perf_counter()
    if failure is None:
        failure, _ = flash_warm_up.WarmUpProcess.at(shapes, env).wait()
    if failure is not None:
        logger.warning(f"flash-attn-4's warm-up process failed ({failure}); step 1 compiles its kernels")
        return
    took = time.perf_counter() - t0
    logger.info(f"flash-attn-4's kernels compiled in {took:.1f} s by a process beside the set-up")


def warm_up(s: FlashShapes) -> None:
    """One forward and backward of flash attention at `s`, as training calls it: FA4 compiles (or loads
    from its disk cache) the kernels of those shapes."""
    if s.device.type == "cuda":
        torch.cuda.set_device(s.device)  # (the current device is the thread's own)
    gen = torch.Generator(s.device).manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        shape = (s.batch, s.seq_len, heads, s.head_dim)
        return torch.randn(shape, generator=gen, device=s.device, dtype=s.dtype).requires_grad_()

    q, k, v = rand(s.n_heads), rand(s.n_kv_heads), rand(s.n_kv_heads)
    if s.in_graph and _fa4_available():
        # titanrush's two operators called directly, on this thread: through autograd, a CUDA backward
        # would run on the engine's device thread, whose wait for this thread would never end.
        with torch.no_grad():
            out, lse = flash_attn_op(q, k, v)
        flash_attn_backward_op(torch.randn(out.shape, generator=gen, device=s.device, dtype=out.dtype),
                               q, k, v, out, lse)  # fmt: skip
        return
    out = _flash_attention_eager(q, k, v)  # (the package's own backward does not wait for this thread)
    out.backward(torch.randn(out.shape, generator=gen, device=s.device, dtype=out.dtype))


def _wait_for_preparation() -> None:
    """Before a flash call of training: let the preparing thread finish (its kernels are this call's)."""
    thread = _PREPARING
    if thread is not None and thread is not threading.current_thread():
        thread.join()


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
    _wait_for_preparation()
    fwd, _ = _fa4()
    out, lse = fwd(q, k, v, causal=True, return_lse=True)[:2]
    return out, lse


@flash_attn_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, h, _ = q.shape
    return q.new_empty(b, t, h, v.shape[-1]), q.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op("titanrush::flash_attn_backward", mutates_args=())
def flash_attn_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """FA4's backward of `flash_attn_op`: (dq, dk, dv)."""
    _wait_for_preparation()
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


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, in_graph: bool) -> torch.Tensor:
    """The flash-attn package's causal attention: FA4 through `flash_attn_op` (or, not `in_graph`, as the
    package's own function between compiled graphs), FA3 and FA2 eagerly."""
    if in_graph and _fa4_available():
        return flash_attn_op(q, k, v)[0]
    return _flash_attention_eager(q, k, v)


@torch.compiler.disable
def _flash_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FA3's hopper build or FA2 (or FA4 with `model.flash_in_graph = false`), kept out of compiled graphs:
    autograd Functions that dynamo cannot trace and fake tensors cannot run, so the call runs eagerly
    between two compiled graphs of the block (one graph break per block: compile drops `fullgraph`, see
    `uses_graph_break`)."""
    _wait_for_preparation()
    out = flash_attn_func()(q, k, v, causal=True)
    return out[0] if isinstance(out, tuple) else out


def uses_graph_break(backend: str, flash_in_graph: bool = True) -> bool:
    """Whether a block with this attention backend must compile without `fullgraph` (FA3, FA2, or FA4
    called between graphs)."""
    return backend == "flash" and (not flash_in_graph or flash_kernels() is None)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # Flex attention is only fast compiled; on CPU the eager reference path is used.
    return torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention


def build_mask(backend: str, document_ids: torch.Tensor | None, seq_len: int, n_heads: int) -> Any:
    """Per-batch attention mask object: a flex BlockMask (block-causal per document) or None."""
    if backend != "flex":
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    if document_ids is None:

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx

        return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=_device_str())
    docs = document_ids

    def doc_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return create_block_mask(doc_mask_mod, docs.shape[0], None, seq_len, seq_len, device=str(docs.device))


def _device_str() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str,
    n_rep: int,
    mask: Any = None,
    flash_in_graph: bool = True,
):
    """Causal attention of q (B, T, H, D) over k, v (B, T, Hkv, D) -> (B, T, H, D)."""
    if backend == "flash":
        return _flash_attention(q, k, v, flash_in_graph)
    if backend == "flex":
        out = _compiled_flex()(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=n_rep > 1
        )
        return out.transpose(1, 2)
    if backend == "sdpa" and _GROUPED_KV:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1).transpose(1, 2)
    q, k, v = q.transpose(1, 2), repeat_kv(k, n_rep).transpose(1, 2), repeat_kv(v, n_rep).transpose(1, 2)
    if backend == "math":
        out = _math_attention(q, k, v)
    elif backend == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif backend == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return out.transpose(1, 2)


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unfused causal attention on (B, H, T, D): the full (T, T) score matrix is materialized."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(dim=-1).to(v.dtype)) @ v
