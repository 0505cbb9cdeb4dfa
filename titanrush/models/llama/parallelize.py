"""The ONE place that fixes the order of parallelisms for the Llama, and its tensor-parallel plan.

Order: float8 -> TP -> EP -> CP -> AC -> compile -> FSDP/HSDP or DDP -> activation offload, because
- float8 swaps `nn.Linear` for float8 linears, which the TP styles and FSDP then shard as they are;
- TP rewrites parameters into DTensors on the `tp` mesh, which FSDP then shards again over `dp` (2-D);
- EP (Llama 4) does the same for the routed experts on the `ep` mesh, and wraps their forward in the
  all-to-all dispatch and combine, before AC and compile so that both see the exchange as part of the
  block; FSDP then shards the experts in their own units over the data-parallel ranks outside EP;
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
from dataclasses import dataclass

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

from titanrush.models.llama4 import Llama4Args
from titanrush.parallel.activation_checkpoint import ACPlan, apply_ac, checkpointed
from titanrush.parallel.activation_offload import ActivationOffloader, apply_offload
from titanrush.parallel.compile import CompilePlan, apply_compile
from titanrush.parallel.ddp import apply_ddp
from titanrush.parallel.expert_parallel import apply_ep, local_experts, shard_experts
from titanrush.parallel.float8 import Float8Plan, apply_float8, apply_float8_experts
from titanrush.parallel.fsdp import FSDPPlan, apply_fsdp
from titanrush.parallel.parallel_dims import JobMesh, ParallelDims
from titanrush.parallel.tensor_parallel import (
    ReplicateParallel,
    SyncRowwiseParallel,
    TPPlan,
    apply_tp_plan,
    enable_async_tp,
    sum_output_over,
)

logger = logging.getLogger("titanrush")


@dataclass(frozen=True)
class ParallelizePlan:
    """What `parallelize_llama` applies: the degrees, the compute precision and each feature's own plan
    (the run's plan gathers them: `titanrush.run.plan.RunPlan.parallelize_plan`)."""

    dims: ParallelDims
    precision: str = "fp32"  # bf16: FSDP gathers bf16 weights (the sharded masters stay fp32)
    float8: Float8Plan = Float8Plan()
    tp_plan: TPPlan = TPPlan()
    ac: ACPlan = ACPlan()
    compile: CompilePlan = CompilePlan()
    fsdp_plan: FSDPPlan = FSDPPlan()
    local_experts: bool = False  # the experts take no FSDP unit (`RunPlan.local_experts`)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32


def parallelize_llama(
    model: nn.Module, mesh: JobMesh | None, plan: ParallelizePlan, *, device: torch.device | None = None
) -> ActivationOffloader | None:
    """Apply float8, TP, EP, CP, AC, compile and FSDP/HSDP or DDP to a Llama, in that order, in place.

    Runs on the meta-device model, before `to_empty` and `init_weights`.

    Args:
        model: The Llama (or one pipeline stage of it), on the meta device.
        mesh: The job's mesh, or None for a single process (then only AC and compile apply).
        plan: The degrees and each feature's settings (validated where the run's plan was built).
        device: The device the model will compute on (activation offload copies to and from it).

    Returns:
        The activation offloader (its traffic is logged) where the plan offloads blocks, else None.
    """
    dims = plan.dims
    # 1. float8: swap the linears before TP and FSDP see them (the experts' grouped GEMMs: a flag).
    if plan.float8.enable:
        apply_float8(model, plan.float8)

    experts = {k: b.moe.experts for k, b in model.layers.items() if getattr(b, "moe", None) is not None}
    if plan.float8.experts:
        apply_float8_experts(list(experts.values()))

    # 2. Tensor parallel (with sequence parallel and loss parallel).
    if mesh is not None and dims.tp > 1:
        apply_llama_tp(model, mesh["tp"], plan.tp_plan, float8=plan.float8.tp_styles)
        if plan.compile.async_tp:  # (Inductor fuses the collectives with the matmuls when it compiles)
            enable_async_tp(mesh["tp"])

    # 2b. Expert parallel (Llama 4): each rank keeps E / ep of every MoE layer's routed experts.
    if mesh is not None and dims.ep > 1:
        apply_ep(list(experts.values()), mesh["ep"])

    # 3. Context parallel: nothing changes in the modules (the plan built them with K/V heads repeated
    #    for ring attention). The trainer's context_parallel_step shards each batch over `cp` and swaps
    #    SDPA for ring attention during the step; FSDP below shards the weights over dp_shard x cp, since
    #    the cp ranks hold the same weights.

    # 3b. Llama 4's balance loss counts each sequence's choices per expert: where a rank routes only its
    #     shard of every sequence (the tp ranks under sequence parallel, the cp ranks), the routers' counts
    #     are summed over those ranks (`models/llama4/router.balance_loss`).
    if mesh is not None and experts and getattr(model.args, "aux_loss_weight", 0.0):
        split = {"tp": dims.tp > 1 and plan.tp_plan.sequence_parallel, "cp": dims.cp > 1}
        for name in (n for n, on in split.items() if on):
            for key in experts:
                sum_output_over(model.layers[key].moe.router, mesh[name], "seq_counts")

    # 4-5. Activation checkpointing, then compile (which traces the checkpointed blocks).
    apply_ac(model, plan.ac, compiled=plan.compile.enable)
    if plan.compile.enable:
        if not plan.compile.fullgraph:
            what = (
                "the MoE layers' exchange or per-expert loop"
                if isinstance(model.args, Llama4Args)
                else f"attn_backend={model.args.attn_backend}"
            )
            logger.info(f"compile: {what} runs between compiled graphs")
        apply_compile(model, plan.compile)

    # 6. Data parallel: FSDP (or HSDP on a 2-D mesh), else plain DDP. Mixture-of-experts layers first
    #    (inner units): the experts under EP over the ranks that are not EP peers; under TP the whole
    #    MoE layer over the tp ranks too (each routes its own tokens), even where nothing else is FSDP;
    #    where EP spans every data-parallel rank (compiled), the experts take no unit (local experts).
    inner: dict[str, list[nn.Module]] = {}
    ignored: set[nn.Parameter] = set()
    if mesh is not None and (dims.fsdp_enabled or dims.moe_tp) and experts:
        inner, ignored = _shard_moe_layers(model, mesh, plan, experts)
    if mesh is not None and dims.fsdp_enabled:
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]
        apply_fsdp(
            model,
            dp_mesh,
            plan.fsdp_plan,
            param_dtype=plan.param_dtype,
            inner_units=inner or None,
            ignored=ignored,
        )
    elif mesh is not None and dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])

    # 7. Activation offload of the first blocks (left unwrapped by AC above): its hooks go after FSDP's,
    #    which gather a block's parameters before the offload decides what to leave on the GPU.
    if plan.ac.offload_first:
        return apply_offload(
            model, plan.ac.offload_first, device or torch.device("cuda"), every=plan.ac.offload_every
        )
    return None


