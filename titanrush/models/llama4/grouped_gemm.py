"""The experts' matmuls: one grouped GEMM over all experts, or a loop over them with the same numbers.

Tokens arrive sorted by expert, `counts[e]` of them for expert e. A grouped GEMM multiplies each group of
rows by its expert's weight in one kernel launch, with the group boundaries read on the device (no host
sync, static shapes: compile-friendly). The kernel is PyTorch's public `torch.nn.functional.grouped_mm`
(torch >= 2.10); torch 2.9 has only the private `torch._grouped_mm`, used there behind the version check;
older versions, and inputs the kernel does not take (fp32 on CUDA or under compile, rows not 16-byte
aligned), run the loop: one matmul per expert, which needs the counts on the host.

`float8_grouped_mm` is the same product in float8 (`float8.experts`): torchao's rowwise-scaled grouped
GEMM, differentiable, from its MoE training prototype (`torchao.prototype.moe_training`). Its kernel
takes groups of whole 16-row tiles, so the rows are first spread into groups padded to multiples of 16
(`pad_groups`, static shapes: at most 16 x E rows more, no host sync) and the product read back from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

_GroupedMM = Callable[..., torch.Tensor]


def _version() -> tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def _find_kernel() -> _GroupedMM | None:
    public = getattr(F, "grouped_mm", None)
    if public is not None:
        return public
    if _version() >= (2, 9):  # the private op, before it became public (and CPU-capable from 2.9)
        return getattr(torch, "_grouped_mm", None)
    return None


KERNEL: _GroupedMM | None = _find_kernel()
# Kernels `kernel_in_use` put in place, innermost last (empty: KERNEL). A plain list rather than a
# ContextVar: torch.compile traces a list (and guards on it), not ContextVar.get.
_KERNELS_IN_USE: list[_GroupedMM] = []


@contextlib.contextmanager
def kernel_in_use(kernel: _GroupedMM) -> Iterator[None]:
    """Within the block, `grouped_mm` calls `kernel(x, w, offs=offsets)` in place of KERNEL, where KERNEL
    takes the inputs: the estimator's fake trace gives fp32 rows a shape-only product this way. For one
    thread at a time (the estimator's trace)."""
    _KERNELS_IN_USE.append(kernel)
    try:
        yield
    finally:
        _KERNELS_IN_USE.pop()


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the grouped kernel takes rows `x` (T, K) and weights `w` (E, K, N) as they are.

    The kernel wants 16-byte aligned rows. On CUDA it computes in bf16, and so does its compiled form
    everywhere (its shape function takes only bf16); fp32 there goes the loop. Eager on the CPU, any dtype.
    """
    if KERNEL is None:
        return False
    if x.dtype != torch.bfloat16 and (x.device.type == "cuda" or torch.compiler.is_compiling()):
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (x.shape[-1], w.shape[-1]))


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, grouped: bool = True
) -> torch.Tensor:
    """Rows of `x` (T, K), sorted by group, times their group's `w[e]` (E, K, N): (T, N).

    Args:
        x: The rows, group 0's first; T = counts.sum().
        w: One (K, N) weight per group.
        counts: Rows per group (E,), integer, on x's device.
        grouped: Use the grouped kernel where it takes these inputs; False always loops.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):  # autocast does not cover the grouped kernel: cast here
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
    elif x.dtype != w.dtype:
        x = x.to(w.dtype)
    if grouped and grouped_mm_supported(x, w):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        kernel = _KERNELS_IN_USE[-1] if _KERNELS_IN_USE else KERNEL
        return kernel(x, w, offs=offsets)
    return loop_mm(x, w, counts)


def loop_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The grouped product as one matmul per group (the reference the grouped kernel must match)."""
    if x.device.type == "meta":  # shape inference (a pipeline's): no sizes to read
        return x.new_empty(x.shape[0], w.shape[-1])
    sizes = counts.tolist()  # (a host sync: the loop needs the group sizes in Python)
    outs = [part @ w[e] for e, part in enumerate(torch.split(x, sizes, dim=0))]
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w.shape[-1])


ALIGN = 16  # rows per group the float8 grouped kernel takes (16-byte tiles of float8 rows)


def pad_groups(
    x: torch.Tensor, counts: torch.Tensor, align: int = ALIGN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by group, spread so that every group starts at a multiple of `align`.

    Returns:
        The padded rows (T + align x E rounded up to a multiple of align, K; padding rows are zero,
        rows past the last group unused), the padded groups' end offsets (E,) int32 (what a grouped
        kernel takes as `offs`), and each row's place in the padded rows (T,) (`padded[place]` gives x
        back).
    """
    n_rows, n_groups = x.shape[0], counts.shape[0]
    padded_counts = (counts + align - 1) // align * align
    ends = torch.cumsum(padded_counts, dim=0)
    shift = (ends - padded_counts) - (torch.cumsum(counts, dim=0) - counts)  # padded start - start
    group = torch.repeat_interleave(torch.arange(n_groups, device=x.device), counts, output_size=n_rows)
    place = torch.arange(n_rows, device=x.device) + shift[group]
    # Whole tiles in all (the weight gradient's kernel reads the rows transposed: its row stride is
    # this count, which must be 16-byte aligned too).
    total = (n_rows + align * n_groups + align - 1) // align * align
    padded = x.new_zeros(total, x.shape[1]).index_copy(0, place, x)
    return padded, ends.to(torch.int32), place


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` with float8 operands: rows and weights scaled per row (per output column of each
    expert's weight), bf16 out, gradients through torchao's float8 backward. CUDA, compute capability
    >= 9.0, K and N multiples of 16 (`titanrush.run.validate` checks what it can before the run)."""
    if x.device.type == "meta":  # shape inference (a pipeline's): no kernel to run
        return x.new_empty(x.shape[0], w.shape[-1], dtype=torch.bfloat16)
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    # The kernel reads each expert's weight column-major (strides K*N, 1, K): a transposing copy in bf16
    # (FSDP's gathered weights are bf16 already; one GPU's fp32 master weights are cast first).
    w_cols = w.to(torch.bfloat16).mT.contiguous().mT
    padded, ends, place = pad_groups(x.to(torch.bfloat16), counts)
    out = _to_fp8_rowwise_then_scaled_grouped_mm(
        padded, w_cols, ends, torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )
    return out[place]
