"""Analytic per-GPU memory model of one titanrush training step: states, activations, buffers, the peak.

Every tensor is counted from the model's shapes and the parallel layout (TP shards the heads, the FFN and
the vocabulary; FSDP shards each parameter's first dimension; PP gives each rank its layers and keeps
several micro-batches in flight, and with FSDP keeps their gradients unsharded in fp32 until the last
one; CP splits the sequence, and compiled ring attention keeps the K/V it received; float8 linears change
what autocast and inductor keep; the compiled loss keeps no fp32 logits; a Llama 4's MoE layers, their
experts split by expert parallel and their own FSDP units: `memory_moe`). The peak is the largest of the
moments of a step where memory can peak (the last block's forward, the end of forward with the loss, the
loss's and the output layer's backward, the backward of the first and of the last block, the embedding's
backward, the optimizer step; a pipelined rank's later micro-batches too), each a dict component ->
bytes, so the breakdown shown is the one at the peak.
docs/estimator_method.md derives the formulas. `as_traced=True` evaluates the model as `memory_trace` runs it
(eager, no sequence parallel, no FSDP buffers, no ring attention, bf16 linears), so that the two methods
are compared like for like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanrush.models.llama import ModelArgs
from titanrush.models.llama.loss import LOSS_CHUNK_ELEMENTS
from titanrush.parallel.activation_offload import offloaded
from titanrush.run import memory_moe as moe
from titanrush.run.plan import RunPlan

GIB = 1024**3
LOWBIT = {"adamw8bit": (1.0, 256, 256), "adamw4bit": (0.5, 128, 16)}  # code bytes, block size, qmap size
LOWBIT_MIN_NUMEL = 4096  # torchao (after bitsandbytes) keeps smaller tensors' states in fp32
COMPONENTS = (
    "params",
    "master_weights",
    "grads",
    "optimizer",
    "activations",
    "logits",
    "fsdp_buffers",
    "ddp_buckets",
    "float8",
    "transient",
    "buffers",
)


@dataclass
class RankPlan:
    """What one pipeline rank holds and how many micro-batches' activations it keeps at once."""

    rank: int
    layers: list[int]
    embedding: bool
    head: bool
    in_flight: float  # micro-batches' worth of activations alive at the peak
    microbatch: int  # sequences per micro-batch


@dataclass
class Breakdown:
    """The model's answer for one rank: component sizes, the moments of the step, and the peak."""

    rank: int
    sizes: dict[str, int]
    moments: dict[str, dict[str, int]]
    peak_phase: str = ""
    peak: int = 0
    # Pipelined with FSDP: the activations one micro-batch's backward frees while the stage's unsharded
    # fp32 gradients are allocated beside them (see `stranded_after_first_backward`).
    first_backward_freed: int = 0

    @property
    def at_peak(self) -> dict[str, int]:
        return self.moments[self.peak_phase]


