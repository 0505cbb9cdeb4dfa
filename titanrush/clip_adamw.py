"""AdamW with the gradient clip folded in: one Triton kernel per parameter reads the gradient once.

Clipping by the global norm and then stepping torch's fused AdamW passes over the gradients three times:
the norm reads them, the clip reads and writes them (scaled), the optimizer reads them again. Here the
clip's factor, min(1, max_norm / (norm + 1e-6)), stays a one-element tensor on the device, and the
kernel multiplies each gradient element by it as it loads it: the clip's read-and-write pass is gone and
nothing waits on the host. The update is AdamW's (decoupled weight decay, bias-corrected moments), in
fp32, with the same state (`step`, `exp_avg`, `exp_avg_sq`) as `torch.optim.AdamW`, so checkpoints move
between the two. The gradients themselves are left unscaled.

It runs where every parameter (its local shard under FSDP or TP) is a plain, contiguous fp32 CUDA tensor
(not a tensor subclass such as float8's weights under FSDP's float8 all-gather) and Triton imports;
`unavailable` says why not, and `build_optimizer` then takes torch's fused AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

try:
    import triton
    import triton.language as tl
except ImportError:  # (CPU-only installs: torch's fused AdamW is used instead)
    triton = None

BLOCK = 1024  # elements per program: measured fastest of 1024-8192 on an H200 (4 warps)

if triton is not None:

    @triton.jit
    def _clip_adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        coef_ptr,
        n,
        decay,
        beta1,
        beta2,
        eps,
        step_size,
        bc2_sqrt,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0) * tl.load(coef_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0) * decay
        m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
        v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
        p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def unavailable(params: Iterable[torch.Tensor]) -> str | None:
    """Why `ClipAdamW` cannot step these parameters, or None where it can."""
    for p in params:
        why = _unfit(_local(p))
        if why is not None:
            return why
    return "Triton is not installed" if triton is None else None


def _unfit(t: torch.Tensor) -> str | None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):  # (the kernel writes through the data pointer)
        return f"a parameter is a {type(t).__name__} (a tensor subclass: float8's weights under FSDP)"
    if t.device.type != "cuda":
        return f"the parameters live on {t.device.type}, the kernel needs CUDA"
    if t.dtype != torch.float32:
        return f"a parameter is {t.dtype}, the kernel takes fp32"
    if not t.is_contiguous():
        return "a parameter's local tensor is not contiguous"
    return None


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor the clip scales every gradient by (`torch.nn.utils.clip_grads_with_norm_`'s), as a
    one-element fp32 tensor on the norm's device; 1 where max_norm is 0 (no clipping)."""
    if max_norm <= 0:
        return torch.ones(1, dtype=torch.float32, device=total_norm.device)
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0).reshape(1)


class ClipAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose step also applies the gradient clip (`set_clip`), in one kernel per
    parameter. Only AdamW's defaults for amsgrad, maximize and capturable are taken, and no GradScaler
    factor (titanrush trains in bf16 or fp32, never with fp16's loss scaling)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        # fused=True is only a flag here (this class steps itself): the groups it saves then tell torch's
        # AdamW, should a checkpoint of this one be loaded into it, to take its fused kernel.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self._coef: torch.Tensor | None = None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then each `step` back on the host (fused=True moved it to the device, where
        reading it for the bias corrections would wait on the device for every parameter)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "step" in state and state["step"].device.type != "cpu":
                state["step"] = state["step"].to("cpu", torch.float32)

    def set_clip(self, total_norm: torch.Tensor, max_norm: float) -> None:
        """Clip the next step's gradients by their global norm `total_norm` to at most `max_norm`."""
        self._coef = clip_coefficient(total_norm, max_norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter with a gradient, its gradient times the clip's factor
        (1 without `set_clip`: the factor applies to one step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coef, self._coef = self._coef, None
        for group in self.param_groups:
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # (AdamW's own state, as its for-loop kernel keeps it: the step on the host)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                k = float(state["step"])
                local = _local(p)
                if local.numel() == 0:  # (an FSDP rank whose shard of this parameter is empty)
                    continue
                if coef is None:
                    coef = torch.ones(1, dtype=torch.float32, device=local.device)
                grad = p.grad
                if isinstance(grad, DTensor) and grad.placements != p.placements:
                    # (a pending sum, e.g. a replicated norm weight's under sequence parallel: settled
                    # over its mesh, as DTensor's own dispatch of torch's AdamW does)
                    grad = grad.redistribute(grad.device_mesh, p.placements)
                grad = _local(grad)  # (laid out as the parameter by autograd; the kernel reads it flat)
                _clip_adamw_kernel[(triton.cdiv(local.numel(), BLOCK),)](
                    local,
                    grad if grad.is_contiguous() else grad.contiguous(),
                    _local(state["exp_avg"]),
                    _local(state["exp_avg_sq"]),
                    coef,
                    local.numel(),
                    1.0 - lr * group["weight_decay"],
                    beta1,
                    beta2,
                    group["eps"],
                    lr / (1.0 - beta1**k),
                    math.sqrt(1.0 - beta2**k),
                    BLOCK=BLOCK,
                    num_warps=4,
                )
        return loss
