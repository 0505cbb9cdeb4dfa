"""Float8 training of the linear layers through torchao.

Applied to the meta-device model before any other parallelism, so that TP plans and FSDP see the
Float8Linear modules (and FSDP can all-gather their weights in float8 with precomputed scales).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger("titanrush")


def float8_supported() -> bool:
    """Float8 tensor cores exist from compute capability 8.9 (Ada, Hopper and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@dataclass(frozen=True)
class Float8Plan:
    """Float8 training of the run ([float8], resolved by `titanrush.run.plan.build_plan`)."""

    enable: bool = False
    recipe: str = "tensorwise"  # torchao's scaling recipe: tensorwise or rowwise
    emulate: bool = False  # float8 arithmetic emulated in higher precision (no float8 tensor cores needed)
    all_gather: bool = False  # in effect: FSDP all-gathers float8 weights (tensorwise under FSDP only)
    filter_fqns: tuple[str, ...] = ("output",)  # linears whose name contains one of these stay in bf16
    min_size: int = 1024  # linears with a dimension below this stay in bf16
    experts: bool = False  # Llama 4: the routed experts' grouped GEMMs in float8 (rowwise)

    @property
    def tp_styles(self) -> bool:
        """torchao's float8 TP styles (cast before the all-gather) exist for tensorwise scaling only."""
        return self.enable and self.recipe == "tensorwise"

    def skip_reason(self, fqn: str, shape: tuple[int, ...]) -> str | None:
        """Why the linear `fqn` of weight `shape` (out, in) stays in bf16, or None if float8 converts it.

        The one rule for which linears are float8: the trainer converts by it and the memory estimator
        counts by it.
        """
        if any(f and f in fqn for f in self.filter_fqns):
            return "filtered by name"
        # float8 GEMMs need both dimensions divisible by 16; small layers lose more to casting than they gain.
        out_f, in_f = shape
        if in_f % 16 or out_f % 16:
            return f"shape {tuple(shape)} not divisible by 16"
        if in_f < self.min_size or out_f < self.min_size:
            return f"too small ({tuple(shape)}) to gain from float8"
        return None


def apply_float8(model: nn.Module, plan: Float8Plan) -> list[str]:
    """Swap eligible nn.Linear layers (`Float8Plan.skip_reason`) for torchao's Float8Linear in place;
    return the converted names.

    torchao must import and the GPU support float8 (or `plan.emulate` be on): `titanrush.run.validate`
    checks both before anything is built.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if plan.recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=plan.all_gather, emulate=plan.emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(plan.recipe), emulate=plan.emulate)
    converted: list[str] = []
    skipped: dict[str, str] = {}

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        reason = plan.skip_reason(fqn, tuple(module.weight.shape))
        if reason is None:
            converted.append(fqn)
            return True
        skipped[fqn] = reason
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    reasons = ", ".join(sorted(set(skipped.values())))
    logger.info(
        f"float8 ({plan.recipe}{', emulated' if plan.emulate else ''}): {len(converted)} linear layers "
        f"converted, {len(skipped)} kept in bf16 ({reasons})"
    )
    return converted


def apply_float8_experts(experts: list[nn.Module]) -> None:
    """Run the routed experts' two grouped GEMMs in float8 (rowwise scales; `float8_grouped_mm`).

    The weights stay as they are (plain or DTensor parameters in their own dtype): each forward casts
    them for the float8 kernel, so FSDP, expert parallel and checkpoints see nothing new.
    """
    for module in experts:
        module.float8 = True
    if experts:
        logger.info(f"float8 experts: the routed experts of {len(experts)} MoE layers (rowwise scales)")


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step: compute every float8 weight scale in one pass (FSDP float8 all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