def rank_plans(s: RunPlan) -> list[RankPlan]:
    """Layers (the run plan's stages and split), embedding/head and micro-batches in flight of every
    pipeline rank."""
    pp, v, n_stages = s.pp, s.stages_per_rank, s.n_stages
    m = s.microbatches
    plans = []
    for rank in range(pp):
        stages = s.stage_ids(rank) if pp > 1 else [0]
        layers = [i for st in stages for i in s.stage_layers(st)]
        if pp == 1:
            in_flight = 1.0
        elif s.pp_schedule == "GPipe":
            in_flight = float(m)
        elif v == 1:  # 1F1B: rank r runs pp - r forwards before its first backward
            in_flight = float(min(m, pp - rank))
        else:  # interleaved: (v-1)pp + 2(pp-1-r) + 1 chunk forwards of 1/v of the rank's layers each
            in_flight = min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1) / v
        plans.append(
            RankPlan(
                rank=rank,
                layers=layers,
                embedding=0 in stages,
                head=n_stages - 1 in stages,
                in_flight=in_flight,
                microbatch=max(s.local_batch // m, 1),
            )
        )
    return plans


def param_shapes(s: RunPlan, plan: RankPlan) -> list[tuple[str, tuple[int, int], bool]]:
    """(name, TP-local shape (dim0, rest), is a linear weight) of every parameter on the rank (a MoE
    layer's: `memory_moe.moe_param_shapes`)."""
    a, tp = s.args, s.tp
    d, hq, hkv = a.dim, a.n_heads // tp * a.head_dim, a.kv_heads // tp * a.head_dim
    f, vocab = math.ceil(a.ffn_hidden / tp), math.ceil(a.vocab_size / tp)
    out: list[tuple[str, tuple[int, int], bool]] = []
    if plan.embedding:
        out.append(("tok_embeddings", (vocab, d), False))
    attention = {"wq": (hq, d), "wk": (hkv, d), "wv": (hkv, d), "wo": (d, hq)}
    ffn = {"w1": (f, d), "w3": (f, d), "w2": (d, f)}
    for i in plan.layers:
        out += [(f"layers.{i}.{name}", shape, True) for name, shape in attention.items()]
        if moe.is_moe(s, i):  # router, shared expert and the rank's experts, whole under TP
            out += moe.moe_param_shapes(s, i)
        else:
            out += [(f"layers.{i}.{name}", shape, True) for name, shape in ffn.items()]
        out += [(f"layers.{i}.{name}", (d, 1), False) for name in ("attention_norm", "ffn_norm")]
    if plan.head:
        out.append(("norm", (d, 1), False))
        if not (a.tie_embeddings and plan.embedding):
            out.append(("output", (vocab, d), True))
    return out


def _weight_name(param: str) -> str:
    """`wq` ... `w3` for a block linear, `output` for the output layer or the table tied to it."""
    return "output" if param == "tok_embeddings" else param.rsplit(".", 1)[-1]


def shard_numel(shape: tuple[int, int], n: int) -> int:
    """Elements of one FSDP shard: dim 0 split into n parts, padded to equal size."""
    return math.ceil(shape[0] / n) * shape[1]


def optimizer_bytes(numel: int, name: str) -> int:
    """AdamW's two states for one (local) parameter: fp32, or torchao's block-quantized codes + scales."""
    if name in LOWBIT:
        code, block, qmap = LOWBIT[name]
        if numel >= LOWBIT_MIN_NUMEL and numel % block == 0:
            return 2 * (int(numel * code) + numel // block * 4 + qmap * 4) + 4
    return 2 * 4 * numel + 4


def float8_linears(s: RunPlan) -> frozenset[str]:
    """The linears float8 converts (block names wq ... w3, and `output`): titanrush.parallel.float8's rule
    (`Float8Plan.skip_reason`) on the unsharded shapes, as for layer 0."""
    if not s.float8.enable:
        return frozenset()
    a = s.args
    d, hq, hkv, f = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden
    shapes = {
        "attention.wq": (hq, d),
        "attention.wk": (hkv, d),
        "attention.wv": (hkv, d),
        "attention.wo": (d, hq),
        "feed_forward.w1": (f, d),
        "feed_forward.w3": (f, d),
        "feed_forward.w2": (d, f),
        "output": (a.vocab_size, d),
    }
    out = set()
    for name, shape in shapes.items():
        fqn = name if name == "output" else f"layers.0.{name}"
        if s.float8.skip_reason(fqn, shape) is None:
            out.add(name.rsplit(".", 1)[-1])
    return frozenset(out)


def states(s: RunPlan, plan: RankPlan) -> dict[str, int]:
    """Per-GPU bytes of parameters, master weights, gradients, optimizer states and buffers."""
    shapes = param_shapes(s, plan)
    local = [shard_numel(shape, moe.fsdp_degree(s, name)) for name, shape, _ in shapes]
    stored = 4 * sum(local)  # parameters are fp32 in both precisions (bf16 runs keep fp32 masters)
    on_gpu = 0 if s.fsdp_plan.cpu_offload else 1
    # autocast caches a bf16 copy of every matmul weight (a tied table: for the output) for fwd and bwd;
    # float8 linears cast their fp32 weights to float8 themselves
    tied = s.args.tie_embeddings and plan.embedding and plan.head
    f8 = float8_linears(s)
    cast = [
        d0 * d1
        for name, (d0, d1), lin in shapes
        if lin or (tied and name == "tok_embeddings")
        if _weight_name(name) not in f8
    ]
    matmul = sum(cast)
    compute_copies = 2 * matmul if s.autocast else 0
    return {
        "params": compute_copies if s.precision == "bf16" else stored * on_gpu,
        "master_weights": stored * on_gpu if s.precision == "bf16" else 0,
        "grads": stored * on_gpu,
        "optimizer": sum(optimizer_bytes(x, s.optimizer) for x in local) * on_gpu,
        # the RoPE table: rope_len positions x head_dim / 2 fp32 (cos, sin) pairs; MoE layers' routing
        # bias and token counts
        "buffers": s.args.rope_len * s.args.head_dim // 2 * 8 + moe.buffer_bytes(s, plan.layers),
    }


def _sp(s: RunPlan, n: int, as_traced: bool) -> int:
    """Local tokens of the norms and the residual stream: 1/tp of the sequence under sequence parallel."""
    return n // s.tp if s.tp > 1 and s.tp_plan.sequence_parallel and not as_traced else n


def layer_mode(s: RunPlan, position: int, *, as_traced: bool, layer: int | None = None) -> str:
    """How the block at this position of the rank (`layer`: its index in the model) is checkpointed: none,
    full, op (selective), parts (selective op by parts: a MoE block under EP or TP,
    `activation_checkpoint.wrap_moe_parts`) or compiled."""
    plain = "none" if as_traced or not s.compile.enable else "compiled"
    if s.ac.mode == "full":
        return "full"
    if s.ac.mode == "selective":
        if s.ac.selective == "op":
            return "parts" if s.moe_by_parts and layer is not None and moe.is_moe(s, layer) else "op"
        return "full" if (position + 1) % int(s.ac.selective) == 0 else plain
    return plain


def _ring_kv(s: RunPlan, n: int) -> tuple[int, int]:
    """Context parallel's ring attention on n local tokens: bytes of the rank's K/V pair as it exchanges
    them (SDPA's inputs: the grouped K/V heads, or K and V repeated to the query heads where the model
    repeats them first, `expands_kv`), and of the K/V it receives in one attention (allgather: every
    rank's pair, its own included; alltoall: the cp - 1 others', one ring pass each)."""
    heads = s.args.n_heads if expands_kv(s.args, as_traced=False) else s.args.kv_heads
    pair = 2 * s.c * n * (heads // s.tp) * s.args.head_dim
    return pair, (s.cp if s.cp_plan.rotate == "allgather" else s.cp - 1) * pair


def expands_kv(args: ModelArgs, as_traced: bool) -> bool:
    """Whether attention's saved K/V have one head per query head (`attention.repeat_kv` ran first)."""
    if as_traced:  # memory_trace runs sdpa (grouped K/V) for every backend but math, on one process
        return args.attn_backend == "math"
    return args.attn_backend in ("cudnn", "math") or (args.attn_backend == "sdpa" and args.expand_kv)


def keeps_all_matmuls(s: RunPlan, layer: int) -> bool:
    """Whether block `layer` (its index in the whole model) keeps every matmul output under op_all_last."""
    return s.ac.op_matmuls == "alternate" and layer >= s.args.n_layers - s.ac.op_all_last


def block_saved(
    s: RunPlan,
    n: int,
    batch: int,
    mode: str,
    *,
    as_traced: bool = False,
    keep_all: bool = False,
    layer: int | None = None,
    imbalance: float = moe.DEFAULT_IMBALANCE,
) -> dict[str, int]:
    """Bytes autograd (or the checkpoint) keeps for one block's backward, by tensor, for n local tokens.

    `keep_all`: a selective op block that keeps every matmul output although op_matmuls = alternate.
    `layer`: the block's index in the whole model; a MoE layer's feed-forward is `memory_moe.moe_saved`'s
    (`imbalance`: the busiest EP rank's load over the balanced share).
    """
    if mode == "parts":  # (a MoE block: `_parts_saved`)
        assert layer is not None and moe.is_moe(s, layer), layer
        return _parts_saved(s, n, batch, as_traced=as_traced, keep_all=keep_all, imbalance=imbalance)
    out = _block_saved(s, n, batch, mode, as_traced=as_traced, keep_all=keep_all)
    if layer is not None and mode == "none" and moe.qk_norm(s, layer):
        out["q, k fp32 (QK-norm)"] = moe.qk_norm_saved(s, n)
    if layer is None or not moe.is_moe(s, layer):
        return out
    for key in moe.DENSE_FFN:
        out.pop(key, None)
    tokens = _sp(s, n, as_traced)  # a MoE layer routes the rank's sequence shard under TP (no all-gather)
    if mode == "compiled":  # the router's (and the shared expert's) input
        out["ffn_norm out"] = s.c * tokens * s.args.dim
    return out | moe.moe_saved(s, tokens, batch, mode, imbalance=imbalance, keep_all=keep_all)


def _parts_saved(
    s: RunPlan, n: int, batch: int, *, as_traced: bool, keep_all: bool, imbalance: float
) -> dict[str, int]:
    """`block_saved` of a MoE block checkpointed by parts: the attention's op set with its input (the
    norm's output) in place of the block's input, the two norms as eager, the MoE layer's `parts` set."""
    n_sp = _sp(s, n, as_traced)
    norm = 4 * n_sp * s.args.dim + 4 * n_sp  # RMSNorm keeps its fp32 input and the fp32 1/rms
    out = _block_saved(s, n, batch, "op", as_traced=as_traced, keep_all=keep_all)
    for key in (*moe.DENSE_FFN, "block input"):
        out.pop(key, None)
    if "reduce-scatter outs" in out:  # wo's alone: the MoE layer computes its tokens whole
        out["reduce-scatter outs"] //= 2
    out |= {"attention_norm in": norm, "attention in": s.r * n_sp * s.args.dim, "ffn_norm in": norm}
    return out | moe.moe_saved(s, n_sp, batch, "parts", imbalance=imbalance)


def _block_saved(
    s: RunPlan, n: int, batch: int, mode: str, *, as_traced: bool, keep_all: bool
) -> dict[str, int]:
    """`block_saved` of a dense block."""
    a, tp, c, r = s.args, s.tp, s.c, s.r
    d, dh, hq, hkv = a.dim, a.head_dim, a.n_heads // tp, a.kv_heads // tp
    f, n_sp, seq = math.ceil(a.ffn_hidden / tp), _sp(s, n, as_traced), n // batch
    lse = 4 * batch * hq * seq  # fp32 logsumexp of the fused attention kernels
    ring = s.cp > 1 and not as_traced  # the trace runs the local sequence without the K/V exchange
    pair, received = _ring_kv(s, n)
    if mode == "full":  # (compiled too: the checkpoint makes the partitioner recompute the exchange)
        return {"block input": r * n_sp * d}
    if mode == "op":  # selective: the outputs of matmuls and attention are kept, the rest recomputed
        out = {
            "block input": r * n_sp * d,
            "wq out": c * n * hq * dh,
            "wk out": c * n * hkv * dh,
            "wv out": c * n * hkv * dh,
            "attention out": c * n * hq * dh,
            "logsumexp": lse,
            "wo out": c * n * d,
            "w1 out": c * n * f,
            "w3 out": c * n * f,
            "w2 out": c * n * d,
        }
        if tp > 1 and s.tp_plan.sequence_parallel and not as_traced:
            out["reduce-scatter outs"] = 2 * c * n_sp * d
        if s.ac.op_matmuls == "alternate" and not keep_all:  # the policy counts aten.mm calls: the 2nd,
            # 4th and 6th are recomputed
            del out["wk out"], out["wo out"], out["w3 out"]
        elif s.ac.op_matmuls == "all_but_w3":  # ... the 6th
            del out["w3 out"]
        if s.compile.enable and not as_traced:  # compiled: w2's output goes, unused by backward (measured)
            del out["w2 out"]
            if ring:  # compiled ring attention keeps the K/V it received and K, V made contiguous (the
                # joint graph's CSE merges the backward's exchange into the forward's; see
                # estimator_method.md), so wk's and wv's outputs are no longer needed to recompute K and V
                out.pop("wk out", None), out.pop("wv out")
                out |= {"k, v contiguous (CP)": pair, "K/V received (CP)": received}
        return out
    # cudnn and math take K/V repeated to the query heads, and so does sdpa under fp32 context parallel;
    # otherwise the kernels read each K/V head for its group of query heads (sdpa's enable_gqa, flash, flex).
    kv = hq if expands_kv(a, as_traced) else hkv
    if mode == "compiled":
        # What inductor's partitioner keeps (measured for 1B blocks on H200; float8 and CP from its runs on
        # CPU, docs/estimator_method.md): the eager set less silu, norms fused, and wo's output (under
        # autocast the bf16 output, from which the fp32 residual sum is recomputed).
        out = {
            "block input": r * n_sp * d,
            "attention_norm out": c * n * d,
            "ffn_norm out": c * n * d,
            "q roped": c * n * hq * dh,
            "k, v": 2 * c * n * kv * dh,
            "attention out": c * n * hq * dh,
            "logsumexp": lse,
            "wo out": c * n_sp * d,
            "w1 out, w3 out": 2 * c * n * f,
            "gate": c * n * f,
        }
        # A float8 linear's backward needs its input only as float8, which the partitioner recomputes (a
        # cast with the forward's scale) from what it keeps anyway, rather than keeping the bf16 input.
        f8 = float8_linears(s)
        if {"wq", "wk", "wv"} <= f8:
            del out["attention_norm out"]
        if {"w1", "w3"} <= f8:
            del out["ffn_norm out"]
        if "w2" in f8:
            del out["gate"]
        # Under FSDP's float8 all-gather the block also keeps the float8 copies (1 byte a weight, this
        # rank's TP share, unsharded over FSDP) of its float8 FFN weights: measured on H200 for the 8B's
        # block, w1, w3 and w2 at 56 MiB each, the attention's none (docs/estimator_method.md).
        if s.float8.all_gather:
            ffn8 = sum(w in f8 for w in ("w1", "w2", "w3"))
            if ffn8:
                out["float8 FFN weights (all-gathered)"] = ffn8 * d * f
        if ring:  # the received K/V as above, and wo's (B, T, H x D) copy of the merged attention output
            out |= {"K/V received (CP)": received, "attention out copy (CP)": c * n * hq * dh}
        return out
    # Eager, no checkpointing: what each op saves (see docs/estimator_method.md for the list).
    norm = 4 * n_sp * d + 4 * n_sp  # RMSNorm keeps its fp32 input and the fp32 1/rms
    # The matmul inputs under autocast: a Llama block casts each norm's output once (`to_matmul_dtype`:
    # one bf16 copy that wq, wk, wv, or w1, w3, keep); a Llama 4 block lets autocast cast it per matmul.
    att, ffn = (6, 4) if s.moe else (2, 2)
    out = {
        "attention_norm in": norm,
        "attention in": (att if s.autocast else r) * n * d,
        "q roped": c * n * hq * dh,
        "k roped": c * n * kv * dh,
        "v": c * n * kv * dh,
        "attention out": c * n * hq * dh,
        "logsumexp": lse,
        "ffn_norm in": norm,
        "ffn in": (ffn if s.autocast else r) * n * d,
        "w1 out": c * n * f,
        "silu out": c * n * f,
        "w3 out": c * n * f,
        "gate": c * n * f,
    }
    if a.attn_backend == "math":  # the (T, T) scores: fp32 softmax output, its bf16 copy, the mask
        out["scores"] = (4 + (c if c == 2 else 0)) * batch * hq * seq * seq + seq * seq
        del out["logsumexp"]
    if ring:  # wo's input is a (B, T, H x D) copy of ring attention's (B, H, T, D)-contiguous output
        out["attention out copy (CP)"] = c * n * hq * dh
    return out


def block_working_set(
    s: RunPlan,
    n: int,
    batch: int,
    mode: str,
    *,
    backward: bool,
    as_traced: bool,
    layer: int | None = None,
    imbalance: float = moe.DEFAULT_IMBALANCE,
) -> int:
    """Bytes of one block's tensors alive at its peak, besides the other blocks' saved tensors.

    Backward: what the block's backward holds when the FFN's input gradients are computed (its saved or
    recomputed tensors, dp/ds/db less the freed gate, the incoming residual gradient); with selective
    checkpointing the cached matmul outputs that backward does not need are already released. Forward
    (checkpointed blocks): the FFN's live intermediates, which a checkpointed block does not keep. Under
    context parallel, ring attention's buffers where they are larger (`_ring_transient`). A MoE layer
    (`layer`, its index in the model) holds its own (`memory_moe.forward_live`; backward: `analyze_rank`).
    """
    a, tp, c, r = s.args, s.tp, s.c, s.r
    f, n_sp, seq = math.ceil(a.ffn_hidden / tp), _sp(s, n, as_traced), n // batch
    held = 0 if r == 4 else r * n_sp * a.dim  # a bf16 block input is held beside the norm's fp32 copy
    scores = 8 * batch * (a.n_heads // tp) * seq * seq if a.attn_backend == "math" else 0  # fp32 (T, T)
    is_moe = layer is not None and moe.is_moe(s, layer)
    # A compiled checkpointed block recomputes inside its backward graph, which frees each tensor at its last
    # use: its backward holds about what the compiled block without checkpointing keeps (measured on H200,
    # 8B blocks under selective op and full AC), not the eager set; so too for ring attention's exchange.
    recompiled = backward and mode in ("op", "full") and s.compile.enable and not as_traced and not is_moe
    ring_mode = "compiled" if recompiled else mode
    ring = _ring_transient(s, n, ring_mode, backward=backward) if s.cp > 1 and not as_traced else 0
    if backward:
        kept = "compiled" if mode == "compiled" or recompiled else "none"
        saved = block_saved(s, n, batch, kept, as_traced=as_traced, layer=layer, imbalance=imbalance)
        if mode == "parts":  # the attention is recomputed after the MoE layer's backward: until then its
            # op set; the MoE layer's as eager (its shared expert's recomputation brings back the rest)
            parts = _parts_saved(s, n, batch, as_traced=as_traced, keep_all=False, imbalance=imbalance)
            moe_part = moe.moe_saved(s, n_sp, batch, "parts", imbalance=imbalance)
            eager = moe.moe_saved(s, n_sp, batch, "none", imbalance=imbalance)
            saved = {k: v for k, v in parts.items() if k not in moe_part} | eager
        # (a MoE layer's input gradients: `memory_moe.backward_points`, in `analyze_rank`)
        grads = 0 if is_moe else 2 * c * n * f
        return (
            sum(saved.values())
            + (held if mode in ("full", "op") and not recompiled else 0)
            + max(grads, ring)
            + r * n_sp * a.dim
        )
    casts = (4 if s.moe else 2) * n * a.dim if s.autocast else 0  # the FFN input's bf16 cast(s)
    if is_moe:  # the mid-block residual: eager, kept by the norm as fp32 (a bf16 one is live beside its
        # copy, and so is the block's input); the block's output comes after the layer's peak
        ffn = moe.forward_live(s, n_sp, mode, imbalance=imbalance)
        return max(ffn, ring) + (2 * held if mode in ("none", "parts") else r * n_sp * a.dim) + scores
    if mode == "full":  # silu output, w3 output and gate; the FFN input and the mid-block residual
        ffn = 3 * c * n * f + r * n_sp * a.dim + casts
    elif mode == "op":  # w1 and w3 outputs are cached (saved); silu output and gate are not
        ffn = 2 * c * n * f + casts
    else:
        ffn = c * n * a.dim  # the w2 output (and the residual sum below)
    return max(ffn, ring) + r * n_sp * a.dim + scores


def _ring_transient(s: RunPlan, n: int, mode: str, *, backward: bool) -> int:
    """Ring attention's temporaries (torch's _context_parallel/_attention.py) on n local tokens.

    Both: K and V made contiguous and the K/V received (unless the partitioner keeps them for backward),
    the concatenated local K/V it sends. Forward: the fp32 merge of the partial outputs (the running
    output, the new partial output, their difference). Backward: the fp32 accumulators of dQ, dK and dV,
    the concatenated fp32 dK/dV sent and the one received, and one attention kernel's dQ, dK, dV.
    """
    pair, received = _ring_kv(s, n)
    out32 = 4 * n * (s.args.n_heads // s.tp) * s.args.head_dim  # one fp32 (B, H, T, D) output
    kept = s.compile.enable and mode in ("op", "compiled")
    exchange = (0 if kept else received + pair) + pair
    if not backward:
        return exchange + 3 * out32
    pair32 = pair * 4 // s.c
    return exchange + out32 + 3 * pair32 + out32 * s.c // 4 + pair


LATER = ", later micro-batch"  # the moments of a pipelined rank's later micro-batches (see analyze_rank)
REDUCE = ", reduce"  # FSDP's reduce of a block's gradients, after that block's backward (`fsdp_buffers`)
LOSS_KEYS = ("saved", "log_softmax", "forward", "backward", "rows", "vocab", "kept")


def loss_bytes(s: RunPlan, n: int, *, as_traced: bool) -> dict[str, int]:
    """Saved tensors of the final norm and output layer, and the loss's forward and backward peaks."""
    a, tp, c, r = s.args, s.tp, s.c, s.r
    n_sp = _sp(s, n, as_traced)
    sharded = tp > 1 and (s.tp_plan.loss_parallel or as_traced)
    vocab = math.ceil(a.vocab_size / tp) if sharded else a.vocab_size
    if s.loss == "chunked":
        return _chunked_loss_bytes(s, n, n_sp, min(n, s.loss_chunk), vocab, as_traced=as_traced)
    head_in = (2 if s.autocast else r) * n * a.dim
    saved = 4 * n_sp * a.dim + 4 * n_sp + head_in
    if s.vocab_parallel_loss and not as_traced:
        # Loss parallel's own function (models/llama/loss.py): it keeps the logits shard it was
        # given and per row an fp32 log-sum-exp, the label's local index and two masks; its fp32 math runs
        # in row chunks (a chunk's upcast and exponentials), and backward writes the gradient in place.
        logits, stats = c * n * vocab, 14 * n
        chunk = 8 * min(n * vocab, LOSS_CHUNK_ELEMENTS)
        return {
            "saved": saved,
            "log_softmax": logits + stats,
            "forward": logits + stats + chunk,
            "backward": 2 * logits + stats + chunk,
            "rows": n,
            "vocab": vocab,
            "kept": 0,
        }
    if s.compiled_loss and not as_traced:
        # Compiled, the fp32 upcast, log-softmax and nll_loss fuse into row reductions: the loss keeps the
        # logits it was given (compute dtype) and two fp32 numbers per row (max, log-sum-exp), and its
        # backward writes the logits' gradient in the compute dtype directly. No (n, V) fp32 tensor.
        logits, stats = c * n * vocab, 8 * n
        return {
            "saved": saved,
            "log_softmax": logits + stats,
            "forward": logits + stats,
            "backward": 2 * logits + stats,
            "rows": n,
            "vocab": vocab,
            "kept": 0,
        }
    return {
        "saved": saved,
        "log_softmax": 4 * n * vocab,  # kept per micro-batch until its backward
        # logits in the compute dtype, their fp32 copy, the log-softmax
        "forward": n * vocab * (8 if c == 4 else c + 8),
        # log-softmax output + the gradients of nll_loss and log_softmax, all (n, V) fp32
        "backward": 12 * n * vocab,
        "rows": n,
        "vocab": vocab,
        "kept": 0,
    }


def _chunked_loss_bytes(
    s: RunPlan, n: int, n_sp: int, rows: int, vocab: int, *, as_traced: bool
) -> dict[str, int]:
    """The chunked loss (titanrush/models/llama/loss.py) computes both gradients in forward: it keeps the
    hidden states' gradient (compute dtype) and the weight's (summed in fp32, kept in the weight's dtype)
    for backward, and nothing of size (rows, V) beyond its chunk."""
    a, c, r = s.args, s.c, s.r
    w_grad = 4 * vocab * a.dim  # summed over the chunks in fp32
    # The weight's dtype: bf16 under FSDP's mixed precision, else the fp32 master weights.
    w_bytes = 2 if s.fsdp and s.precision == "bf16" else 4
    kept_w = w_bytes * vocab * a.dim
    saved = 4 * n_sp * a.dim + 4 * n_sp + c * n * a.dim + kept_w
    if s.compile.enable and not as_traced:  # compiled per-chunk math: the chunk's logits and gradient only
        per_row = 2 * c
    else:  # eager: the logits, their fp32 copy turned into the gradient in place, its cast (bf16)
        per_row = 4 if c == 4 else 2 * c + 4
    single = rows >= n  # one chunk: the weight's gradient does not exist yet during the chunk's math
    chunk_math = rows * vocab * per_row - (w_grad if single else 0)
    # Then the weight's gradient: the chunk's logits gradient is alive; off CUDA (the trace) the product is
    # a bf16 tensor, then cast to fp32 (the first chunk's cast is the sum itself), then added.
    dw_step = rows * vocab * c
    if as_traced and c == 2:
        dw_step += c * vocab * a.dim + (0 if single else 4 * vocab * a.dim)
    # Beside them the loss's input, the final norm's output, and under autocast its bf16 copy.
    # (the fp32 sum is a transient of the loop; `saved` holds its cast, made beside the sum at the end)
    loop = max(chunk_math, dw_step) + w_grad - kept_w
    cast = w_grad if kept_w != w_grad else 0
    fwd = max(loop, cast) + r * n * a.dim + (c * n * a.dim if r != c else 0)
    # The weight's gradient scaled, the hidden states' gradient scaled (and cast back to the residual
    # dtype under autocast).
    bwd = kept_w + c * n * a.dim + (r * n * a.dim if r != c else 0)
    kept = kept_w + c * n * a.dim
    return {
        "saved": saved,
        "log_softmax": 0,
        "forward": fwd,
        "backward": bwd,
        "rows": rows,
        "vocab": vocab,
        "kept": kept,
    }


Param = tuple[int, bool, str]  # an FSDP unit's parameter: (TP-local numel, is a linear weight, name)


def _units(s: RunPlan, plan: RankPlan) -> tuple[list[list[Param]], list[Param], dict[int, list[list[Param]]]]:
    """FSDP units of the rank in forward order (embedding, blocks, head), the root's parameters, and the
    units of their own inside MoE blocks (layer -> units in the order they run: `memory_moe.inner_unit`).
    Without FSDP (tensor parallel alone) only the MoE layers are FSDP units."""
    shapes = param_shapes(s, plan)
    by_unit: dict[str, list[Param]] = {}
    tied = s.args.tie_embeddings and plan.embedding and plan.head
    for name, (d0, d1), linear in shapes:
        if moe.local_expert(s, name):  # in no unit
            continue
        if name.startswith("layers."):
            key = moe.inner_unit(s, name) or ".".join(name.split(".")[:2])
        elif name == "tok_embeddings":
            key = "root" if tied else "emb"
        else:
            key = "head"
        by_unit.setdefault(key, []).append((d0 * d1, linear, name))
    inner = {
        i: [by_unit.pop(k) for k in (f"layers.{i}.moe", f"layers.{i}.moe.experts") if k in by_unit]
        for i in plan.layers
    }
    inner = {i: units for i, units in inner.items() if units}
    if not s.fsdp:
        return [], [], inner
    root = by_unit.pop("root", [])
    order = (["emb"] if "emb" in by_unit else []) + [f"layers.{i}" for i in plan.layers]
    order += ["head"] if "head" in by_unit else []
    return [by_unit[k] for k in order], root, inner


def fsdp_buffers(s: RunPlan, plan: RankPlan, *, later: bool = False) -> dict[str, int]:
    """Per moment: FSDP's unsharded parameters (the unit in use and the one prefetched), unsharded gradients
    and fp32 reduce-scatter inputs (the unit's, and the previous unit's, still in flight).

    Under pipeline parallel no unit reduce-scatters during the micro-batches' backward passes (see
    `analyze_rank`): a unit's unsharded gradient is copied to fp32 (the rank's first micro-batch, `later`
    False) or added to the fp32 copy (`later` True), and nothing is in flight. A MoE block's units of its
    own (expert parallel's experts, the layer under TP) add theirs (`extra`, below).
    """
    units, root, inner = _units(s, plan)
    pc = 2 if s.precision == "bf16" else 4
    pipelined = s.pp > 1

    def unit(i: int, kind: str, of: list[list[Param]] = units, dtype: int = pc) -> int:
        if i < 0 or i >= len(of):
            return 0
        if kind == "gather":
            f8 = s.float8.all_gather
            return sum(x * (1 if f8 and lin and name != "output" else dtype) for x, lin, name in of[i])
        if kind == "grad":  # the unsharded gradients alone, before the unit's post-backward
            per = dtype
        elif pipelined:  # the bf16 gradient and its fp32 copy (the copy then counts as a gradient)
            per = {"reduce": dtype if later else dtype + 4, "in flight": 0, "held": 0}[kind]
        else:  # grads + reduce-scatter input; the previous unit's input, which FSDP holds until the next
            # unit's backward ends (so that the compute stream cannot reuse it while the collective reads it)
            per = {"reduce": dtype + 4, "in flight": 4, "held": 4}[kind]
        return per * sum(x for x, _, _ in of[i])

    root_all = 2 * pc * sum(x for x, _, _ in root)  # never resharded; its unsharded gradient accumulates
    first = 1 if plan.embedding and units and units[0][0][2] == "tok_embeddings" else 0
    head = len(units) - 1 if plan.head and units and units[-1][-1][2] in ("norm", "output") else len(units)
    blk = head - 1  # the rank's last block
    every = sum(unit(i, "gather") for i in range(len(units)))

    def gathered(*idx: int) -> int:  # reshard_after_forward = never keeps every unit until its backward
        return root_all + (every if s.fsdp_plan.reshard == "never" else sum(unit(i, "gather") for i in idx))

    def backward(i: int, before: int) -> tuple[int, int]:
        """Unit i's block backward: (at its peak, at its reduce). FSDP reduces a unit once its backward is
        done, and first releases the reduce-scatter input of the unit before it (`before`), still in flight
        at the peak; there the block's own unsharded gradients exist only in eager, made op by op (a
        compiled block's graph returns them at its end). Pipelined: nothing in flight, both at once; so too
        with MoE layers' units of their own (an upper bound)."""
        if pipelined or inner:
            both = unit(i, "reduce") + unit(before, "in flight")
            return both, both
        own = 0 if s.compile.enable else unit(i, "grad")
        # (FSDP reshards the unit's weights after its backward, before it reduces)
        return own + unit(before, "in flight"), unit(i, "reduce") - unit(i, "gather")

    # default: the last block (and the last keep_gathered_last) and the head stay gathered until backward
    blks = tuple(range(max(first, blk + 1 - max(1, s.fsdp_plan.keep_gathered_last)), blk + 1))
    kept = () if s.fsdp_plan.reshard == "always" else (head, *blks)
    # The chunked loss runs inside the model's forward, before FSDP's root releases the last all-gather's
    # output (the head's), which it keeps until then beside the unsharded parameters copied out of it.
    last_gather = unit(head, "gather") if s.loss == "chunked" else 0
    first_bwd, first_reduce = backward(blk, head)
    last_bwd, last_reduce = backward(first, first + 1)
    out = {
        "last block forward": gathered(*blks, head),
        "forward end": gathered(*kept) + last_gather,
        "loss backward": gathered(head, *blks),
        # the output layer's bf16 gradient; its fp32 copy comes after the norm's backward, the logits'
        # gradient freed
        "output backward": gathered(head, *blks) + unit(head, "grad"),
        "first block backward": gathered(*blks, blk - 1) + first_bwd,
        "first block backward" + REDUCE: gathered(*blks, blk - 1) + first_reduce,
        "last block backward": gathered(first, first - 1) + last_bwd,
        "last block backward" + REDUCE: gathered(first, first - 1) + last_reduce,
        # (a block's backward released the input of the unit after it; the embedding's does not)
        "embedding backward": gathered(0) + unit(0, "reduce") + unit(1, "held" if first else "in flight"),
    }
    if not inner:
        return out
    # A MoE layer's own units gather in the compute dtype under FSDP, else (TP alone) as stored, in fp32.
    dtype = pc if s.fsdp else 4

    def size(layer: int, kind: str, which: slice = slice(None)) -> int:
        of = inner.get(layer, [])[which]
        return sum(unit(i, kind, of, dtype) for i in range(len(of)))

    # The end moments stand for the backward of the MoE layer nearest each end of the rank (`analyze_rank`):
    # its units, and the layer before the last one's, whose last unit that backward prefetches.
    moe_layers = [i for i in plan.layers if i in inner]
    last, first_layer = moe_layers[-1], moe_layers[0]
    at = plan.layers.index(last)
    prev = plan.layers[at - 1] if at > 0 else None
    chain = s.fsdp  # in FSDP's prefetch chain (TP alone: each unit a root of its own, no prefetch)
    never = s.fsdp_plan.reshard == "never"  # every unit gathered from its forward to its backward
    every_inner = sum(size(i, "gather") for i in inner) if never else 0
    extra = {
        # in use (the last block's layer); then resharded after forward, unless never
        "last block forward": every_inner or size(last, "gather"),
        "forward end": every_inner,
        "loss backward": every_inner,
        # the head's backward prefetches the unit before it: the last block's last inner unit
        "output backward": every_inner or (size(last, "gather", slice(-1, None)) if chain else 0),
        # the layer's units gathered with their gradients (an upper bound: as a dense block's); the block's
        # backward prefetched the previous block's last inner unit
        "first block backward": (every_inner or size(last, "gather"))
        + size(last, "reduce")
        + (0 if never or not chain or prev is None else size(prev, "gather", slice(-1, None))),
        "last block backward": (every_inner or size(first_layer, "gather")) + size(first_layer, "reduce"),
        "embedding backward": every_inner,
    }
    return {name: x + extra[name.removesuffix(REDUCE)] for name, x in out.items()}


def analyze_rank(
    s: RunPlan, plan: RankPlan, *, as_traced: bool = False, moe_imbalance: float = moe.DEFAULT_IMBALANCE
) -> Breakdown:
    """Every moment of the step on one pipeline rank, and its peak (`moe_imbalance`: the busiest expert
    parallel rank's load over the balanced share, `memory_moe`)."""
    a, st, b, k = s.args, states(s, plan), plan.microbatch, plan.in_flight
    n = b * s.seq_len // s.cp  # tokens of one micro-batch on this rank
    modes = [layer_mode(s, i, as_traced=as_traced, layer=x) for i, x in enumerate(plan.layers)] or ["full"]
    layers = plan.layers or [0]
    moe_kw = dict(as_traced=as_traced, imbalance=moe_imbalance)
    saved = [
        0  # offloaded: its saved tensors wait in host memory (the trace, on one CPU process, keeps them)
        if not as_traced and offloaded(layer, s.ac.offload_first, s.ac.offload_every)
        else sum(
            block_saved(s, n, b, m, keep_all=keeps_all_matmuls(s, layer), layer=layer, **moe_kw).values()
        )
        for m, layer in zip(modes, layers)
    ]
    bwd_ws = [block_working_set(s, n, b, m, backward=True, layer=i, **moe_kw) for m, i in zip(modes, layers)]
    fwd_ws = block_working_set(s, n, b, modes[-1], backward=False, layer=layers[-1], **moe_kw)
    if not plan.layers:  # a stage without blocks
        saved, bwd_ws, fwd_ws = [0], [0], 0
    loss = loss_bytes(s, n, as_traced=as_traced) if plan.head else dict.fromkeys(LOSS_KEYS, 0)
    a_blocks, a_emb = k * sum(saved), k * 8 * n * plan.embedding  # the token ids for the embedding's backward
    a_head = k * loss["saved"] + (k - 1) * loss["log_softmax"]  # other micro-batches' losses too
    shard = s.fsdp_shard if s.fsdp else 1
    g_full = st["grads"]
    # Under pipeline parallel the first micro-batch's backward starts without gradients (zero_grad set
    # them to None) and later ones find all of them. torch's stages run every backward with FSDP's
    # gradient sync off: each unit keeps its unsharded gradient, accumulated in fp32 (FSDP's reduce
    # dtype), until the stage reduce-scatters them after its last micro-batch; so these are unsharded.
    pipelined = s.pp > 1 and not as_traced
    gs = 1 if pipelined else shard
    vocab = 4 * math.ceil(loss["vocab"] * a.dim / gs)  # the output projection's gradient (tied or not)
    head_g = vocab + 4 * a.dim * plan.head
    emb_g = 4 * math.ceil(math.ceil(a.vocab_size / s.tp) * a.dim / gs) if plan.embedding else 0
    emb_g = 0 if plan.head and a.tie_embeddings else emb_g
    g_all = 4 * sum(d0 * d1 for _, (d0, d1), _ in param_shapes(s, plan)) if pipelined else g_full
    w2 = a.dim * math.ceil(a.ffn_hidden / s.tp)  # the largest block weight
    w2_grad = 0 if s.fsdp and not as_traced else 4 * math.ceil(w2 / shard)
    # Weight-gradient conversions: autocast's bf16 gradient before its fp32 copy; as traced under FSDP, one
    # tensor's unsharded gradient before it is sharded (FSDP's buffers stand for it otherwise).
    conv = 2 if s.autocast else (6 if s.precision == "bf16" else 4) if s.fsdp and as_traced else 0
    grad_in = s.r * _sp(s, n, as_traced) * a.dim  # a block's input gradient
    f8 = 0  # float8 casts of the largest linear's input, output gradient and weight
    if s.float8.enable and not as_traced:
        f8 = n * (math.ceil(a.ffn_hidden / s.tp) + a.dim) + 2 * w2
    fsdp = fsdp_buffers(s, plan) if (s.fsdp or s.moe_tp) and not as_traced else {}
    if pipelined and fsdp:
        fsdp |= {name + LATER: x for name, x in fsdp_buffers(s, plan, later=True).items()}
    # Earlier micro-batches' gradients are alive throughout (pipelined: see micro_batch).
    steady = s.accum > 1 or (s.microbatches > 1 and not pipelined)
    base = {key: st[key] for key in ("params", "master_weights", "optimizer", "buffers")}
    base["ddp_buckets"] = g_full if s.ddp and not as_traced else 0
    copies, recast = _autocast_copies(s, plan, modes, as_traced=as_traced)
    moments: dict[str, dict[str, int]] = {}
    # A MoE block's backward peaks at one of several points (`memory_moe.backward_points`), each with the
    # gradients of its own parameters made so far: (its transient, those gradients) per point.
    shapes = {name: shape for name, shape, _ in param_shapes(s, plan)}

    def grad_bytes(name: str) -> int:  # a gradient as `g_all` counts it
        numel = math.prod(shapes[name]) if pipelined else shard_numel(shapes[name], moe.fsdp_degree(s, name))
        return 4 * numel

    def moe_options(pos: int) -> list[tuple[int, int]]:
        layer, mode = layers[pos], modes[pos]
        ring = _ring_transient(s, n, mode, backward=True) if s.cp > 1 and not as_traced else 0
        # FSDP's units hold the gradients until their reduce-scatter (`fsdp_buffers`)
        in_fsdp = (s.fsdp or s.moe_tp) and not as_traced
        prefix = f"layers.{layer}.moe."
        tokens = _sp(s, n, as_traced)
        # A checkpointed block's recomputation: its forward again, saving (`moe_saved` as eager) beside
        # the forward's live tensors, before any gradient of the block.
        out = [(moe.recompute_live(s, tokens, imbalance=moe_imbalance), 0)] if mode in ("full", "op") else []
        for extra, names, fresh in moe.backward_points(s, tokens, imbalance=moe_imbalance):
            # (local experts: their fp32 gradients are their own, made beside the GEMM's bf16 one)
            own = sum(grad_bytes(prefix + x) for x in names if not in_fsdp or moe.local_expert(s, prefix + x))
            made = conv * math.prod(shapes[prefix + fresh]) if fresh else 0
            if fresh and moe.local_expert(s, prefix + fresh):
                made = (2 if s.precision == "bf16" else 0) * math.prod(shapes[prefix + fresh])
            out.append(((max(extra, ring) - ring if ring else extra) + made, own))  # (ring: at attention's)
        return out

    # The MoE layers nearest each end of the rank (with moe_every > 1 an end block may be dense): their
    # backward is a moment of its own, with the blocks behind it in backward done (their gradients made,
    # their saved activations freed) and those ahead of it waiting.
    moe_pos = [i for i, layer in enumerate(layers) if plan.layers and moe.is_moe(s, layer)]
    pos_e, pos_s = (moe_pos[-1], moe_pos[0]) if moe_pos else (None, None)
    first_moe = moe_options(pos_e) if moe_pos else None
    last_moe = moe_options(pos_s) if moe_pos else None

    def block_grads(positions: range) -> int:
        return sum(grad_bytes(x) for i in positions for x in shapes if x.startswith(f"layers.{layers[i]}."))

    def add(name: str, grads: int = 0, **parts: float) -> None:
        g = grads if pipelined or not steady else g_full
        m = {**base, "fsdp_buffers": fsdp.get(name, 0), **parts, "grads": g}
        if s.autocast:
            m["params"] = copies[name.removesuffix(LATER)]
        moments[name] = {key: int(m.get(key, 0)) for key in COMPONENTS}

    def add_largest(name: str, options: list[tuple[int, dict[str, float]]]) -> None:
        """The moment `name` at whichever of its points holds most (options: grads, parts)."""
        best = None
        for grads, parts in options:
            add(name, grads, **parts)
            if best is None or sum(moments[name].values()) > sum(best.values()):
                best = moments[name]
        moments[name] = best

    def micro_batch(kk: float, tag: str = "", acc: int | None = None) -> None:
        """The moments of one micro-batch's forward and backward with kk micro-batches' activations alive
        (`acc`: the gradients accumulated by earlier micro-batches, else those of this backward so far)."""
        a_blocks, a_emb = kk * sum(saved), kk * 8 * n * plan.embedding  # the token ids, for the embedding
        a_head = kk * loss["saved"] + (kk - 1) * loss["log_softmax"]  # other micro-batches' losses too

        def grads(x: int) -> int:
            g = x if acc is None else acc
            if pipelined and s.accum > 1:  # earlier accumulation steps' gradients: FSDP's sharded ones
                return g + g_full if s.fsdp else g_full  # beside the unsharded; else the same tensors
            return g

        options = [(grads(0), dict(activations=a_blocks + a_emb, transient=fwd_ws))]
        if pos_e is not None and pos_e < len(layers) - 1:  # the last MoE layer's forward, before a dense end
            before = (kk - 1) * sum(saved) + sum(saved[: pos_e + 1])
            ws = block_working_set(s, n, b, modes[pos_e], backward=False, layer=layers[pos_e], **moe_kw)
            options.append((grads(0), dict(activations=before + a_emb, transient=ws)))
        add_largest("last block forward" + tag, options)
        add("forward end" + tag, grads(0), activations=a_blocks + a_emb + a_head, logits=loss["forward"])
        if plan.head:
            everything = a_blocks + a_emb + a_head
            add("loss backward" + tag, grads(0), activations=everything, logits=loss["backward"])
            logits_grad = s.c * loss["rows"] * loss["vocab"]
            out_g = 0 if s.fsdp and not as_traced else head_g  # FSDP: they come after the norm's backward
            # A float8 output projection (filter_fqns without "output") runs eager, outside the compiled
            # blocks: its backward casts the (rows, V) logits' gradient to float8 through fp32 temporaries,
            # measured on H200 as 8 bytes per element above the bf16 projection (8B, 15.3 GiB).
            f8_head = "output" in float8_linears(s) and not as_traced
            f8_out = 8 * loss["rows"] * loss["vocab"] if f8_head else 0
            if s.loss == "chunked":  # no output matmul in backward: the head's gradients, what the loss
                # kept freed (FSDP: its unsharded gradient is in the FSDP buffers)
                add("output backward" + tag, grads(out_g), activations=everything - loss["kept"])
            else:
                add(
                    "output backward" + tag,
                    grads(out_g),
                    activations=everything,
                    logits=logits_grad,
                    float8=f8_out,
                    transient=conv * vocab // 4,
                )
        first = dict(activations=a_blocks - saved[-1] + a_emb, float8=f8)
        options = []
        if first_moe is None or pos_e < len(layers) - 1:  # the rank's last block is dense
            options.append(
                (grads(head_g + w2_grad), {**first, "transient": bwd_ws[-1] + conv * w2 + recast[-1]})
            )
            if fsdp and plan.layers:  # then FSDP reduces its gradients: the block's input gradient is
                # all that is left (its float8 casts gone)
                reduce = {
                    "transient": grad_in,
                    "float8": 0,
                    "fsdp_buffers": fsdp["first block backward" + REDUCE + tag],
                }
                options.append((grads(head_g + w2_grad), {**first, **reduce}))
        if first_moe is not None:  # the MoE layer's own gradients: those made by the point
            done = head_g + block_grads(range(pos_e + 1, len(layers)))
            alive = dict(activations=a_blocks - sum(saved[pos_e:]) + a_emb, float8=f8)
            options += [
                (grads(done + own), {**alive, "transient": bwd_ws[pos_e] + extra + recast[pos_e]})
                for extra, own in first_moe
            ]
        add_largest("first block backward" + tag, options)
        last = dict(activations=(kk - 1) * sum(saved) + a_emb, float8=f8)
        options = []
        if last_moe is None or pos_s > 0:  # the rank's first block is dense
            options.append((grads(g_all - emb_g), {**last, "transient": bwd_ws[0] + conv * w2 + recast[0]}))
            if fsdp and plan.layers:
                reduce = {
                    "transient": grad_in,
                    "float8": 0,
                    "fsdp_buffers": fsdp["last block backward" + REDUCE + tag],
                }
                options.append((grads(g_all - emb_g), {**last, **reduce}))
        if last_moe is not None:
            done = g_all - emb_g - block_grads(range(pos_s + 1))
            alive = dict(activations=(kk - 1) * sum(saved) + sum(saved[:pos_s]) + a_emb, float8=f8)
            options += [
                (grads(done + own), {**alive, "transient": bwd_ws[pos_s] + extra + recast[pos_s]})
                for extra, own in last_moe
            ]
        add_largest("last block backward" + tag, options)
        if plan.embedding:  # the table's gradient arrives last, with all the others
            # As traced under FSDP: the table's unsharded gradient (and its fp32 cast) before it is sharded.
            table = 0 if s.autocast else conv * emb_g // 4 * shard
            own = emb_g if table or (pipelined and s.fsdp) else 0  # its fp32 copy is in FSDP's buffers
            add(
                "embedding backward" + tag,
                grads(g_all - own),
                activations=(kk - 1) * sum(saved) + a_emb,
                transient=table,
            )

    micro_batch(k)
    if pipelined and s.microbatches > 1:  # (as_traced: every moment as steady, as the trace runs it)
        # A later micro-batch's backward: all gradients accumulated, min(k, m - 1) micro-batches in flight
        # (the first backward freed one; 1F1B's steady state refills it with the next forward).
        v = s.stages_per_rank
        micro_batch(min(k, (s.microbatches * v - 1) / v), LATER, g_all)
        if s.microbatches <= k:  # no forward after the first backward (GPipe, or as many as in flight)
            for name in ("last block forward", "forward end"):
                moments.pop(name + LATER)
    numels = [shard_numel(shape, shard) for _, shape, _ in param_shapes(s, plan)]
    opt_tmp = 0  # foreach: a sqrt(exp_avg_sq) for every tensor at once; for-loop: two for one tensor
    if s.optimizer == "adamw" and s.optimizer_impl not in ("fused", "fused_clip"):
        opt_tmp = 4 * sum(numels) if s.optimizer_impl == "foreach" else 8 * max(numels)
    add("optimizer step", g_full, transient=opt_tmp, params=0 if s.autocast else st["params"])
    peak_phase = max(moments, key=lambda m: sum(moments[m].values()))
    sizes = {key: max(m[key] for m in moments.values()) for key in COMPONENTS}
    grads_max = max(m["grads"] for m in moments.values())  # pipelined: the unsharded ones
    sizes.update(params=st["params"], grads=grads_max, activations=int(a_blocks + a_emb + a_head))
    freed = int(sum(saved)) if pipelined and s.fsdp and s.microbatches > 1 else 0
    return Breakdown(plan.rank, sizes, moments, peak_phase, sum(moments[peak_phase].values()), freed)


def stranded_after_first_backward(b: Breakdown) -> int:
    """Bytes the caching allocator holds free but cannot reuse at a later micro-batch's backward.

    Seen in a CUDA memory snapshot of the 8B under PP2 x FSDP2 (docs/benchmarks/estimator_gpu.md): the
    first micro-batch's backward frees its saved activations block by block while the stage's unsharded
    fp32 gradients are allocated one parameter at a time, each larger than the activation blocks just
    freed (a 14,336 x 4096 fp32 gradient is 224 MiB against 112 MiB for a w1 output of one sequence), so
    they take new segments and the freed blocks stay cached. A peak in a later micro-batch's backward
    therefore sits on top of one micro-batch of freed activations.
    """
    return b.first_backward_freed if b.peak_phase.endswith(LATER) else 0


def _autocast_copies(
    s: RunPlan, plan: RankPlan, modes: list[str], *, as_traced: bool
) -> tuple[dict[str, int], list[int]]:
    """autocast's bf16 weight copies at each moment, and each block's re-cast in its recomputation.

    autocast caches the copy of each weight it casts until the outermost autocast exits. On CUDA,
    backward runs on another thread, where the first checkpoint recomputation (a checkpointed block)
    leaves autocast at nesting 0 and clears that cache (measured on H200); from
    then on only copies that autograd saved (blocks that are not checkpointed, the output layer until its
    backward) stay, and a recomputed block casts its weights again. Compiled blocks cast inside the graph:
    no cache. A CPU trace runs backward on the calling thread, where the cache survives (`as_traced`).
    Float8 linears cast their fp32 weights to float8 themselves, outside autocast (the trace runs bf16).
    """
    shapes = param_shapes(s, plan)
    f8 = frozenset() if as_traced else float8_linears(s)
    # each block's cast weights (a MoE block's router and shared expert; not its experts, which the grouped
    # GEMM casts at each call: `memory_moe.moe_saved`)
    per_layer: dict[int, int] = {}  # (one pass over the weights: the 405B has 126 blocks of them)
    for name, (d0, d1), lin in shapes:
        if lin and name.startswith("layers.") and _weight_name(name) not in f8:
            i = int(name.split(".")[1])
            per_layer[i] = per_layer.get(i, 0) + d0 * d1
    block = [2 * per_layer.get(i, 0) for i in plan.layers]
    out = 0 if "output" in f8 else 2 * sum(d0 * d1 for name, (d0, d1), _ in shapes if name == "output")
    if s.args.tie_embeddings and plan.embedding and plan.head and "output" not in f8:
        out += 2 * shapes[0][1][0] * shapes[0][1][1]
    ckpt = [m in ("full", "op", "parts") for m in modes] if plan.layers else []
    cached = 0 if s.compile.enable and not as_traced else sum(x for x, c in zip(block, ckpt) if c)
    kept = sum(x for x, c in zip(block, ckpt) if not c)  # saved by autograd
    order = [
        "last block forward",
        "forward end",
        "loss backward",
        "output backward",
        "first block backward",
        "last block backward",
        "embedding backward",
    ]
    if as_traced:
        cleared = len(order)
    else:
        cleared = order.index("first block backward") if any(ckpt) else len(order)
    copies = {"optimizer step": 0}
    for i, name in enumerate(order):
        if s.loss == "chunked":  # the chunked loss casts the weight itself, for its forward only
            with_out = name == "forward end"
        else:
            with_out = name in ("forward end", "loss backward", "output backward") or (as_traced and i > 0)
        copies[name] = (cached if i < cleared else 0) + kept + (out if with_out else 0)
    again = not as_traced and (cleared < len(order) or s.compile.enable)
    return copies, [x if c and again else 0 for x, c in zip(block, ckpt)] or [0]


def analyze(
    s: RunPlan, *, as_traced: bool = False, moe_imbalance: float = moe.DEFAULT_IMBALANCE
) -> Breakdown:
    """The rank whose peak is largest (with PP, ranks hold different layers and micro-batches)."""
    ranks = (analyze_rank(s, p, as_traced=as_traced, moe_imbalance=moe_imbalance) for p in rank_plans(s))
    return max(ranks, key=lambda b: b.peak)
