"""FSDP2 (`fully_shard`) per transformer block, with mixed precision, CPU offload and explicit prefetch.

Units, in execution order: `tok_embeddings`, each block of `layers`, then `[norm, output]` together,
and the root (whatever is left: the tied embedding table, buffers). Each unit all-gathers its parameters
before its forward, frees them after (unless told to keep them), all-gathers again in backward and
reduce-scatters the gradients. A 2-D mesh (dp_replicate x dp_shard) gives HSDP: parameters are sharded
within each replica group and gradients are also all-reduced across the groups.

FSDP holds each unit's fp32 reduce-scatter input until the next unit's backward has ended, so that the
compute stream cannot reuse that memory while the collective still reads it. For the output layer that
is 4 bytes x vocab x dim (2 GiB on the 8B) through the whole backward of the last block.
`release_reduce_inputs` drops it as each block's backward starts, leaving the wait to the caching
allocator (`record_stream` on the reduce-scatter stream): the memory is reused as soon as the collective
is done. `compute_pool_reduce_scatter` takes the sharded gradients from the compute stream's memory pool
instead of the reduce-scatter stream's, so that the next forward reuses them (on by default; not under
HSDP or CPU offload).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from titanrush.config import ConfigError

logger = logging.getLogger("titanrush")
ReshardPolicy = Literal["default", "always", "never"]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: ReshardPolicy = "default",
    keep_gathered_last: int = 0,
    cpu_offload: bool = False,
    free_reduce_inputs: bool = True,
    grads_in_compute_pool: bool = True,
    copy_in_by_chunks: bool = True,
) -> None:
    """Shard `model` with FSDP2 over `mesh`, in place.

    Args:
        model: A Llama-shaped model: `tok_embeddings`, `layers` (ModuleDict), `norm`, `output`; any of
            the first, third and fourth may be None (pipeline stages). May already be tensor-parallel
            (its parameters DTensors on a `tp` mesh of the same root mesh).
        mesh: The data-parallel mesh: 1-D (`dp_shard_cp`) for FSDP, 2-D (`dp_replicate`, `dp_shard_cp`)
            for HSDP.
        param_dtype: dtype of the all-gathered parameters, i.e. of the compute (bf16 for mixed precision).
            The sharded master weights and the optimizer stay in their own dtype (fp32).
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce (fp32 keeps the sum exact enough).
        reshard_after_forward: `always` frees every unit's gathered parameters after its forward (ZeRO-3,
            least memory); `never` keeps them until backward (ZeRO-2 like, no second all-gather);
            `default` frees them except for the units backward needs first: the last block and
            `[norm, output]`, whose all-gathers backward would otherwise wait on right away.
        keep_gathered_last: With `default`: the last N blocks keep their gathered parameters until
            backward too (ZeRO-2 for them), for their gathered weights held at the end of forward.
        cpu_offload: Keep the sharded parameters, gradients and optimizer states in host memory; each
            unit is copied to the device for its all-gather (and its gradients back after the
            reduce-scatter). The optimizer step then runs on the CPU.
        free_reduce_inputs: Release the reduce-scatter inputs still in flight as each block's backward
            starts (`release_reduce_inputs`; the model's `fsdp_released_reduce_inputs` counts them).
        grads_in_compute_pool: Allocate the reduce-scatter outputs, i.e. the sharded gradients, from the
            compute stream's memory pool (`ComputePoolReduceScatter`). Not with HSDP or CPU offload (logged
            and skipped there).
        copy_in_by_chunks: Copy each unit's gradients into its reduce-scatter input with one foreach copy
            over every gradient's per-rank chunks (`reduce_scatter_copy_in`) instead of FSDP's `chunk_cat`.
            It applies to the whole process (FSDP's module-level function), as the last call left it.

    Raises:
        ConfigError: An unknown `reshard_after_forward`.
    """
    if reshard_after_forward not in ("default", "always", "never"):
        raise ConfigError(
            f"parallelism.fsdp_reshard_after_forward = {reshard_after_forward!r}: "
            "use default, always or never"
        )
    common: dict = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    never = reshard_after_forward == "never"
    always = reshard_after_forward == "always"

    emb, norm, out = model.tok_embeddings, model.norm, model.output
    # A tied table is one parameter in two modules: both must then live in the same unit (the root).
    tied = emb is not None and out is not None and emb.weight is out.weight
    units: list[list[nn.Module]] = []  # every module of each unit, units in forward order
    if emb is not None and not tied:
        fully_shard(emb, reshard_after_forward=not never, **common)
        units.append([emb])
    blocks = list(model.layers.values())
    keep_from = len(blocks) - max(1, keep_gathered_last)
    for i, block in enumerate(blocks):
        kept = i >= keep_from  # backward needs it early (the last block), or asked for (ZeRO-2 blocks)
        fully_shard(block, reshard_after_forward=always or (not never and not kept), **common)
        units.append([block])
    if out is not None and not tied:
        head = [m for m in (norm, out) if m is not None]
        fully_shard(head, reshard_after_forward=always, **common)
        units.append(head)
    # The root gathers what no unit claimed; FSDP never frees the root after forward.
    fully_shard(model, **common)
    firsts = [unit[0] for unit in units]  # (a unit's first module runs its hooks and holds its settings)
    _set_prefetch(model, firsts)
    model.fsdp_units = units  # (the optimizer step unit by unit, step_overlap, follows them)
    if grads_in_compute_pool and not compute_pool_applies(hsdp=mesh.ndim != 1, cpu_offload=cpu_offload):
        logger.info(
            "parallelism.fsdp_grads_in_compute_pool applies to FSDP on one mesh dimension without CPU "
            "offload: not applied (HSDP's all-reduce stream would use the buffers unrecorded)"
        )
    elif grads_in_compute_pool:
        comm = compute_pool_reduce_scatter()
        if comm is not None:
            for module in (*firsts, model):
                module.set_custom_reduce_scatter(comm)
        model.fsdp_reduce_scatter = comm  # (its `calls` count the reduce-scatters it ran; tests read it)
    if free_reduce_inputs:
        release_reduce_inputs(model, blocks)
    use_copy_in_by_chunks(copy_in_by_chunks)


def compute_pool_applies(*, hsdp: bool, cpu_offload: bool) -> bool:
    """Whether the sharded gradients can come from the compute stream's pool: not under HSDP (its
    all-reduce stream would use the buffers unrecorded) nor with CPU offload (they live on the host)."""
    return not hsdp and not cpu_offload


def compute_pool_reduce_scatter() -> Any:
    """FSDP's reduce-scatter with its output, the sharded fp32 gradients, in the compute stream's pool.

    FSDP allocates each reduce-scatter's output on the reduce-scatter stream, and the caching allocator
    keeps one pool per stream: the sharded gradients (4 bytes x the rank's parameters, 7.5 GiB for the 8B
    on 4 GPUs) come from a pool that only reduce-scatters reuse. After the optimizer step frees them that
    memory stays reserved through the next forward, beside the compute pool's own peak: most of the gap
    between reserved and allocated memory on FSDP runs. Allocated from the compute stream's pool (and
    marked as used by the reduce-scatter stream, so the allocator waits for the collective before reusing
    it), the next forward's activations reuse it. None, with a warning, where this torch has no custom
    reduce-scatter for FSDP.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        ReduceScatter = None
    if ReduceScatter is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        msg = "this torch's FSDP takes no custom reduce-scatter: the gradients stay in its stream's pool"
        warnings.warn(msg, stacklevel=2)
        return None

    class ComputePoolReduceScatter(ReduceScatter):
        calls = 0
        compute: Any = None  # the stream FSDP's post-backward runs on (the reduce-scatter input's)

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if device.type != "cuda":
                return torch.empty(*size, dtype=dtype, device=device)
            current = torch.cuda.current_stream(device)
            if self.compute is None:  # FSDP allocates the input first, on its post-backward's stream
                self.compute = current
            if current == self.compute:
                return torch.empty(*size, dtype=dtype, device=device)
            # The output, under the reduce-scatter stream, which FSDP made wait for the compute stream
            # first: from the compute stream's pool, the allocator told that this stream uses it.
            with torch.cuda.stream(self.compute):
                out = torch.empty(*size, dtype=dtype, device=device)
            out.record_stream(current)
            return out

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
            async_op: bool = False,
        ) -> Any:  # fmt: skip
            self.calls += 1
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return ComputePoolReduceScatter()


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """`dist.reduce_scatter_single` where it exists (torch >= 2.12), else `reduce_scatter_tensor`."""
    single = getattr(dist, "reduce_scatter_single", None)
    if single is not None:
        return single(output=output, input=input, **kwargs)
    return dist.reduce_scatter_tensor(output, input, **kwargs)


