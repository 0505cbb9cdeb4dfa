"""Activation offload: chosen blocks' saved activations wait in pinned host memory between forward and
backward, instead of on the GPU or being recomputed.

A block chosen for offload recomputes no matmul (compiled: selective op keeping every matmul output;
eager: not checkpointed, see `activation_checkpoint.apply_ac`). While it runs forward, a
`saved_tensors_hooks` context catches every tensor autograd saves for its backward (under compile: what
the compiled block's partitioner keeps) and copies it to pinned host memory on a side stream. The GPU
tensors are released when the block `behind` places later starts: the compute stream first waits for
their copies, so the memory goes straight back to its pool, reusable in stream order. (The CPU runs ahead
of the GPU, so polling the copies from the CPU would find them unfinished and free nothing during
forward; and `record_stream` would keep the memory from the allocator until it polls, which it answers by
reserving more.) Copies slower than `behind` blocks of compute hold the compute stream back: spread the
offloaded blocks out (`every`) so that each copy has the compute of the blocks between them to hide
behind. In backward each block, offloaded or not, starts the copies back of the offloaded blocks that
come `ahead` blocks after it, so they arrive while it computes.

Left on the GPU: parameters (FSDP frees and re-gathers them itself), tensor subclasses (DTensor, float8),
tensors with gaps in their storage and tensors below `min_bytes`. The copies spend host-link bandwidth
instead of GPU memory and recomputation: a block is worth offloading when its saved bytes cross the link
in less time than the blocks after it take to compute (docs/parallelism.md).

On a CPU device the "host copy" is a second CPU tensor and nothing is asynchronous: the bookkeeping is
the same, which the CPU tests check; the trainer allows offload only on CUDA.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("titanrush")


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
        behind: In forward, the block this many places after an offloaded one waits for its copies out
            and frees its device tensors.
        min_bytes: Tensors smaller than this stay on the device.
    """

    def __init__(
        self, device: torch.device, *, ahead: int = 2, behind: int = 2, min_bytes: int = 1 << 20
    ) -> None:
        if device.type == "cuda" and device.index is None:  # tensors name their index: compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.ahead, self.behind, self.min_bytes = device, ahead, behind, min_bytes
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
            call = next(self._calls)
            self._release(before=call - self.behind + 1)
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

    def _release(self, before: int | None = None) -> None:
        """Free the device tensors of the groups of calls before `before` (None: all), the compute stream
        first waiting for their copies out."""
        still = []
        for group in self._copying:
            if before is not None and group.call >= before:
                still.append(group)
                continue
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(group.copied)
            group.stash.clear()
        self._copying = still

    # -- backward ------------------------------------------------------------------------------------------
    def _before_backward(self, call: int) -> None:
        """Block `call` starts its backward: fetch the offloaded calls up to `ahead` blocks before it."""
        if self._copying:
            self._release()
        position = self._positions.pop(call, None)
        if position is None:
            return
        for back in range(1, self.ahead + 1):
            group = self._groups.get(call - back)
            if group is not None and group.position == position - back and not group.fetched:
                self._fetch(group, group.live())
                group.fetched = True

    def _fetch(self, group: _Group, items: list[_Saved]) -> None:
        """Start the copies back of these tensors of `group` (those not already on the device or used)."""
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
            group.ready = self.stream.record_event()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        saved: _Saved = packed
        group = saved.group
        if self._copying:
            self._release()
        if saved.device is None:  # not fetched ahead (the first offloaded block of the backward), or again
            self._fetch(group, group.live() if not saved.used else [saved])
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


def offloaded(index: int, first: int, every: int) -> bool:
    """Whether the block with this global index is offloaded: every `every`-th of the first `first`."""
    return index < first and index % every == 0


def apply_offload(
    model: nn.Module, first: int, device: torch.device, *, every: int = 1
) -> ActivationOffloader | None:
    """Offload the saved activations of every `every`-th block of the model's first `first` blocks (global
    indices: 0, every, 2 every, ... below first), in place.

    Every block of `model.layers` gets the hooks that release and fetch; the chosen ones also offload.
    Apply after FSDP (its forward hooks gather the parameters first).

    Returns:
        The offloader (its `bytes_offloaded` counts the traffic), or None when `first` is 0.
    """
    if first <= 0:
        return None
    # A group frees its device tensors when the block after the next offloaded one starts: its copy hides
    # behind the `every` blocks in between.
    offloader = ActivationOffloader(device, behind=every + 1)
    for position, (name, block) in enumerate(model.layers.items()):
        offloader.track(block, position, offload=offloaded(int(name), first, every))
    return offloader


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a Linux cpulist ("0-15,32-47")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_near_gpu(device: torch.device, sysfs: str = "/sys/bus/pci/devices") -> set[int] | None:
    """Run this process on the CPUs of the GPU's NUMA node, so that the pinned host memory it allocates
    (first touched by these CPUs) sits next to the GPU's PCIe root instead of across the socket link.

    Returns the CPUs bound to, or None where the GPU's node is unknown or shares no CPU with the
    current affinity (nothing changed).
    """
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(i is None for i in ids):
        return None
    path = f"{sysfs}/{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0/local_cpulist"
    try:
        with open(path) as f:
            local = parse_cpulist(f.read())
    except OSError:
        return None
    now = os.sched_getaffinity(0)
    cpus = local & now
    if not cpus or cpus == now:
        return None
    # Every thread of the process (affinity is per thread; threads started later inherit it).
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        with contextlib.suppress(OSError):  # a thread that has exited since the listing
            os.sched_setaffinity(int(tid), cpus)
    logger.info(f"activation offload: bound to the GPU's {len(cpus)} NUMA-local CPUs")
    return cpus
