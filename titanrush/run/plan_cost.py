"""The planner's cost model: how much longer a step takes under one plan than the same step with nothing
recomputed, nothing re-gathered, nothing moved to the host and no model parallel.

Plans that compute the same update differ in what they do besides the step's own FLOPs: activation
checkpointing runs part of each block's forward again in backward, ZeRO-3 gathers the weights a second time
for backward, the chunked loss runs its chunks one after another, activation offload copies activations
over the host link, and FSDP's CPU offload moves the sharded states across it and steps the optimizer on
the CPU. The mesh adds its own (`mesh_s`): tensor parallel's collectives, the pipeline's bubble, context
parallel's ring exchange beyond the attention it overlaps, FSDP's gathers beyond the compute that hides
them. Each is converted to seconds per optimizer step per GPU with the constants below; the planner ranks
plans by the sum (`Cost.extra_s`), and only the ranking matters. Each constant says where it comes from;
docs/auto_plan.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanrush.parallel.activation_checkpoint import OP_MATMULS
from titanrush.parallel.activation_offload import offloaded
from titanrush.run import memory_model as mm
from titanrush.run import memory_moe as moe
from titanrush.run.plan import RunPlan

# Dense matmul rate of one GPU, FLOP/s: an H200's bf16 cuBLAS GEMMs at the 8B's shapes run at about
# 790 TFLOP/s (of 989 peak); fp32 (no TF32) about 60 of its 67 (metrics.GPU_PEAKS).
MATMUL_FLOPS = {"bf16": 790e12, "fp32": 60e12}
# The share of that rate a training step reaches: the 8B on FSDP 4, compiled, about 9,500 tokens/s per GPU
# at about 51 GFLOP/token (causal attention) is 480 TFLOP/s (docs/benchmarks/performance.md).
STEP_UTILIZATION = 0.6
# A block's element-wise ops (RMSNorm, RoPE, SiLU, the gating product, residual adds) against its matmuls
# and attention, in time: selective `op` recomputes only them, and ran at 99% of no checkpointing's tokens/s
# on the 1B (docs/parallelism.md, Measured).
ELEMENTWISE_SHARE = 0.03
# All-gather bandwidth per GPU (NCCL's bus bandwidth): NVLink 4 within a node of 8 H100/H200 SXM GPUs,
# about 350 GB/s (nccl-tests all_gather_perf); across nodes one 400 Gb/s InfiniBand NIC per GPU.
NVLINK_BYTES_S = 350e9
NETWORK_BYTES_S = 45e9
GPUS_PER_NODE = 8
# The share of ZeRO-3's second all-gather (in backward) that shows in the step: the 1B on 4 H200s ran at 96%
# of ZeRO-2's tokens/s (docs/parallelism.md), about the re-gather's whole time, so none of it is counted as
# hidden behind compute.
REGATHER_EXPOSED = 1.0
# Host link, each direction: PCIe 5 x16, about 50 GB/s measured for pinned copies on an H200 (an 8B block's
# activations take about 30 ms against its 13 ms of compute: activation_checkpoint.offload_every).
HOST_LINK_BYTES_S = 50e9
# FSDP's CPU offload steps AdamW on the host: about 1e9 parameters/s for torch's AdamW on a server's cores
# (an assumption, not measured here: the CPU's cores and memory bandwidth decide it).
CPU_ADAM_PARAMS_S = 1e9
# The chunked loss ran at the same speed as the plain one on the 8B (FSDP 4, compiled); counted as 0.2% of
# the step, so that the plain loss is kept where memory does not call for the chunked one.
CHUNKED_LOSS_SHARE = 0.002
# Tensor parallel's collectives per block and micro-batch (sequence parallel: an all-gather before attention
# and the MLP, a reduce-scatter after each, in forward and again in backward; without it two all-reduces
# each way, the same bytes), each of the micro-batch's activations; a block recomputed in full runs its
# forward's four again. On the critical path (async TP, which overlaps them, is not counted).
TP_COLLECTIVES = 8
# Zero-bubble schedules fill most of 1F1B's bubble with the weight-gradient passes (Qi et al., 2023);
# counted as a third of it (not measured here).
ZERO_BUBBLE_SHARE = 1 / 3


@dataclass(frozen=True)
class Cost:
    """Seconds per optimizer step per GPU: the step's own compute and what a plan adds to it."""

    compute_s: float  # the forward and backward FLOPs, the same under every plan
    recompute_s: float = 0.0  # activation checkpointing's forward run again
    regather_s: float = 0.0  # ZeRO-3's second all-gather, not hidden
    host_s: float = 0.0  # activation offload's copies not hidden, CPU offload's traffic
    cpu_step_s: float = 0.0  # CPU offload's optimizer step on the host
    loss_s: float = 0.0  # the chunked loss's chunks
    mesh_s: float = 0.0  # TP's collectives, the pipeline's bubble, CP's ring and FSDP's gathers, not hidden

    @property
    def extra_s(self) -> float:
        return self.recompute_s + self.regather_s + self.host_s + self.cpu_step_s + self.loss_s + self.mesh_s

    @property
    def relative(self) -> float:
        """What the plan adds, as a share of the step's compute."""
        return self.extra_s / self.compute_s if self.compute_s else 0.0


