"""The optimizer step beside the next forward: FSDP unit by unit, on a side stream.

A plain step updates every parameter before the next forward may all-gather any of them: the step's
tens of milliseconds (the clip's scaling, AdamW, float8's weight scales) are a gap in which the GPU does
nothing else. Stepped one FSDP unit at a time on a side stream, in forward order, each unit's update
only has to finish before that unit's all-gather: a forward pre-hook makes the compute stream (and
FSDP's all-gather streams) wait for the units that the module's forward gathers (its own and the one it
prefetches). Float8's weight scales follow each unit's update: on the side stream where their
all-reduce has a process group of its own, else in the hook. The updates then run beside the matmuls
of the blocks before them.

Numerically the same step: the same AdamW over the same parameters in groups, the clip's coefficient
applied to each unit's gradients, each weight's float8 scale from its own amax.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titanrush")


def param_groups(units: Sequence[Sequence[nn.Module]], root: nn.Module) -> list[list[nn.Parameter]]:
    """One list of trainable parameters per FSDP unit, in forward order (a unit without any keeps its
    empty list, so that group i + 1 stays unit i's): the root's own (what no unit holds) first, where it
    has any, since the root gathers first."""
    held = [[p for m in unit for p in m.parameters() if p.requires_grad] for unit in units]
    ids = {id(p) for group in held for p in group}
    own = [p for p in root.parameters() if p.requires_grad and id(p) not in ids]
    return [own, *held] if own else held


def _step_group(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """optimizer.step() over one of its parameter groups (the step loops over `param_groups`; the
    optimizer's step hooks then run once per group)."""
    groups = optimizer.param_groups
    optimizer.param_groups = [group]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OverlappedStep:
    """Steps `optimizer`, whose parameter groups are `param_groups(units, root)`, unit by unit.

    Args:
        optimizer: One parameter group per unit, in forward order; first the root's own, if it has any.
        root: The model (FSDP's root module, which prefetches unit 0).
        units: Each FSDP unit's modules, in forward order; `units[i][0]` runs the unit's forward hooks
            and prefetches unit i + 1 (FSDP's explicit forward prefetch, `fsdp._set_prefetch`).
        scales: Computes the float8 weight scales of a module's weights after their update (torchao's
            precompute for FSDP's float8 all-gather); None without float8 all-gather.
        scales_beside: `scales` runs its all-reduce on a process group of its own (`float8_scales_over`):
            it then runs on the side stream right after each unit's update, and returns the scale tensor.
            Otherwise (torchao's, on FSDP's communicator, where it would queue behind the all-gathers it
            must precede) it runs in the forward hooks on the compute stream.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        root: nn.Module,
        units: Sequence[Sequence[nn.Module]],
        scales: Callable[[nn.Module], torch.Tensor | None] | None,
        scales_beside: bool = False,
    ) -> None:
        n_groups = len(optimizer.param_groups)
        own = n_groups - len(units)  # 1 when the root holds parameters of its own (a tied table)
        if own not in (0, 1):
            raise ValueError(f"{n_groups} parameter groups for {len(units)} FSDP units")
        self.optimizer = optimizer
        self.root = root
        self.scales = scales
        self.scales_beside = scales_beside
        self.modules: list[Sequence[nn.Module]] = [(), *units] if own else list(units)  # per group
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done: list[torch.cuda.Event | None] = [None] * n_groups
        self.pending: set[int] = set()  # groups updated whose forward has not yet waited for them
        # The root's forward gathers its own parameters and prefetches unit 0; unit i's gathers its own
        # (if not prefetched) and prefetches unit i + 1.
        root_needs = [0, own] if own else [0]
        root.register_forward_pre_hook(self._hook(root_needs), prepend=True)
        for i, unit in enumerate(units):
            needs = [own + j for j in (i, i + 1) if j < len(units)]
            unit[0].register_forward_pre_hook(self._hook(needs), prepend=True)
        self._warned = False

    def step(self, clip_coef: torch.Tensor | None) -> None:
        """Queue every group's update, the gradients scaled by `clip_coef` first (when given). The caller
        does not zero the gradients: each group's are freed once the forward has waited for its update."""
        if self.pending:  # (each forward readies every unit; finish() before anything else reads them)
            raise RuntimeError(
                f"optimizer.overlap_step: the updates of parameter groups {sorted(self.pending)} were never "
                "waited for (no forward of their units since the last step); their gradients would add up"
            )
        readers: list[Any] = []  # the streams that read the float8 scales made on the side stream
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
            readers = [compute, *(self._gather_streams() or ())]
            if clip_coef is not None:
                clip_coef.record_stream(self.stream)
        for index, group in enumerate(self.optimizer.param_groups):
            grads = [_local(p.grad) for p in group["params"] if p.grad is not None]
            if self.stream is None:
                self._update(index, grads, clip_coef, readers)
                continue
            with torch.cuda.stream(self.stream):
                self._update(index, grads, clip_coef, readers)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.done[index] = event
        self.pending = set(range(len(self.optimizer.param_groups)))

    def _update(
        self, index: int, grads: list[torch.Tensor], coef: torch.Tensor | None, readers: list[Any]
    ) -> None:
        """Group `index`'s update (and, beside, its float8 scales) on the current stream."""
        if coef is not None and grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        group = self.optimizer.param_groups[index]
        if group["params"]:  # (a unit without trainable parameters keeps an empty group)
            _step_group(self.optimizer, group)
        if self.scales is not None and self.scales_beside:
            for module in self.modules[index]:
                scale = self.scales(module)
                for stream in readers if scale is not None else ():
                    scale.record_stream(stream)  # freed at the next step's, reused only after their reads

    def _ready(self, index: int) -> None:
        """Order the compute stream after group `index`'s update, free the group's gradients (then compute
        its float8 scales, unless they were made beside it)."""
        if index not in self.pending:
            return
        self.pending.discard(index)
        event = self.done[index]
        if event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(event)
        # The gradients go now, not at zero_grad: the compute stream is past the side stream's last read
        # of them, so the allocator hands their memory to this forward at once.
        for p in self.optimizer.param_groups[index]["params"]:
            p.grad = None
        if self.scales is not None and not self.scales_beside:
            for module in self.modules[index]:
                self.scales(module)

    def _hook(self, indices: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            readied = [i for i in indices if i in self.pending]
            if not readied:
                return
            streams = self._gather_streams()
            if streams is None:  # FSDP's streams not found: wait for every unit now, correct but serial
                readied = sorted(self.pending)
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "optimizer.overlap_step: this torch's FSDP keeps its all-gather streams elsewhere; "
                        "each forward waits for the whole step first (no overlap)"
                    )
            for index in readied:
                self._ready(index)
            for stream in streams or ():
                stream.wait_stream(torch.cuda.current_stream(self.stream.device))

        return hook

    def _gather_streams(self) -> list[torch.cuda.Stream] | None:
        """FSDP's all-gather streams (its copy-in's and the collective's), on a GPU.

        In forward FSDP orders them after the compute stream once, at the root, and then only after each
        unit's copy-out: a unit prefetched by the one before it would all-gather weights whose update
        the compute stream has waited for but those streams have not. So after each wait they are
        ordered after the compute stream too (as FSDP's root does), through FSDP's communication context
        (private: None where this torch has none, and the caller then waits for every update at once).
        """
        if self.stream is None:
            return []
        state = getattr(self.root, "_get_fsdp_state", None)
        ctx = getattr(state(), "_comm_ctx", None) if state is not None else None
        streams = [getattr(ctx, name, None) for name in ("all_gather_copy_in_stream", "all_gather_stream")]
        return streams if all(s is not None for s in streams) else None

    def finish(self) -> None:
        """Order the compute stream after every queued update (before anything but the next forward
        reads the parameters: a validation pass, a checkpoint, the end of the run)."""
        for index in sorted(self.pending):
            self._ready(index)