def _shard_moe_layers(
    model: nn.Module, mesh: JobMesh, plan: ParallelizePlan, experts: dict[str, nn.Module]
) -> tuple[dict[str, list[nn.Module]], set[nn.Parameter]]:
    """FSDP units of their own inside the MoE blocks: (block key -> those units in the order they run,
    the parameters FSDP's units leave alone).

    Where expert parallel spans every data-parallel rank (`RunPlan.local_experts`), the experts take no
    unit: they cast and divide themselves (`expert_parallel.local_experts`).

    With EP the experts' units span the data-parallel ranks that are not EP peers (`efsdp_cp`). Under TP
    (`dims.moe_tp`) the tp ranks are data-parallel ranks for the MoE layer: its router and shared expert
    (and the experts without EP) take a unit over `dp_shard_cp_tp`, the experts with EP one over
    `efsdp_cp_tp`. Gradients are summed over the tp ranks where each routed its own sequence shard
    (sequence parallel), averaged where all routed the same tokens, and averaged over data parallel.
    """
    dims, fsdp = plan.dims, plan.dims.fsdp_enabled
    hsdp = dims.dp_replicate > 1 and fsdp
    over_tp = dims.tp if dims.moe_tp and not plan.tp_plan.sequence_parallel else 1
    common = dict(
        divide_factor=dims.dp * dims.cp * over_tp,
        param_dtype=plan.param_dtype if fsdp else None,
        reshard_after_forward=plan.fsdp_plan.reshard != "never",
        cpu_offload=plan.fsdp_plan.cpu_offload,
    )

    def over(name: str) -> DeviceMesh:
        return mesh["dp_replicate", name] if hsdp else mesh[name]

    if plan.local_experts:
        logger.info(
            "expert parallel spans every data-parallel rank: the experts take no FSDP unit (each rank casts"
            " its own to the compute dtype and divides their gradients)"
        )
        divisor = common["divide_factor"]
        recast = [not checkpointed(model.layers[key]) for key in experts]
        return {}, local_experts(
            list(experts.values()), compute_dtype=common["param_dtype"], grad_divisor=divisor, recast=recast
        )
    inner: dict[str, list[nn.Module]] = {key: [] for key in experts}
    if dims.ep > 1:  # (inner modules are sharded before the modules around them)
        shard_experts(list(experts.values()), over("efsdp_cp_tp" if dims.moe_tp else "efsdp_cp"), **common)
        inner = {key: [module] for key, module in experts.items()}
    if dims.moe_tp:  # the layer's unit runs first (its router, before the experts)
        layers = {key: model.layers[key].moe for key in experts}
        shard_experts(list(layers.values()), over("dp_shard_cp_tp"), **common)
        inner = {key: [layers[key], *inner[key]] for key in experts}
    return {key: units for key, units in inner.items() if units}, set()


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
                # Llama 4's MoE layer routes this rank's sequence shard: it takes it as a local tensor
                # (the tp ranks are data-parallel ranks for it: `_shard_moe_layers`).
                "moe": PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=True
                ),
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