def _block_matmuls(s: RunPlan, layer: int) -> list[int]:
    """Forward FLOPs per token of each matmul of block `layer`, in the order the block runs them (the
    order `activation_checkpoint.OP_MATMULS` counts): wq, wk, wv, wo, then w1, w3, w2; a MoE layer's
    router and shared expert (its routed experts' grouped GEMMs are kept by every `op` policy)."""
    a = s.args
    d, q, kv = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    attention = [2 * d * q, 2 * d * kv, 2 * d * kv, 2 * q * d]
    if not moe.is_moe(s, layer):
        return attention + [2 * d * a.ffn_hidden] * 3
    shared = [2 * d * a.expert_hidden] * 3 if a.shared_expert else []
    return attention + [2 * d * a.n_experts] + shared


def _block_flops(s: RunPlan, layer: int) -> float:
    """Block `layer`'s forward FLOPs per token."""
    a = s.args
    span = s.seq_len
    chunk = getattr(a, "attn_chunk", 0)
    if chunk and a.uses_rope(layer):
        span = min(span, chunk)
    attention = 2 * a.n_heads * a.head_dim * span  # QK^T and PV over the causal half
    experts = 0
    if moe.is_moe(s, layer):  # the routed experts: top_k of them per token
        experts = 3 * 2 * a.dim * a.expert_hidden * a.top_k
    return sum(_block_matmuls(s, layer)) + experts + attention


def _recomputed(s: RunPlan, layer: int, position: int) -> float:
    """Forward FLOPs per token that block `layer` runs again in backward (its `position` on the rank
    decides every N-th block), its element-wise ops counted as `ELEMENTWISE_SHARE` of its FLOPs."""
    whole = _block_flops(s, layer)
    if offloaded(layer, s.ac.offload_first, s.ac.offload_every):  # compiled: op keeping every matmul output
        return ELEMENTWISE_SHARE * whole if s.compile.enable else 0.0
    mode = mm.layer_mode(s, position, as_traced=False, layer=layer)
    if mode == "full":
        return (1 + ELEMENTWISE_SHARE) * whole
    if mode not in ("op", "parts"):
        return 0.0
    recompute = OP_MATMULS["all" if mm.keeps_all_matmuls(s, layer) else s.ac.op_matmuls]
    # (by parts the policy counts the attention's matmuls only: the router and shared expert keep theirs)
    counted = 4 if mode == "parts" else None
    again = sum(f for k, f in enumerate(_block_matmuls(s, layer)[:counted], 1) if recompute(k))
    return ELEMENTWISE_SHARE * whole + again


def _rate(s: RunPlan) -> float:
    return MATMUL_FLOPS["bf16" if s.precision == "bf16" else "fp32"] * STEP_UTILIZATION


def _link(s: RunPlan) -> float:
    """FSDP's all-gather bandwidth: NVLink while its group (dp_shard x cp, with tp inside) fits a node."""
    return NVLINK_BYTES_S if s.fsdp_shard * s.tp <= GPUS_PER_NODE else NETWORK_BYTES_S


def _block_params(s: RunPlan, layers: list[int]) -> int:
    """Parameters of these blocks on one tp rank (the rank's experts under expert parallel), unsharded."""
    plan = mm.RankPlan(0, layers, embedding=False, head=False, in_flight=1.0, microbatch=1)
    return sum(d0 * d1 for _, (d0, d1), _ in mm.param_shapes(s, plan))


def _local_params(s: RunPlan) -> int:
    """Parameters FSDP keeps on the busiest pipeline rank, sharded: what CPU offload moves and steps."""
    return max(
        sum(mm.shard_numel(shape, moe.fsdp_degree(s, name)) for name, shape, _ in mm.param_shapes(s, p))
        for p in mm.rank_plans(s)
    )


def _regathered(s: RunPlan) -> list[int]:
    """The blocks whose weights FSDP gathers again for backward (ZeRO-3)."""
    n = s.args.n_layers
    if not s.fsdp or s.fsdp_plan.reshard == "never":
        return []
    if s.fsdp_plan.reshard == "always":
        return list(range(n))
    return list(range(max(n - 1 - s.fsdp_plan.keep_gathered_last, 0)))  # the last block(s) stay gathered