def release_reduce_inputs(root: nn.Module, blocks: list[nn.Module]) -> None:
    """As each of `blocks` starts its backward, release the reduce-scatter inputs FSDP still holds.

    The hook sits on each block's output: its gradient is ready once the unit after the block (the next
    block, or the output layer) has run its post-backward, which issued that unit's reduce-scatter. Each
    held input is marked as in use by the reduce-scatter stream, then dropped from FSDP's state: the
    caching allocator hands its memory out again only after the collective. FSDP's own wait on it, which
    keeps the reduce-scatters from falling behind the compute (one in flight), moves one block later:
    the next release makes the compute stream wait for the collectives of the inputs released before.
    The count of released inputs goes to `root.fsdp_released_reduce_inputs` (tests read it).

    The held inputs are FSDP internals: a list `reduce_scatter_states` (torch >= 2.12) or a single
    `reduce_scatter_state` (earlier) on the shared communication context. Where neither exists this
    warns once and does nothing, which costs memory, never correctness.
    """
    assert isinstance(root, FSDPModule)
    root.fsdp_released_reduce_inputs = 0
    waits: list[Any] = []  # the events of the reduce-scatters whose inputs the last release dropped

    def release(grad: torch.Tensor) -> None:
        ctx = root._get_fsdp_state()._comm_ctx
        if hasattr(ctx, "reduce_scatter_states"):
            held, clear = list(ctx.reduce_scatter_states), ctx.reduce_scatter_states.clear
        elif hasattr(ctx, "reduce_scatter_state"):
            held = [ctx.reduce_scatter_state] if ctx.reduce_scatter_state is not None else []
            clear = lambda: setattr(ctx, "reduce_scatter_state", None)  # noqa: E731
        else:
            msg = "FSDP keeps no reduce_scatter_state(s) in this torch: reduce-scatter inputs released late"
            warnings.warn(msg, stacklevel=1)
            for handle in handles:
                handle.remove()
            return
        for event in waits:  # where FSDP would have waited: at most one block's collectives behind
            torch.cuda.current_stream().wait_event(event)
        waits.clear()
        for state in held:
            buf = state.reduce_scatter_input
            if buf.is_cuda:  # (gloo on CPU reduce-scatters synchronously: nothing in flight)
                buf.record_stream(ctx.reduce_scatter_stream)
                if state.event is not None:
                    waits.append(state.event)
        clear()
        root.fsdp_released_reduce_inputs += len(held)

    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(release)

    handles = [block.register_forward_hook(on_output) for block in blocks]


