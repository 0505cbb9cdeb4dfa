"""The ONE place that fixes the order of parallelisms for the Llama, and its tensor-parallel plan.

Order: float8 -> TP -> CP -> AC -> compile -> FSDP/HSDP or DDP -> activation offload, because
- float8 swaps `nn.Linear` for float8 linears, which the TP styles and FSDP then shard as they are;
- TP rewrites parameters into DTensors on the `tp` mesh, which FSDP then shards again over `dp` (2-D);
- CP is applied per step by the trainer (sequence-sharded batch, ring attention in SDPA), so here it
  only has its place in the order: any module change it needed would go before the blocks are wrapped;
- AC wraps each block, and compile then traces the checkpointed block (so the recomputation is
  compiled too);
- FSDP/DDP go last: their hooks wrap the outermost block modules (outside the compiled graphs), and
  FSDP must see the final parameters (after TP) to shard them;
- activation offload hooks each block last: FSDP's forward hooks must have gathered the parameters
  before it sorts what a block saves into parameters (left alone) and activations (moved to the host).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titanrush.config import ActivationCheckpoint, Compile, ConfigError, Float8, Parallelism
from titanrush.models.llama.attention import uses_graph_break
from titanrush.parallel.activation_checkpoint import apply_ac
from titanrush.parallel.activation_offload import apply_offload
from titanrush.parallel.compile import apply_compile
from titanrush.parallel.ddp import apply_ddp
from titanrush.parallel.float8 import apply_float8
from titanrush.parallel.fsdp import apply_fsdp
from titanrush.parallel.parallel_dims import ParallelDims
from titanrush.parallel.tensor_parallel import (
    ReplicateParallel,
    SyncRowwiseParallel,
    apply_tp_plan,
    enable_async_tp,
)

logger = logging.getLogger("titanrush")


def parallelize_llama(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    *,
    parallelism: Parallelism,
    compile: Compile,
    ac: ActivationCheckpoint,
    float8: Float8,
    precision: str,
    device: torch.device | None = None,
) -> nn.Module:
    """Apply float8, TP, CP, AC, compile and FSDP/HSDP or DDP to a Llama, in that order, in place.

    Runs on the meta-device model, before `to_empty` and `init_weights`.

    Args:
        model: The Llama, on the meta device.
        dims: The validated parallel degrees.
        mesh: The job's mesh, or None for a single process (then only AC and compile apply).
        parallelism: The `[parallelism]` section.
        compile: The `[compile]` section.
        ac: The `[activation_checkpoint]` section.
        float8: The `[float8]` section.
        precision: `fp32`, or `bf16` (FSDP then all-gathers bf16 parameters and reduces in fp32).
        device: The device the model will compute on (activation offload copies to and from it).

    Returns:
        The same model, changed in place.

    Raises:
        ConfigError: A combination this version does not support (named in the message).
    """
    # The trainer's check_config runs the same checks before any allocation; these guard direct callers.
    check_combinations(
        dims,
        loss_chunk_size=getattr(model.args, "loss_chunk_size", 0),
        cpu_offload=parallelism.fsdp_cpu_offload,
    )
    # 1. float8: swap the linears before TP and FSDP see them.
    float8_tp = False
    if float8.enable:
        apply_float8(
            model,
            recipe=float8.recipe,
            emulate=float8.emulate,
            fsdp_float8_all_gather=float8.fsdp_float8_all_gather and dims.fsdp_enabled,
            filter_fqns=float8.filter_fqns,
            min_size=float8.min_size,
        )
        # torchao's float8 TP styles cast before the all-gather (tensorwise scaling only).
        float8_tp = float8.recipe == "tensorwise"

    # 2. Tensor parallel (with sequence parallel and loss parallel).
    if mesh is not None and dims.tp > 1:
        apply_llama_tp(
            model,
            mesh["tp"],
            sequence_parallel=parallelism.sequence_parallel,
            loss_parallel=parallelism.loss_parallel,
            float8=float8_tp,
        )
        if parallelism.async_tp:
            enable_async_tp(mesh["tp"], compiled=compile.enable)

    # 3. Context parallel: nothing changes in the modules. The trainer's context_parallel_step shards each
    #    batch over `cp` and swaps SDPA for ring attention during the step; FSDP below shards the weights
    #    over dp_shard x cp, since the cp ranks hold the same weights.

    # 4-5. Activation checkpointing, then compile (which traces the checkpointed blocks).
    apply_ac(
        model,
        mode=ac.mode,
        selective=ac.selective,
        op_matmuls=ac.op_matmuls,
        op_all_last=ac.op_all_last,
        offload_first=ac.offload_first,
        offload_every=ac.offload_every,
        compiled=compile.enable,
    )
    if compile.enable:
        backend = model.args.attn_backend
        fullgraph = compile.fullgraph and not uses_graph_break(backend, model.args.flash_in_graph)
        if compile.fullgraph and not fullgraph:
            logger.info(f"compile: attn_backend={backend} runs between compiled graphs (a break per block)")
        apply_compile(model, fullgraph=fullgraph)

    # 6. Data parallel: FSDP (or HSDP on a 2-D mesh), else plain DDP.
    if mesh is not None and dims.fsdp_enabled:
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
            reduce_dtype=torch.float32,
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
            keep_gathered_last=parallelism.fsdp_keep_gathered_last,
            cpu_offload=parallelism.fsdp_cpu_offload,
            free_reduce_inputs=parallelism.fsdp_free_reduce_inputs,
            grads_in_compute_pool=parallelism.fsdp_grads_in_compute_pool,
            copy_in_by_chunks=parallelism.fsdp_copy_in_by_chunks,
        )
    elif mesh is not None and dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])

    # 7. Activation offload of the first blocks (left unwrapped by AC above): its hooks go after FSDP's,
    #    which gather a block's parameters before the offload decides what to leave on the GPU.
    if ac.offload_first:  # (the trainer reads its traffic from the attribute)
        model.activation_offloader = apply_offload(
            model,
            ac.offload_first,
            device or torch.device("cuda"),
            every=ac.offload_every,
        )
    return model


def check_combinations(dims: ParallelDims, *, loss_chunk_size: int, cpu_offload: bool) -> None:
    """Combinations of the parallelisms with each other and with the loss that cannot work.

    Raises:
        ConfigError: naming the keys and the fix.
    """
    if dims.tp > 1 and loss_chunk_size > 0:
        raise ConfigError(
            "training.loss = chunked does not compose with parallelism.tp > 1; use training.loss = plain "
            "(with parallelism.loss_parallel the logits are already sharded over the vocabulary)"
        )
    if dims.ddp_enabled and dims.tp > 1:
        raise ConfigError(
            "DDP (dp_replicate > 1 with dp_shard = 1) does not compose with tensor parallel; set "
            "parallelism.dp_shard > 1 (FSDP, or HSDP with dp_replicate) together with tp"
        )
    if cpu_offload and not dims.fsdp_enabled:
        raise ConfigError("parallelism.fsdp_cpu_offload needs FSDP: parallelism.dp_shard > 1")


def llama_tp_plan(
    *, sequence_parallel: bool, loss_parallel: bool, float8: frozenset[str] = frozenset()
) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """The Llama TP plan: (plan for the top-level modules, plan for each transformer block).

    Column-wise wq/wk/wv/w1/w3 (each rank computes its heads and FFN units), row-wise wo/w2. Under
    sequence parallel the residual stream between blocks holds this rank's 1/tp of the sequence, as a
    plain local tensor (B, T/tp, dim) (so that pipeline stages send plain tensors): the norms run on
    their shard (`SequenceParallel`), attention and the FFN all-gather their input
    (`PrepareModuleInput`), wo and w2 reduce-scatter their output back to the sequence shard. The RoPE
    table and the attention mask pass through untouched: attention sees the whole sequence after the
    all-gather and slices the table to it.
    """
    seq = Shard(1)
    top: dict[str, ParallelStyle] = {
        # The table is split over the vocabulary; each rank looks up its ids and the sum over ranks is
        # reduce-scattered over the sequence (SP) or all-reduced.
        "tok_embeddings": SyncRowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate()
        ),
        "output": ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # float8: the parts ("attention", "feed_forward") whose linears are all Float8Linear shard and
    # all-gather in float8; a part with a bf16 linear (below float8.min_size) keeps the plain styles.
    styles = {
        part: (ColwiseParallel, RowwiseParallel, PrepareModuleInput) for part in ("attention", "feed_forward")
    }
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        for part in float8:
            styles[part] = (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)
    (a_col, a_row, a_prep), (f_col, f_row, f_prep) = styles["attention"], styles["feed_forward"]
    block: dict[str, ParallelStyle] = {
        "attention.wq": a_col(),
        "attention.wk": a_col(),
        "attention.wv": a_col(),
        "feed_forward.w1": f_col(),
        "feed_forward.w3": f_col(),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        block.update(
            {
                "attention_norm": SequenceParallel(),
                # forward(x, rope, mask): gather x over the sequence, pass rope and mask through.
                "attention": a_prep(
                    input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wo": a_row(output_layouts=seq),
                "ffn_norm": SequenceParallel(),
                "feed_forward": f_prep(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w2": f_row(output_layouts=seq),
            }
        )
    else:
        top["norm"] = ReplicateParallel()
        block.update(
            {
                "attention_norm": ReplicateParallel(),
                "attention.wo": a_row(),
                "ffn_norm": ReplicateParallel(),
                "feed_forward.w2": f_row(),
            }
        )
    return top, block


def _float8_parts(block: nn.Module) -> frozenset[str]:
    """The parts of a block whose linears are all float8; logs the ones that keep bf16 TP styles."""
    from torchao.float8.float8_linear import Float8Linear

    parts = set()
    for part in ("attention", "feed_forward"):
        linears = {n: m for n, m in getattr(block, part).named_modules() if isinstance(m, nn.Linear)}
        plain = sorted(n for n, m in linears.items() if not isinstance(m, Float8Linear))
        if plain:
            logger.info(f"float8 + TP: {part} keeps bf16 TP styles ({', '.join(plain)} not converted)")
        else:
            parts.add(part)
    return frozenset(parts)


def apply_llama_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
) -> None:
    """Shard the Llama over `tp_mesh` with `llama_tp_plan`, in place (on the meta device is fine).

    A tied embedding table stays one parameter: both the embedding (row-wise over the vocabulary) and
    the output projection (column-wise, i.e. over the vocabulary too) shard it as Shard(0), so after
    the plan the output takes the embedding's DTensor again.
    """
    emb, out = model.tok_embeddings, model.output
    tied = emb is not None and out is not None and emb.weight is out.weight
    parts = _float8_parts(next(iter(model.layers.values()))) if float8 else frozenset()
    top, block_plan = llama_tp_plan(
        sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, float8=parts
    )
    apply_tp_plan(model, tp_mesh, top)
    for block in model.layers.values():
        apply_tp_plan(block, tp_mesh, block_plan)
    if tied:
        assert model.output.weight.placements == model.tok_embeddings.weight.placements
        model.output.weight = model.tok_embeddings.weight