def _offload_bytes(s: RunPlan, layer: int) -> int:
    """What an offloaded block keeps for backward, per micro-batch: compiled, every matmul output (the
    `op` policy the offload wraps it in); eager, everything."""
    batch = max(s.local_batch // s.microbatches, 1)
    mode = "op" if s.compile.enable else "none"
    saved = mm.block_saved(s, batch * s.seq_len // s.cp, batch, mode, keep_all=True, layer=layer)
    return sum(saved.values())


def step_cost(s: RunPlan) -> Cost:
    """The cost of plan `s` (see the module docstring), per optimizer step and GPU."""
    a = s.args
    rate = _rate(s)
    tokens = s.tokens_per_gpu_step  # (1/pp of the layers, 1/tp of each matmul, 1/cp of the sequence)
    micro = s.accum * s.microbatches  # forward and backward passes of a rank's blocks per step
    blocks = [_block_flops(s, i) for i in range(a.n_layers)]
    compute = 3 * (sum(blocks) + 2 * a.dim * a.vocab_size) * tokens / rate  # backward: twice forward
    per_rank = max(round(a.n_layers / s.pp), 1)
    recompute = sum(_recomputed(s, i, i % per_rank) for i in range(a.n_layers)) * tokens / rate
    shard = s.fsdp_shard
    gathered = 1 if s.float8.all_gather else s.c  # bytes per parameter FSDP gathers
    regather = _block_params(s, _regathered(s)) / s.pp * gathered * (shard - 1) / shard * micro / _link(s)
    host = 0.0
    # Activation offload: each offloaded block's copy out hides behind the forward of the blocks up to
    # the next offloaded one, its copy back behind their backward (twice the FLOPs).
    mb_tokens = s.local_batch / s.microbatches * s.seq_len / (s.cp * s.tp)  # per micro-batch, as FLOPs
    for i in range(a.n_layers):
        if offloaded(i, s.ac.offload_first, s.ac.offload_every):
            copy = _offload_bytes(s, i) / HOST_LINK_BYTES_S
            behind = s.ac.offload_every * blocks[i] * mb_tokens / rate
            host += (max(copy - behind, 0.0) + max(copy - 2 * behind, 0.0)) * micro
    cpu_step = 0.0
    if s.fsdp_plan.cpu_offload:  # fp32 shards in for each gather, gradients out; AdamW on the host
        local = _local_params(s)
        gathers = 2 if s.fsdp_plan.reshard != "never" else 1
        host += 4 * local * (gathers + 1) * micro / HOST_LINK_BYTES_S
        cpu_step = local / CPU_ADAM_PARAMS_S
    return Cost(
        compute_s=compute,
        recompute_s=recompute,
        regather_s=REGATHER_EXPOSED * regather,
        host_s=host,
        cpu_step_s=cpu_step,
        loss_s=CHUNKED_LOSS_SHARE * compute if s.loss == "chunked" else 0.0,
        mesh_s=_mesh_s(s, blocks, compute, per_rank),
    )


def _mesh_s(s: RunPlan, blocks: list[float], compute: float, per_rank: int) -> float:
    """What the mesh adds to a step (seconds per optimizer step per GPU): tensor parallel's collectives,
    the pipeline's bubble, context parallel's ring exchange and FSDP's gather and reduce-scatter, each
    less the compute it overlaps with."""
    a, rate, micro = s.args, _rate(s), s.accum * s.microbatches
    mb_tokens = s.local_batch / s.microbatches * s.seq_len / s.cp  # one micro-batch's sequence part
    layers = range(a.n_layers)
    out = 0.0
    if s.tp > 1:
        link = NVLINK_BYTES_S if s.tp <= GPUS_PER_NODE else NETWORK_BYTES_S
        one = mb_tokens * a.dim * s.c * (s.tp - 1) / s.tp / link
        full = sum(mm.layer_mode(s, i % per_rank, as_traced=False) == "full" for i in layers)
        out += one * (TP_COLLECTIVES * a.n_layers + TP_COLLECTIVES // 2 * full) / s.pp * micro
    if s.pp > 1:
        bubble = (s.pp - 1) / (s.microbatches * s.stages_per_rank)
        out += compute * bubble * (ZERO_BUBBLE_SHARE if "ZeroBubble" in s.pp_schedule else 1.0)
    if s.cp > 1:  # K and V round the ring in forward; K, V and their gradients in backward
        link = NVLINK_BYTES_S if s.cp * s.tp <= GPUS_PER_NODE else NETWORK_BYTES_S
        heads = a.n_heads if a.expand_kv else a.kv_heads
        kv = 2 * mb_tokens / s.tp * heads * a.head_dim * s.c  # (heads split over tp)
        ring = 3 * (s.cp - 1) * kv / link
        attention = 3 * 2 * a.n_heads * a.head_dim * s.seq_len * mb_tokens / s.tp / rate
        out += max(ring - attention, 0.0) * a.n_layers / s.pp * micro
    if s.fsdp and s.fsdp_shard > 1:  # each block gathered in forward, its gradients reduced in backward
        shard = s.fsdp_shard
        gathered = 1 if s.float8.all_gather else s.c
        for i in layers:
            params = _block_params(s, [i]) * (shard - 1) / shard
            fwd = blocks[i] * mb_tokens / s.tp / rate  # (per micro-batch)
            out += (
                max(params * gathered / _link(s) - fwd, 0.0) + max(params * 4 / _link(s) - 2 * fwd, 0.0)
            ) * (micro / s.pp)
    return out


def recompute_share(s: RunPlan) -> float:
    """Activation checkpointing's recomputation as a share of the step's compute."""
    cost = step_cost(s)
    return cost.recompute_s / cost.compute_s
