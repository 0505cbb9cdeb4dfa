"""The run's plan: every decision derived from the config, made once, read by the trainer and the estimator.

`build_plan(cfg, world_size)` validates the config (`titanrush.run.validate`) and resolves what the config
leaves open or implies: the parallel degrees (`dp_shard = -1`), the model's arguments (flavor plus
overrides, K/V heads repeated under fp32 context parallel), gradient accumulation, ZeRO-2 for pipelined
stages, float8's all-gather, the compiled loss, the pipeline's micro-batches, stages per rank and the
layers of every stage. The trainer builds the run from the plan; `memory_model` counts the bytes of the
same plan, so the two cannot drift apart. Levers left to the planner ("auto") are resolved before this
(`autoplan`). Tests may construct a `RunPlan` directly.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from titanrush.config import ConfigError, JobConfig
from titanrush.interop.hf import model_args_at
from titanrush.models.llama import ModelArgs, model_args
from titanrush.models.llama.flavors import CUSTOM, ffn_sizing, shape_of
from titanrush.models.llama.parallelize import ParallelizePlan
from titanrush.models.llama.pipeline import stage_costs
from titanrush.models.llama4 import FLAVORS as LLAMA4_FLAVORS
from titanrush.models.llama4 import Llama4Args
from titanrush.models.llama4 import model_args as llama4_args
from titanrush.models.llama4.grouped_gemm import KERNEL as GROUPED_KERNEL
from titanrush.parallel.activation_checkpoint import ACPlan
from titanrush.parallel.compile import CompilePlan
from titanrush.parallel.context_parallel import CPPlan
from titanrush.parallel.float8 import Float8Plan
from titanrush.parallel.fsdp import FSDPPlan
from titanrush.parallel.parallel_dims import ParallelDims
from titanrush.parallel.pipeline import balanced_split, stage_ids, stages_per_rank
from titanrush.parallel.tensor_parallel import TPPlan
from titanrush.run import validate


@dataclass(frozen=True)
class RunPlan:
    """The resolved decisions of one run (see the module docstring).

    Run-level values are plain fields; each feature's settings are one object of the parallel module
    that applies them, under the feature's name (`float8`, `ac`, `compile`), or `<degree>_plan` where
    the bare name is the degree or FSDP's on/off (`fsdp_plan`, `tp_plan`, `cp_plan`).
    """

    args: ModelArgs
    local_batch: int
    seq_len: int
    precision: str = "fp32"
    accum: int = 1
    world_size: int = 1
    # Parallel degrees (dp_shard resolved; 1 everywhere = one device).
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel (Llama 4): borrowed from dp_shard
    moe_bias_rate: float = 0.0  # the routing bias's step per optimizer step (0: measure the load only)
    # Pipeline: the schedule, and the config's micro-batches / stages per rank / split (0 or () = derived;
    # the properties below resolve them).
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 0
    pp_layers_per_stage: tuple[int, ...] = ()
    # Each feature's settings, as in effect (FSDP: pipelined stages keep their weights gathered, `never`;
    # float8's all-gather under FSDP only; compile's fullgraph and overlap where the blocks allow them).
    fsdp_plan: FSDPPlan = FSDPPlan()
    tp_plan: TPPlan = TPPlan()
    cp_plan: CPPlan = CPPlan()
    ac: ACPlan = ACPlan()
    compile: CompilePlan = CompilePlan()
    float8: Float8Plan = Float8Plan()
    loss: str = "plain"
    loss_chunk: int = 4096
    optimizer: str = "adamw"
    optimizer_impl: str = "fused_clip"
    max_norm: float = 1.0

    # -- degrees ----------------------------------------------------------------------------------
    @functools.cached_property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.world_size, self.ep, self.moe_tp
        )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def fsdp_shard(self) -> int:
        """FSDP's shard degree (dp_shard x cp: the cp ranks hold the same weights), 1 without FSDP."""
        return self.dp_shard * self.cp if self.fsdp else 1

    @property
    def moe(self) -> bool:
        return isinstance(self.args, Llama4Args)

    @property
    def moe_tp(self) -> bool:
        """MoE layers under tensor parallel: the tp ranks are data-parallel ranks for them."""
        return self.moe and self.tp > 1

    @property
    def moe_by_parts(self) -> bool:
        """Whether per-op checkpointing takes the MoE blocks by parts (`wrap_moe_parts` in
        `parallel/activation_checkpoint.py`): where the MoE layer holds FSDP units of its own (the experts
        under EP, the layer under TP), whose hooks no per-op checkpointed region may hold."""
        return self.moe and (self.ep > 1 or self.moe_tp)

    @property
    def local_experts(self) -> bool:
        """Expert parallel over every data-parallel rank (no `efsdp` rank, HSDP replica, cp or tp rank
        shares an expert), compiled, without FSDP's CPU offload: the experts take no FSDP unit and cast
        and divide themselves (`parallel/expert_parallel.local_experts`). Compiled only: the compiled
        graph casts the weights again in backward, where eager autograd would keep every layer's cast."""
        alone = self.dp_replicate == 1 and self.dp_shard == self.ep and self.cp == 1 and not self.moe_tp
        return self.moe and self.ep > 1 and alone and self.compile.enable and not self.fsdp_plan.cpu_offload

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp

    # -- precision and loss ---------------------------------------------------------------------
    @property
    def c(self) -> int:
        """Bytes per element of the compute dtype (matmul outputs, attention)."""
        return 2 if self.precision == "bf16" else 4

    @property
    def autocast(self) -> bool:
        """bf16 without FSDP runs under autocast (FSDP casts through its mixed-precision policy)."""
        return self.precision == "bf16" and not self.fsdp

    @property
    def r(self) -> int:
        """Bytes per element of the residual stream (bf16 only when FSDP gathers bf16 weights)."""
        return 2 if self.precision == "bf16" and self.fsdp else 4

    @property
    def vocab_parallel_loss(self) -> bool:
        """Tensor parallel with loss parallel: the plain loss on the vocabulary-sharded logits
        (`titanrush.models.llama.loss.vocab_parallel_cross_entropy_sum`)."""
        return self.loss == "plain" and self.tp > 1 and self.tp_plan.loss_parallel

    @property
    def compiled_loss(self) -> bool:
        """The plain loss is compiled with the blocks, except under loss parallel (its own function)."""
        return self.compile.enable and self.loss == "plain" and not self.vocab_parallel_loss

    @property
    def parallelize_plan(self) -> ParallelizePlan:
        """What `parallelize_llama` applies to the model: the degrees and the features' plans."""
        return ParallelizePlan(
            dims=self.dims,
            precision=self.precision,
            float8=self.float8,
            tp_plan=self.tp_plan,
            ac=dataclasses.replace(self.ac, moe_by_parts=self.moe_by_parts),
            compile=self.compile,
            fsdp_plan=self.fsdp_plan,
            local_experts=self.local_experts,
        )

    @property
    def tokens_per_gpu_step(self) -> float:
        """Tokens of one optimizer step per GPU: each token counts once per data-parallel replica, spread
        over the GPUs (cp x tp x pp) that hold that replica."""
        return self.local_batch * self.seq_len * self.accum / (self.cp * self.tp * self.pp)

    # -- pipeline -------------------------------------------------------------------------------
    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        return stages_per_rank(self.pp_schedule, self.pp_stages_per_rank)

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def microbatches(self) -> int:
        if self.pp == 1:
            return 1
        return self.pp_microbatches or self.n_stages

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """Layers of each pipeline stage: the config's split, or the balanced one (embedding and output
        projection costed in blocks)."""
        if self.n_stages == 1:  # (a split in the config applies to pipelines only)
            return (self.args.n_layers,)
        if self.pp_layers_per_stage:
            return self.pp_layers_per_stage
        embed, output = stage_costs(self.args)
        return tuple(balanced_split(self.args.n_layers, self.n_stages, embed_cost=embed, output_cost=output))

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs."""
        return stage_ids(self.pp_schedule, pp_rank, self.pp, self.stages_per_rank)

    def stage_layers(self, stage: int) -> range:
        """The layer indices of pipeline stage `stage`."""
        sizes = self.layers_per_stage
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])


def resolve_model_args(cfg: JobConfig) -> ModelArgs:
    """The flavor's arguments with the config's overrides (`validate.check_values` has checked the keys).

    A custom shape starts from `model.from_checkpoint`'s arguments (or `flavors.CUSTOM_BASE`), and every
    [model] dimension that is set replaces the field it names.
    """
    m, t = cfg.model, cfg.training
    # The RoPE table holds one row per position of the run's sequence: context parallel shards it with the
    # batch (every pipeline stage's table, in the tokens' layout), which needs exactly seq_len rows.
    over: dict[str, object] = {"attn_backend": m.attn_backend, "rope_positions": t.seq_len}
    if m.vocab_size:
        over["vocab_size"] = m.vocab_size
    if m.tie_embeddings != "flavor":
        over["tie_embeddings"] = m.tie_embeddings == "tied"
    if m.max_seq_len:
        over["max_seq_len"] = m.max_seq_len
    if t.loss == "chunked":
        over["loss_chunk_size"] = t.loss_chunk_size
        over["compile_loss"] = cfg.compile.enable
    if cfg.parallelism.cp > 1 and t.precision == "fp32":
        # The ring's fp32 kernel (memory-efficient attention) takes one K/V head per query head; in bf16
        # cuDNN and flash take grouped heads, and the ring moves n_heads / n_kv_heads times less K/V.
        over["expand_kv"] = True
    if m.flavor in LLAMA4_FLAVORS:
        return llama4_args(m.flavor, **over, grouped_mm=cfg.moe.grouped_mm)
    if m.flavor != CUSTOM:
        return model_args(m.flavor, **over)
    if m.from_checkpoint:
        try:
            base = model_args_at(m.from_checkpoint)
        except ConfigError as e:
            raise ConfigError(f"model.from_checkpoint = {m.from_checkpoint!r}: {e}") from None
        if isinstance(base, Llama4Args):
            raise ConfigError(
                f"model.from_checkpoint = {m.from_checkpoint!r} holds a Llama 4 (mixture-of-experts) model, "
                "and model.flavor = 'custom' shapes dense Llamas only: train from it with its Llama 4 flavor "
                "(model.flavor, as `titanrush convert --from-hf` printed) and checkpoint.load_path"
            )
        over = {**shape_of(base), **over}
    for key in validate.ARCHITECTURE_KEYS:
        if key != "ffn_hidden" and getattr(m, key):  # 0: keep the checkpoint's (or CUSTOM_BASE's)
            over[key] = getattr(m, key)
    if m.rope_scaling != "flavor":
        over["rope_scaling"] = m.rope_scaling == "llama3"
    args = model_args(CUSTOM, **over)
    if m.ffn_hidden:  # the width itself (Hugging Face's intermediate_size): Meta's sizing that gives it
        multiple_of, multiplier = ffn_sizing(args.dim, m.ffn_hidden)
        args = dataclasses.replace(args, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
    return args


def _moe_decisions(cfg: JobConfig, args: ModelArgs, accum: int, microbatches: int, tp: int) -> ModelArgs:
    """Llama 4: the router losses' weights per micro-batch (the coefficients are per optimizer step, whose
    loss is the mean over accum x pipeline micro-batches). Under tensor and sequence parallel each tp rank
    routes 1/tp of the tokens and the router's gradients are summed over the tp ranks: both losses (each a
    mean over its shard's tokens, the balance loss's counts summed over the shards) weigh 1/tp on each."""
    if not isinstance(args, Llama4Args):
        return args
    per = accum * microbatches * (tp if cfg.parallelism.sequence_parallel else 1)
    return dataclasses.replace(
        args, aux_loss_weight=cfg.moe.aux_loss_coeff / per, z_loss_weight=cfg.moe.z_loss_coeff / per
    )


def _moe_compiles_whole(args: ModelArgs, ep: int, tp: int, precision: str) -> bool:
    """Whether a MoE block compiles as one graph: not across expert parallel's all-to-alls (their splits
    are host values), nor around the MoE layer's own FSDP unit under tensor parallel, nor around the
    per-expert loop (the grouped kernel's fallback reads the counts on
    the host), which runs wherever the kernel is missing or the experts compute in fp32 (compiled, the
    kernel takes bf16 only)."""
    if not isinstance(args, Llama4Args):
        return True
    return ep == 1 and tp == 1 and args.grouped_mm and GROUPED_KERNEL is not None and precision == "bf16"


def build_plan(cfg: JobConfig, world_size: int, *, machine: bool = True) -> RunPlan:
    """Validate `cfg` for `world_size` processes and resolve every decision of the run.

    Args:
        cfg: The job config.
        world_size: The number of processes (GPUs) of the job.
        machine: Also check what this machine must provide (CUDA for context parallel, flash-attn's
            package, float8 tensor cores); the estimator plans for another machine and passes False.

    Raises:
        ConfigError: naming the key and the fix.
    """
    validate.check_values(cfg)
    if auto := validate.auto_levers(cfg):
        raise ConfigError(
            f"{auto[0]} = 'auto' is chosen before the plan is built (titanrush.run.autoplan.resolve, which "
            "titanrush train and titanrush estimate run): resolve the config first, or set a value"
        )
    p, t, ac, f8 = cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.float8
    validate.check_degrees(p, world_size)
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world_size, p.ep)
    args = resolve_model_args(cfg)
    validate.check_run(cfg, dims, args)
    if machine:
        validate.check_machine(cfg)
    per_step = t.local_batch_size * dims.dp
    accum = (t.global_batch_size if t.global_batch_size != -1 else per_step) // per_step
    reshard = p.fsdp_reshard_after_forward
    if dims.pp > 1 and reshard == "default":
        # Each micro-batch runs forward again: re-gathering the weights for each would cost more than it
        # saves, so pipelined stages keep them gathered until backward (ZeRO-2).
        reshard = "never"
    fullgraph = cfg.compile.fullgraph and not (cfg.compile.enable and _graph_break(args.attn_backend))
    fullgraph = fullgraph and _moe_compiles_whole(args, dims.ep, dims.tp, t.precision) and not f8.experts
    pp_micro = (
        (p.pp_microbatches or dims.pp * stages_per_rank(p.pp_schedule, p.pp_stages_per_rank))
        if dims.pp > 1
        else 1
    )
    f8_all_gather = (
        f8.enable and f8.recipe == "tensorwise" and f8.fsdp_float8_all_gather and dims.fsdp_enabled
    )
    float8_filter = (
        (*f8.filter_fqns, "router.gate") if isinstance(args, Llama4Args) else tuple(f8.filter_fqns)
    )
    return RunPlan(
        args=_moe_decisions(cfg, args, accum, pp_micro, dims.tp),
        local_batch=t.local_batch_size,
        seq_len=t.seq_len,
        precision=t.precision,
        accum=accum,
        world_size=world_size,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        cp=dims.cp,
        tp=dims.tp,
        pp=dims.pp,
        ep=dims.ep,
        moe_bias_rate=cfg.moe.bias_update_rate if isinstance(args, Llama4Args) else 0.0,
        pp_schedule=p.pp_schedule,
        pp_microbatches=p.pp_microbatches,
        pp_stages_per_rank=p.pp_stages_per_rank,
        pp_layers_per_stage=tuple(p.pp_layers_per_stage),
        fsdp_plan=FSDPPlan(
            reshard=reshard, keep_gathered_last=p.fsdp_keep_gathered_last, cpu_offload=p.fsdp_cpu_offload
        ),
        tp_plan=TPPlan(sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel),
        cp_plan=CPPlan(rotate=p.cp_rotate_method),
        ac=ACPlan(
            mode=ac.mode,
            selective=ac.selective,
            op_matmuls=ac.op_matmuls,
            op_all_last=ac.op_all_last,
            offload_first=ac.offload_first,
            offload_every=ac.offload_every,
        ),
        compile=CompilePlan(
            enable=cfg.compile.enable,
            fullgraph=fullgraph,
            overlap_collectives=cfg.compile.enable and cfg.compile.overlap_collectives and dims.tp > 1,
            async_tp=cfg.experimental.async_tp,
        ),
        float8=Float8Plan(
            enable=f8.enable,
            recipe=f8.recipe,
            emulate=f8.emulate,
            all_gather=f8_all_gather,  # (torchao's float8 all-gather: tensorwise scaling, under FSDP)
            filter_fqns=float8_filter,  # (a MoE's router stays in bf16: it ranks near-equal scores)
            min_size=f8.min_size,
            experts=f8.experts,
        ),
        loss=t.loss,
        loss_chunk=t.loss_chunk_size,
        optimizer=cfg.optimizer.name,
        optimizer_impl=cfg.optimizer.implementation,
        max_norm=t.max_norm,
    )


def _graph_break(backend: str) -> bool:
    """Whether blocks with this attention backend compile with a graph break (flash-attn's FA3 or FA2).
    Where no flash-attn package is installed (a plan for another machine), flash-attn-4 is assumed."""
    if backend != "flash" or not validate.flash_installed():
        return False
    from titanrush.models.llama.flash import uses_graph_break  # (imports the package)

    return uses_graph_break(backend)


def describe_mesh(plan: RunPlan) -> str:
    """`dp_shard=4 tp=2`-style description of the degrees above 1, or `single device`."""
    degrees = [(n, getattr(plan, n)) for n in ("dp_replicate", "dp_shard", "ep", "cp", "tp", "pp")]
    return " ".join(f"{n}={d}" for n, d in degrees if d > 1) or "single device"
