"""The experts' matmuls: one grouped GEMM over all experts, or a loop over them with the same numbers.

Tokens arrive sorted by expert, `counts[e]` of them for expert e. A grouped GEMM multiplies each group of
rows by its expert's weight in one kernel launch, with the group boundaries read on the device (no host
sync, static shapes: compile-friendly). The kernel is PyTorch's public `torch.nn.functional.grouped_mm`
(torch >= 2.10); torch 2.9 has only the private `torch._grouped_mm`, used there behind the version check;
older versions, and inputs the kernel does not take (fp32 on CUDA or under compile, rows not 16-byte
aligned), run the loop: one matmul per expert, which needs the counts on the host.
"""

from __future__ import annotations

from collections.abc import Callable

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
        return KERNEL(x, w, offs=offsets)
    return loop_mm(x, w, counts)


def loop_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The grouped product as one matmul per group (the reference the grouped kernel must match)."""
    if x.device.type == "meta":  # shape inference (a pipeline's): no sizes to read
        return x.new_empty(x.shape[0], w.shape[-1])
    sizes = counts.tolist()  # (a host sync: the loop needs the group sizes in Python)
    outs = [part @ w[e] for e, part in enumerate(torch.split(x, sizes, dim=0))]
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w.shape[-1])
