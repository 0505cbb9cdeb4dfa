"""Float8 training of the linear layers through torchao.

Applied to the meta-device model before any other parallelism, so that TP plans and FSDP see the
Float8Linear modules (and FSDP can all-gather their weights in float8 with precomputed scales).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanrush.config import ConfigError

logger = logging.getLogger("titanrush")


def float8_supported() -> bool:
    """Float8 tensor cores exist from compute capability 8.9 (Ada, Hopper and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _skip_reason(module: nn.Module, fqn: str, filter_fqns: list[str], min_size: int) -> str | None:
    """Why this linear stays in bf16, or None if it is converted."""
    if any(f and f in fqn for f in filter_fqns):
        return "filtered by name"
    # float8 GEMMs need both dimensions divisible by 16; small layers lose more to casting than they gain.
    out_f, in_f = module.weight.shape
    if in_f % 16 or out_f % 16:
        return f"shape {tuple(module.weight.shape)} not divisible by 16"
    if in_f < min_size or out_f < min_size:
        return f"too small ({tuple(module.weight.shape)}) to gain from float8"
    return None


def apply_float8(
    model: nn.Module,
    *,
    recipe: str,
    emulate: bool,
    fsdp_float8_all_gather: bool,
    filter_fqns: list[str],
    min_size: int,
) -> list[str]:
    """Swap eligible nn.Linear layers for torchao's Float8Linear in place; return the converted names.

    Raises:
        ConfigError: torchao is missing, or neither the GPU supports float8 nor emulation is on.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(
            "float8.enable needs torchao (pip install torchao); or set float8.enable = false"
        ) from e
    if not emulate and not float8_supported():
        where = "on CPU" if not torch.cuda.is_available() else f"on {torch.cuda.get_device_name()}"
        raise ConfigError(
            f"float8 training needs a GPU with float8 tensor cores (compute capability >= 8.9), not {where}; "
            "set float8.emulate = true to emulate it (slow, for tests) or float8.enable = false"
        )
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    converted: list[str] = []
    skipped: dict[str, str] = {}

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        reason = _skip_reason(module, fqn, filter_fqns, min_size)
        if reason is None:
            converted.append(fqn)
            return True
        skipped[fqn] = reason
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    reasons = ", ".join(sorted(set(skipped.values())))
    logger.info(
        f"float8 ({recipe}{', emulated' if emulate else ''}): {len(converted)} linear layers converted, "
        f"{len(skipped)} kept in bf16 ({reasons})"
    )
    return converted


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step: compute every float8 weight scale in one pass (FSDP float8 all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def float8_scales_over(group: Any) -> Callable[[nn.Module], torch.Tensor | None]:
    """torchao's precompute of FSDP's float8 weight scales, with its all-reduce on `group`, a process group
    of its own (same ranks as FSDP's 1-D mesh), so that it can run beside FSDP's collectives instead of
    queued behind them on FSDP's communicator.

    The arithmetic of `precompute_float8_dynamic_scale_for_fsdp` for fp32 master weights (torchao's
    extra clamp applies to fp16 ones): each weight's amax over its shards (a max all-reduce), at least
    EPS, then the float8 maximum over it in float64, kept in float32. Returns the module's local scale
    tensor (None without float8 weights), which the caller may mark as used by other streams.
    """
    import torch.distributed as dist
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import EPS
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    @torch.no_grad()
    def scales(module: nn.Module) -> torch.Tensor | None:
        linears = [
            m for m in module.modules()
            if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
            and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        ]  # fmt: skip
        if not linears:
            return None
        (dtype,) = {m.config.cast_config_weight.target_dtype for m in linears}
        shards = [m.weight._local_tensor._tensor for m in linears]
        amax = torch.stack(torch._foreach_norm(shards, ord=math.inf))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = (torch.finfo(dtype).max / torch.clamp(amax, EPS).to(torch.float64)).to(torch.float32)
        for i, m in enumerate(linears):
            m.weight._local_tensor._precomputed_scale = scale[i]
        return scale

    return scales