COPY_IN_CALLS = {"by_chunks": 0, "chunk_cat": 0}  # how reduce_scatter_copy_in's calls went (tests read it)


def reduce_scatter_copy_in(grads: list[torch.Tensor], out: torch.Tensor, world_size: int) -> None:
    """Lay `grads` out in `out` rank by rank, as FSDP's reduce-scatter input: chunk r of every gradient
    (its dim-0 slice r of `world_size`) in order, then chunk r + 1, casting to `out`'s dtype.

    This is what `torch._chunk_cat` writes. Its CUDA kernel casts bf16 to fp32 at 1.9 TB/s on an H200
    (27 ms per step on the 8B float8 row); one `_foreach_copy_` over all the chunks runs at 3.15 TB/s,
    where a plain copy per chunk is no faster than chunk_cat (`scripts/bench_copy_in.py` times them).
    Gradients whose dim 0 does not divide by `world_size` (FSDP pads them with zeros) or that are not
    contiguous take chunk_cat.
    """
    rows = out.view(world_size, -1)
    if any(g.dim() == 0 or g.size(0) % world_size or not g.is_contiguous() for g in grads):
        torch._chunk_cat(grads, 0, world_size, out=rows)
        COPY_IN_CALLS["chunk_cat"] += 1
        return
    COPY_IN_CALLS["by_chunks"] += 1
    col, dst, src = 0, [], []
    for g in grads:
        m = g.numel() // world_size
        flat = g.view(world_size, m)
        dst += [rows[r, col : col + m] for r in range(world_size)]
        src += [flat[r] for r in range(world_size)]
        col += m
    torch._foreach_copy_(dst, src)


_FSDP_COPY_IN: dict[str, Any] = {}  # FSDP's own copy-in, kept while ours replaces it


def use_copy_in_by_chunks(enable: bool) -> None:
    """Make FSDP's reduce-scatter copy-in `reduce_scatter_copy_in` (or put FSDP's own back). FSDP calls it
    through its module's global `foreach_reduce_scatter_copy_in` (torch 2.4 and later); where that is
    missing this warns and leaves FSDP as it is."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    if "fn" not in _FSDP_COPY_IN:
        own = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
        if own is None:
            if enable:
                msg = "this torch's FSDP has no foreach_reduce_scatter_copy_in: its own copy-in stays"
                warnings.warn(msg, stacklevel=2)
            return
        _FSDP_COPY_IN["fn"] = own
    collectives.foreach_reduce_scatter_copy_in = reduce_scatter_copy_in if enable else _FSDP_COPY_IN["fn"]


def _set_prefetch(root: nn.Module, units: list[nn.Module]) -> None:
    """Explicit prefetch, one unit ahead in forward and one behind in backward.

    Implicit forward prefetch only happens when the CPU runs ahead of the GPU: each all-gather is issued
    when the unit's forward starts. Asking unit i to start unit i+1's all-gather when it starts its own
    forward overlaps that communication with unit i's compute even when the CPU is the bottleneck,
    for the price of one more unit's gathered parameters held at a time. Backward mirrors it (which is
    also FSDP's implicit backward behaviour, made explicit so it follows the same unit list).
    """
    if not units:
        return
    assert isinstance(root, FSDPModule)
    root.set_modules_to_forward_prefetch([units[0]])
    for cur, nxt in zip(units[:-1], units[1:]):
        assert isinstance(cur, FSDPModule) and isinstance(nxt, FSDPModule)
        cur.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([cur])
