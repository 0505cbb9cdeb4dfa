"""Non-finite steps: one check per step; the run stopped or the step's update skipped.

The witness is the global gradient norm, which `clip_grad_norm_` has already all-reduced over every
shard and pipeline stage, so it is the same value on every rank and every rank takes the same decision
without a collective of its own. A non-finite loss is folded into it: `poison` multiplies the loss by
`loss * 0 + 1` (1, or NaN when the loss is NaN or infinite), so a non-finite loss on any rank makes that
rank's gradients, and with them the global norm, non-finite everywhere. (A NaN in the weights or the
activations reaches the gradients anyway; the factor covers the corner where a loss overflows while its
gradient stays finite.)

What it costs (`training.on_nonfinite`):
- `stop` (default): no host sync of its own. The flag of step k is read on the host while step k+1 is
  already queued (when step k+1 asks whether to step its optimizer), and at once before anything reads
  or writes the weights (logging, validation, a checkpoint, the end of the run). Step k's update has
  been applied by then, which is harmless: the run stops and nothing of it is saved.
- `skip`: the optimizer step of step k must not run with non-finite gradients, so the flag is read
  before it: one host sync per step (the host waits for the gradient norm before queueing the
  optimizer step). On CPU, where nothing runs ahead of the host, the check and its read cost about
  7 microseconds a step (docs/operations.md has the command).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from titanrush.config import MoE

logger = logging.getLogger("titanrush")


class NonFiniteError(RuntimeError):
    """The run stopped on a non-finite step; the message names the step and what was not finite."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


def poison(loss: torch.Tensor) -> torch.Tensor:
    """`loss` itself, but with gradients that are NaN where the loss is not finite (see the module doc)."""
    return loss * (loss.detach() * 0 + 1)


@dataclass
class _Pending:
    """A step whose flag the host has not read yet."""

    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor


class NonFiniteGuard:
    """Decides, per step, whether the optimizer steps, and stops the run on a non-finite step.

    Args:
        mode: `stop` or `skip` (training.on_nonfinite).
        max_skips: With `skip`, the most steps in a row that may be skipped (training.max_skips).
        suspects: Settings of this run that may make the loss overflow besides the learning rate, as
            `key = value` (the MoE loss coefficients raised above their defaults): the message names them.
    """

    def __init__(self, mode: str, max_skips: int, suspects: tuple[str, ...] = ()) -> None:
        self.mode = mode
        self.max_skips = max_skips
        self.fix = "a lower optimizer.lr (or training.max_norm)"
        if suspects:
            self.fix += f", or lower {', '.join(suspects)}"
        self.in_a_row = 0
        self.skipped = 0  # skipped steps since the caller last reset it (the logging window)
        self._pending: _Pending | None = None

    def should_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Called between the gradient norm and the optimizer step of `step`: whether to apply the update.

        Raises:
            NonFiniteError: `stop`: the previous step was not finite; `skip`: more than max_skips in a row.
        """
        if self.mode == "stop":
            self.settle()  # the previous step's flag: that step is done on the device by now
            self._pending = _Pending(step, loss.detach(), grad_norm.detach())
            return True
        if bool(torch.isfinite(grad_norm)):  # the one host read per step of `skip`
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        what = _describe(loss, grad_norm)
        if self.in_a_row > self.max_skips:
            raise NonFiniteError(
                step,
                f"step {step}: {what}: {self.in_a_row} non-finite steps in a row, beyond "
                f"training.max_skips = {self.max_skips}; resume from the newest checkpoint with {self.fix}",
            )
        logger.warning(
            f"step {step}: {what}: update skipped ({self.in_a_row} in a row, training.on_nonfinite = skip)"
        )
        return False

    def settle(self) -> None:
        """Read the flag of the step not yet checked (a host sync); call before the weights are read.

        Raises:
            NonFiniteError: That step was not finite (mode `stop`).
        """
        p, self._pending = self._pending, None
        if p is None or bool(torch.isfinite(p.grad_norm)):
            return
        raise NonFiniteError(
            p.step,
            f"step {p.step}: {_describe(p.loss, p.grad_norm)} (training.on_nonfinite = stop): stopped before "
            f"saving anything of step {p.step}; resume from the newest checkpoint with {self.fix}; or set "
            "training.on_nonfinite = skip to skip such steps",
        )


def moe_suspects(moe: MoE) -> tuple[str, ...]:
    """The [moe] loss coefficients set above their defaults, as `key = value` (`NonFiniteGuard`'s)."""
    default = MoE()
    return tuple(
        f"moe.{key} = {getattr(moe, key):g}"
        for key in ("aux_loss_coeff", "z_loss_coeff")
        if getattr(moe, key) > getattr(default, key)
    )


def _describe(loss: torch.Tensor, grad_norm: torch.Tensor) -> str:
    """`non-finite loss nan and gradient norm nan`-style (read only when a step was not finite)."""
    loss_v, norm_v = float(loss.detach().float().sum()), float(grad_norm)
    parts = [f"loss {loss_v}"] if not math.isfinite(loss_v) else []
    return "non-finite " + " and ".join([*parts, f"gradient norm {norm_v}"])
