"""What a checkpoint holds, as DCP `Stateful`s: the model's weights and the optimizer's state under
parameter names (so they reshard), plain objects (schedule, data position), and the train state (the step
and each rank's own random generators)."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    """The model parts' weights under their canonical names (wrappers' prefixes removed)."""

    def __init__(self, parts: list[nn.Module], dtype: torch.dtype | None = None) -> None:
        self.parts = parts
        self.dtype = dtype

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part))
        if self.dtype is not None:
            sd = {k: v.to(self.dtype) for k, v in sd.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """Optimizer states keyed by parameter name, so they reshard like the weights."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            osd = get_optimizer_state_dict(
                part, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
            sd.update(osd)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=opts)


class ObjectState(Stateful):
    """Any object with state_dict()/load_state_dict() whose state is the same on every rank."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


class TrainState(Stateful):
    """The step and this rank's random generators (CPU and CUDA), saved under `rng_rank<r>` by each rank,
    so that each rank gets its own back. Before a load, `load_rng` names the entry to read (None: none)."""

    def __init__(self, rank: int) -> None:
        self.step = 0
        self.rank = rank
        self.loading = False
        self.load_rng: str | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.loading:  # the entries to read (their values are replaced)
            return {"step": self.step, **({self.load_rng: b""} if self.load_rng else {})}
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"step": self.step, f"rng_rank{self.rank}": _to_bytes(rng)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        blob = state_dict.get(self.load_rng) if self.load_rng else None
        if blob:
            rng = _from_bytes(blob)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
