"""Activation offload: the first blocks' saved activations wait in pinned host memory between forward and
backward, instead of on the GPU or being recomputed.

A block chosen for offload is not checkpointed. While it runs forward, a `saved_tensors_hooks` context
catches every tensor autograd saves for its backward (under compile: what the compiled block's
partitioner keeps) and copies it to pinned host memory on a side stream; the GPU tensor is released
once that copy is done (polled as later blocks start; backward waits for any still running), so its
memory goes straight back to the compute stream's pool. In backward each block, offloaded or not,
starts the copies back of the offloaded blocks that come `ahead` blocks after it, so they arrive while
it computes.

Left on the GPU: parameters (FSDP frees and re-gathers them itself), tensor subclasses (DTensor,
float8), tensors with gaps in their storage and tensors below `min_bytes`. The copies spend host-link
bandwidth instead of GPU memory and recomputation: a block is worth offloading when its saved bytes
cross the link in less time than the blocks after it take to compute (docs/parallelisms.md).

On a CPU device the "host copy" is a second CPU tensor and nothing is asynchronous: the bookkeeping is
the same, which the CPU tests check; the trainer allows offload only on CUDA.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class _Saved:
    """One offloaded tensor: its host copy, and its device copy between the fetch and the unpack."""

    __slots__ = ("__weakref__", "group", "host", "device", "used")

    def __init__(self, group: _Group, host: torch.Tensor) -> None:
        self.group, self.host = group, host
        self.device: torch.Tensor | None = None
        self.used = False


class _Group:
    """The tensors one forward call of one offloaded block saved."""

    def __init__(self, call: int, position: int) -> None:
        self.call, self.position = call, position
        self.saved: list[weakref.ref[_Saved]] = []
        self.stash: list[torch.Tensor] = []  # the device tensors being copied out (CUDA)
        self.copied: Any = None  # the side stream's event after the copies out (CUDA)
        self.ready: Any = None  # the side stream's event after the fetch (CUDA)
        self.fetched = False

    def live(self) -> list[_Saved]:
        return [s for s in (r() for r in self.saved) if s is not None]


class ActivationOffloader:
    """Moves what chosen blocks save for backward to host memory and back; one per model.

    Args:
        device: The device the model computes on.
        ahead: In backward, fetch an offloaded block's tensors when the block `ahead` places after it
            starts its backward (more: earlier arrival, more GPU memory held by fetched blocks).
        min_bytes: Tensors smaller than this stay on the device.
    """

    def __init__(self, device: torch.device, *, ahead: int = 2, min_bytes: int = 1 << 20) -> None:
        self.device, self.ahead, self.min_bytes = device, ahead, min_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._calls = itertools.count()
        self._groups: dict[int, _Group] = {}  # by call number, offloaded calls only
        self._copying: list[_Group] = []  # groups whose device tensors wait for their copies out
        self._positions: dict[int, int] = {}  # call number -> block position, every call
        self.bytes_offloaded = 0  # since the last `reset_stats`: the traffic each way

    # -- forward -------------------------------------------------------------------------------------------
    def track(self, block: nn.Module, position: int, *, offload: bool) -> None:
        """Install the hooks on one block (after FSDP, whose pre-forward gathers the parameters first)."""
        state: dict[str, Any] = {}

        def pre(module: nn.Module, args: Any) -> None:
            self._release(wait=False)
            call = next(self._calls)
            state["call"] = call
            self._positions[call] = position
            if offload and torch.is_grad_enabled():
                self._prune()
                group = _Group(call, position)
                self._groups[call] = group
                keep = _storages(module.parameters())
                ctx = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack(t, group, keep), self._unpack
                )
                ctx.__enter__()
                state["ctx"], state["group"] = ctx, group

        def post(module: nn.Module, args: Any, output: Any) -> None:
            ctx = state.pop("ctx", None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
                group = state.pop("group")
                if group.stash:
                    group.copied = self.stream.record_event()
                    self._copying.append(group)
            call = state.pop("call")
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._before_backward(call))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)

    def _pack(self, t: torch.Tensor, group: _Group, keep: set[int]) -> Any:
        if not self._offloads(t, keep):
            return t
        if self.cuda:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            group.stash.append(t)  # released after the copy (`_release`)
        else:
            host = t.detach().clone()
        saved = _Saved(group, host)
        group.saved.append(weakref.ref(saved))
        self.bytes_offloaded += t.numel() * t.element_size()
        return saved

    def _offloads(self, t: torch.Tensor, keep: set[int]) -> bool:
        return (
            type(t) is torch.Tensor
            and t.device == self.device
            and t.numel() * t.element_size() >= self.min_bytes
            and _dense(t)
            and t.untyped_storage().data_ptr() not in keep
        )

    def _release(self, *, wait: bool) -> None:
        """Drop the device tensors whose copies out are done (`wait`: all of them, the compute stream
        waiting for the copies). Freed on the compute stream after the copy, their memory is at once
        reusable there (record_stream instead would hold it until the allocator next polls the events)."""
        still = []
        for group in self._copying:
            if wait:
                torch.cuda.current_stream(self.device).wait_event(group.copied)
            elif not group.copied.query():
                still.append(group)
                continue
            group.stash.clear()
        self._copying = still

    # -- backward ------------------------------------------------------------------------------------------
    def _before_backward(self, call: int) -> None:
        """Block `call` starts its backward: fetch the offloaded calls up to `ahead` blocks before it."""
        if self._copying:
            self._release(wait=True)
        position = self._positions.pop(call, None)
        if position is None:
            return
        for back in range(1, self.ahead + 1):
            group = self._groups.get(call - back)
            if group is not None and group.position == position - back and not group.fetched:
                self._fetch(group.live())
                group.fetched = True

    def _fetch(self, items: list[_Saved]) -> None:
        items = [s for s in items if s.device is None and not s.used]
        if not items:
            return
        if not self.cuda:
            for s in items:
                s.device = s.host.clone()
            return
        for s in items:  # allocated on the compute stream, which will use and free them
            s.device = torch.empty_like(s.host, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for s in items:
                s.device.copy_(s.host, non_blocking=True)
            event = self.stream.record_event()
        for s in items:
            s.group.ready = event

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        saved: _Saved = packed
        group = saved.group
        if self._copying:
            self._release(wait=True)
        if saved.device is None:  # not fetched ahead (the first offloaded block of the backward), or again
            self._fetch(group.live() if not saved.used else [saved])
            group.fetched = True
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(group.ready)
        out, saved.device, saved.used = saved.device, None, True
        if all(s.used for s in group.live()):
            self._groups.pop(group.call, None)
        return out

    def _prune(self) -> None:
        """Forget calls whose backward will not come (their saved tensors are gone)."""
        for call in [c for c, g in self._groups.items() if not g.live()]:
            del self._groups[call]
        if len(self._positions) > 4096:  # calls never followed by a backward (evaluation with grad on)
            for call in sorted(self._positions)[:-1024]:
                del self._positions[call]


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory without gaps or overlaps (any order of dimensions):
    `empty_like` then gives the host copy the same strides, which compiled backward graphs check."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _storages(params: Iterable[torch.Tensor]) -> set[int]:
    """Storage addresses of the parameters and of the inner tensors of subclass parameters (float8)."""
    out: set[int] = set()
    stack = list(params)
    while stack:
        t = stack.pop()
        flatten = getattr(t, "__tensor_flatten__", None)
        if type(t) not in (torch.Tensor, nn.Parameter) and flatten is not None:
            names, _ = flatten()
            stack.extend(getattr(t, name) for name in names)
            continue
        out.add(t.untyped_storage().data_ptr())
    out.discard(0)
    return out


def apply_offload(model: nn.Module, first: int, device: torch.device) -> ActivationOffloader | None:
    """Offload the saved activations of the model's first `first` blocks (global indices), in place.

    Every block of `model.layers` gets the backward hook that fetches ahead; those with a global index
    below `first` also offload. Apply after FSDP (its forward hooks gather the parameters first).

    Returns:
        The offloader (its `bytes_offloaded` counts the traffic), or None when `first` is 0.
    """
    if first <= 0:
        return None
    offloader = ActivationOffloader(device)
    for position, (name, block) in enumerate(model.layers.items()):
        offloader.track(block, position, offload=int(name) < first)
    return offloader