def _float8_parts(blocks: list[nn.Module]) -> frozenset[str]:
    """The parts of the blocks whose linears are all float8; logs the ones that keep bf16 TP styles.

    A part a block lacks (a Llama 4 MoE block has no `feed_forward`) is judged by the blocks that have it.
    """
    from torchao.float8.float8_linear import Float8Linear

    parts = set()
    for part in ("attention", "feed_forward"):
        modules = [m for b in blocks if (m := getattr(b, part, None)) is not None]
        linears = [(n, m) for mod in modules for n, m in mod.named_modules() if isinstance(m, nn.Linear)]
        plain = sorted({n for n, m in linears if not isinstance(m, Float8Linear)})
        if plain:
            logger.info(f"float8 + TP: {part} keeps bf16 TP styles ({', '.join(plain)} not converted)")
        elif modules:
            parts.add(part)
    return frozenset(parts)


def apply_llama_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, float8: bool = False) -> None:
    """Shard the Llama over `tp_mesh` with `llama_tp_plan`, in place (on the meta device is fine).

    `float8`: torchao's float8 styles for the parts whose linears are all float8 (`Float8Plan.tp_styles`).
    A tied embedding table stays one parameter: both the embedding (row-wise over the vocabulary) and
    the output projection (column-wise, i.e. over the vocabulary too) shard it as Shard(0), so after
    the plan the output takes the embedding's DTensor again.
    """
    emb, out = model.tok_embeddings, model.output
    tied = emb is not None and out is not None and emb.weight is out.weight
    parts = _float8_parts(list(model.layers.values())) if float8 else frozenset()
    top, block_plan = llama_tp_plan(
        sequence_parallel=plan.sequence_parallel, loss_parallel=plan.loss_parallel, float8=parts
    )
    apply_tp_plan(model, tp_mesh, top)
    for block in model.layers.values():
        apply_tp_plan(block, tp_mesh, block_plan)
    if tied:
        assert model.output.weight.placements == model.tok_embeddings.weight.placements
        model.output.weight = model.tok_embeddings.weight
