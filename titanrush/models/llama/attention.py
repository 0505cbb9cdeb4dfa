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

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("sdpa", "cudnn", "flash", "flex", "math")


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, Hkv, D) -> (B, T, Hkv * n_rep, D), each KV head shared by n_rep query heads."""
    if n_rep == 1:
        return x
    b, t, h, d = x.shape
    return x[:, :, :, None, :].expand(b, t, h, n_rep, d).reshape(b, t, h * n_rep, d)


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
    expand_kv: bool = False,
) -> torch.Tensor:
    """Causal attention of q (B, T, H, D) over k, v (B, T, Hkv, D) -> (B, T, H, D).

    `expand_kv`: sdpa repeats the K/V heads to the query head count before the kernel (fp32 context
    parallel: the ring's memory-efficient kernel takes no grouped K/V heads).
    """
    if backend == "flash":
        from titanrush.models.llama import flash  # (its operators registered on first use)

        return flash.flash_attention(q, k, v)
    if backend == "flex":
        out = _compiled_flex()(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=n_rep > 1
        )
        return out.transpose(1, 2)
    if backend == "sdpa" and not expand_kv:
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
