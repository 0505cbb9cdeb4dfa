"""The mixture-of-experts (Llama 4) terms of the analytic memory model (`memory_model`).

A MoE layer (`models/llama4/moe.py`) replaces a block's dense feed-forward with a router (`gate`, E x dim),
E routed SwiGLU experts stacked in `w13` (E, dim, 2 x hidden) and `w2` (E, hidden, dim), a shared expert
(a dense SwiGLU of the experts' width) and two buffers of E numbers. Layer i is MoE when (i + 1) %
moe_every == 0. Here: which parameters a rank holds and over how many ranks FSDP shards each (expert
parallel keeps E / ep experts per rank; FSDP shards them over the other data-parallel ranks; under tensor
parallel the MoE layer is whole on every tp rank and FSDP shards it over the tp ranks too), the FSDP
units of their own the layer gets under EP and TP, and what one MoE layer keeps for backward and holds
at its forward and backward peaks.

Tokens: a rank's MoE layer routes N tokens (1/tp of the sequence under tensor and sequence parallel) and
computes S = N x top_k rows. Under expert parallel the rows go to the ranks of their experts: a rank
receives R = S x `imbalance` rows, where `imbalance` is the busiest EP rank's load over the balanced
share (routing is capacity-free, so R varies step to step; the estimate assumes the figure it is given,
`DEFAULT_IMBALANCE` unless told). Without expert parallel a rank's experts compute its own S rows, which
no imbalance changes. docs/estimator_method.md derives every term.
"""

from __future__ import annotations

import math

from titanrush.run.plan import RunPlan

# The busiest EP rank's received rows over the balanced share that the estimate assumes by default. The
# trainer logs the per-expert max/mean (`moe_imbalance`), an upper bound of the per-rank figure; with the
# routing bias it settles near 1.1-1.3 (docs/moe.md), and early steps run higher.
DEFAULT_IMBALANCE = 1.25
# Dense feed-forward entries of `memory_model.block_saved` that a MoE layer replaces.
DENSE_FFN = (
    "ffn in",
    "w1 out",
    "w3 out",
    "silu out",
    "gate",
    "w2 out",
    "w1 out, w3 out",
    "float8 FFN weights (all-gathered)",
)


def is_moe(s: RunPlan, layer: int) -> bool:
    """Whether layer `layer` (its index in the whole model) has a MoE feed-forward."""
    return s.moe and s.args.is_moe(layer)


def qk_norm(s: RunPlan, layer: int) -> bool:
    """Whether layer `layer` RMS-normalizes its queries and keys (Scout's RoPE layers)."""
    return s.moe and s.args.qk_norm and s.args.uses_rope(layer)


def qk_norm_saved(s: RunPlan, n: int) -> int:
    """Eager QK-norm on n tokens: the fused RMSNorm keeps its fp32 input (q and k upcast) and an fp32 1/rms
    per head and token; its output replaces the roped q and k that attention keeps."""
    heads = (s.args.n_heads + s.args.kv_heads) // s.tp
    return 4 * n * heads * (s.args.head_dim + 1)


def shard_degrees(s: RunPlan) -> tuple[int, int]:
    """FSDP shard degrees of a MoE layer's own parameters (router, shared expert) and of its experts.

    Without tensor parallel the layer's own parameters are in the block's unit (dp_shard x cp); under it
    the layer is a unit over dp_shard x cp x tp (the tp ranks are data-parallel ranks for it). The experts
    are sharded like the layer's own parameters without expert parallel; with it, over those ranks
    divided by ep (efsdp x cp, x tp), each EP rank holding E / ep of them.
    """
    layer = (s.fsdp_shard if s.fsdp else 1) * (s.tp if s.moe_tp else 1)
    return layer, layer // s.ep


def fsdp_degree(s: RunPlan, name: str) -> int:
    """FSDP's shard degree of the parameter `name` (as `memory_model.param_shapes` names it)."""
    if ".moe." in name:
        return shard_degrees(s)[1 if ".moe.experts." in name else 0]
    return s.fsdp_shard if s.fsdp else 1


def expert_rows_dim(s: RunPlan) -> bool:
    """Whether FSDP shards the experts on their first (experts) dimension: where each of its ranks can
    hold whole experts (`parallel/expert_parallel.shard_experts`), else on the next dimension."""
    return (s.args.n_experts // s.ep) % shard_degrees(s)[1] == 0


def moe_param_shapes(s: RunPlan, layer: int) -> list[tuple[str, tuple[int, int], bool]]:
    """(name, local shape (FSDP's sharded dimension, the rest), is a linear weight) of a MoE layer's
    parameters on a rank: the router and shared expert whole, the rank's E / ep experts. The experts are
    no linears: autocast does not cache their casts (the grouped GEMM casts them at every call)."""
    a = s.args
    d, h, e_local = a.dim, a.expert_hidden, a.n_experts // s.ep
    p = f"layers.{layer}.moe."
    out = [(p + "router.gate", (a.n_experts, d), True)]
    if a.shared_expert:
        out += [
            (p + "shared_expert.w1", (h, d), True),
            (p + "shared_expert.w3", (h, d), True),
            (p + "shared_expert.w2", (d, h), True),
        ]
    if expert_rows_dim(s):
        out += [(p + "experts.w13", (e_local, d * 2 * h), False), (p + "experts.w2", (e_local, h * d), False)]
    else:  # sharded on dim 1: w13's dim rows, w2's hidden rows
        out += [(p + "experts.w13", (d, e_local * 2 * h), False), (p + "experts.w2", (h, e_local * d), False)]
    return out


def buffer_bytes(s: RunPlan, layers: list[int]) -> int:
    """The routing bias (fp32) and the step's token counts (int64) of each MoE layer among `layers`."""
    return 12 * s.args.n_experts * sum(is_moe(s, i) for i in layers) if s.moe else 0  # (dense: no n_experts)


def local_expert(s: RunPlan, name: str) -> bool:
    """Whether parameter `name` is an expert weight that no FSDP unit manages (`RunPlan.local_experts`:
    expert parallel over every data-parallel rank, compiled): it stays fp32 on its rank, is cast to the
    compute dtype at its GEMMs, and its gradient is its own."""
    return s.local_experts and ".moe.experts." in name


def local_casts(s: RunPlan) -> int:
    """Bytes of the compute-dtype casts of a rank's local experts' weights (w13 and w2), made at their
    grouped GEMMs and made again for their backward (`GroupedExperts.recast`, or the recomputation of a
    checkpointed block), not kept (0 where nothing is cast). Float8 experts, which keep theirs, are not
    modelled (`memory_fit.unmodelled`)."""
    if not s.local_experts or s.precision != "bf16":
        return 0
    a = s.args
    return 2 * (a.n_experts // s.ep) * 3 * a.dim * a.expert_hidden


def inner_unit(s: RunPlan, name: str) -> str | None:
    """The FSDP unit of its own (inside the block's) that holds parameter `name`, or None (the block's).

    `models/llama/parallelize._shard_moe_layers`: under expert parallel the experts are a unit (local
    experts none: `local_expert`); under tensor parallel the MoE layer is one (with the experts, unless EP
    gives them their own).
    """
    if ".moe." not in name:
        return None
    block = name.split(".moe.")[0]
    if s.ep > 1 and ".moe.experts." in name:
        return block + ".moe.experts"
    return block + ".moe" if s.moe_tp else None


def rows(s: RunPlan, tokens: int, imbalance: float) -> tuple[int, int]:
    """(S, R): the rows a rank routes (tokens x top_k) and the rows its experts compute (received from
    the EP peers: the busiest rank's share, S x imbalance; without EP its own S)."""
    sent = tokens * s.args.top_k
    return sent, math.ceil(sent * imbalance) if s.ep > 1 else sent


def moe_saved(
    s: RunPlan, tokens: int, batch: int, mode: str, *, imbalance: float, keep_all: bool = False
) -> dict[str, int]:
    """Bytes one MoE layer keeps for backward (its feed-forward part of the block), by tensor.

    `tokens`: the N tokens the layer routes on the rank. Modes as `memory_model.block_saved`'s (full keeps
    only the block input, which the block counts; parts: the layer of a block checkpointed by parts).
    Eager, what each op saves (read off autograd's saved tensors on CPU, docs/estimator_method.md);
    compiled, what inductor's partitioner keeps (read off it on CPU).
    """
    a, c, r = s.args, s.c, s.r
    d, h, n_exp, e_local = a.dim, a.expert_hidden, a.n_experts, a.n_experts // s.ep
    sent, recv = rows(s, tokens, imbalance)
    shared = a.shared_expert
    if mode == "full":
        return {}
    if mode == "op":  # matmul and grouped-GEMM outputs kept; a MoE block's aten.mm calls run wq, wk, wv,
        # wo, the router, then the shared expert's w1, w3, w2 (the 5th to 8th)
        out = {
            "router logits": c * tokens * n_exp,
            "experts w13 out": 2 * c * recv * h,
            "experts w2 out": c * recv * d,
        }
        if shared:
            out |= {
                "shared w1 out": c * tokens * h,
                "shared w3 out": c * tokens * h,
                "shared w2 out": c * tokens * d,
            }
        recomputed: tuple[int, ...] = ()
        if s.ac.op_matmuls == "alternate" and not keep_all:
            recomputed = (6, 8)
        elif s.ac.op_matmuls == "all_but_w3":
            recomputed = (6,)
        names = {6: "shared w1 out", 8: "shared w2 out"}
        for k in recomputed:
            out.pop(names[k], None)
        if s.compile.enable:  # backward needs neither down projection's output (as a dense block's w2)
            out.pop("experts w2 out"), out.pop("shared w2 out", None)
        return out
    # EP: the regrouping permutation and the combine's inverse (int64 per received row), kept by their
    # index ops; the received rows replace the rank's own as the experts' input.
    ep_index = 16 * recv if s.ep > 1 else 0
    indices = 36 * sent  # (N, k) choices, order, token, inverse (int64), the chosen scores (fp32)
    if mode == "compiled":
        out = {
            "router logits": c * tokens * n_exp,
            "routing indices": indices + 4 * e_local + ep_index,
            "experts in": 2 * c * recv * d,
            "experts hidden": 3 * c * recv * h,
        }
        if shared:
            out["shared expert"] = 3 * c * tokens * h  # w1, w3 outputs and the gate, as a dense FFN
        if s.autocast:  # the partitioner keeps the grouped GEMM's casts of the fp32 weights, as eager does
            out["experts' bf16 weights"] = 2 * e_local * 3 * d * h
        return out | _router_losses(s, tokens, batch)
    # Eager. The layer's input is kept by the router and the shared expert's w1 and w3 (under autocast
    # each keeps its own bf16 cast); the gathered tokens are scaled by their score in fp32.
    casts = 1 + 2 * shared
    out = {
        "MoE in": (2 * casts if s.autocast else r) * tokens * d,
        "router scores": 4 * tokens * n_exp,  # sigmoid's fp32 output
        "routing indices": indices + 8 * e_local + ep_index,  # (+ the two grouped GEMMs' int32 offsets)
        "tokens gathered (fp32)": 4 * sent * d,
        "experts in": c * recv * d,
        "experts hidden": 4 * c * recv * h,  # w13's output (gate and up), silu's output, the product
    }
    if shared:
        out["shared expert"] = 4 * c * tokens * h
    if mode == "parts":  # by parts: the router and the shared expert are per-op checkpointed regions, which
        # keep their input (the norm's output, once) and their matmul outputs; the scores only where the
        # balance loss keeps them; the rest as eager
        out |= {"MoE in": r * tokens * d, "router logits": c * tokens * n_exp}
        if not a.aux_loss_weight:
            del out["router scores"]
        if shared:
            del out["shared expert"]
            out |= {"shared w1, w3 out": 2 * c * tokens * h, "shared w2 out": c * tokens * d}
    if s.autocast:  # the grouped GEMM casts the experts' fp32 weights at each call and keeps the casts
        out["experts' bf16 weights"] = 2 * e_local * 3 * d * h
    return out | _router_losses(s, tokens, batch)


def _router_losses(s: RunPlan, tokens: int, batch: int) -> dict[str, int]:
    """What the balance loss and the z-loss keep, where their weights are not zero."""
    a = s.args
    out = {}
    if a.z_loss_weight:  # logsumexp keeps the fp32 logits and its result
        out["z-loss"] = 4 * tokens * a.n_experts + 4 * tokens
    if a.aux_loss_weight:  # the scores' sum per token; the per-sequence means of the two factors
        out["balance loss"] = 4 * tokens + 8 * batch * a.n_experts
    return out


def forward_live(s: RunPlan, tokens: int, mode: str, *, imbalance: float) -> int:
    """Bytes a MoE layer's forward holds beyond what its block keeps for backward, at its peak: the
    experts' SwiGLU, their down projection (with EP, the combine), or the shared expert and the sum.

    The layer's input (full, op), its routed rows `routed_in` and output `routed_out` are live for the
    whole forward (locals of `MoE.forward`); what the mode keeps for backward is counted once, by
    `moe_saved`.
    """
    a, c, r = s.args, s.c, s.r
    d, h, e_local, shared = a.dim, a.expert_hidden, a.n_experts // s.ep, a.shared_expert
    sent, recv = rows(s, tokens, imbalance)
    ep = s.ep > 1
    # the experts' input and hidden tensors are kept for backward (by parts: the experts run as eager)
    kept = mode in ("none", "compiled", "parts")
    # routed_in: kept as the experts' input where no cast or exchange comes between (eager, no EP)
    routed_in = 0 if kept and not (ep or s.autocast) else (4 if s.autocast else r) * sent * d
    received = 0 if kept or not ep else c * recv * d  # EP: the regrouped rows, the experts' input
    router = (c + 4) * tokens * a.n_experts  # the logits and the fp32 scores (Routing, alive)
    # the norm's output, where not kept (by parts the router's region keeps it)
    layer_in = 0 if (kept and not s.autocast) or mode == "parts" else r * tokens * d
    hidden = {"none": 0, "compiled": 0, "parts": 0, "op": 2, "full": 4}[mode]  # of w13's out, silu, product
    swiglu = hidden * c * recv * h
    if s.autocast and not kept:  # at w13's grouped GEMM: its bf16 casts of the rows and of w13, not kept
        swiglu = max(
            swiglu, 2 * recv * d + 2 * e_local * d * 2 * h + (2 * c * recv * h if mode == "full" else 0)
        )
    swiglu += routed_in + received + local_casts(s)  # (made for the GEMMs, not kept)
    down = 0 if mode == "op" else c * recv * d  # (op: cached, kept)
    combine = routed_in + received + down + (c * recv * d + c * sent * d if ep else 0)  # out[inverse], a2a
    out = c * tokens * d  # routed_out gathered back to its tokens (top-k: summed over a token's k rows)
    routed_out = 0 if mode == "op" and not ep else c * sent * d  # (op: the cached down projection's output)
    end = routed_in + routed_out + out
    points = [swiglu, combine]
    if shared:  # the shared expert's output and the sum; full / op / parts: its SwiGLU too (3 / 2 / 2 of
        # N x hidden)
        points += [end + 2 * c * tokens * d - (c * tokens * d if mode in ("op", "parts") else 0)]
        if mode in ("full", "op", "parts"):
            points.append(end + (3 if mode == "full" else 2) * c * tokens * h)
    else:
        points.append(end)
    return max(points) + router + layer_in


def recompute_live(s: RunPlan, tokens: int, *, imbalance: float) -> int:
    """Bytes a checkpointed MoE layer's recomputation holds beyond its eager saved tensors (`moe_saved`),
    at its peak: torch's non-reentrant checkpoint stops recomputing once the last saved tensor is made
    (the shared expert's product, w2's input), so the forward's live `routed_in` (where it is not kept),
    `routed_out` and its gather back to the tokens; with EP, earlier, the combine's tensors, before the
    shared expert's saved tensors exist. Beside them the block's mid-residual where it is bf16 (the norm
    keeps an fp32 copy)."""
    a, c, r = s.args, s.c, s.r
    d, h = a.dim, a.expert_hidden
    sent, recv = rows(s, tokens, imbalance)
    routed_in = (4 if s.autocast else r) * sent * d if s.ep > 1 or s.autocast else 0
    layer_in = 4 * tokens * d if s.autocast else 0  # (autocast keeps only its bf16 casts)
    out = c * tokens * d
    points = [routed_in + c * sent * d + out + layer_in]
    if s.ep > 1:  # (local experts: their weights' casts made again for the GEMMs)
        points.append(
            routed_in
            + 2 * c * recv * d
            + c * sent * d
            - 4 * c * tokens * h * a.shared_expert
            + local_casts(s)
        )
    return max(points) + (r * tokens * d if r == 2 else 0)


def backward_points(s: RunPlan, tokens: int, *, imbalance: float) -> list[tuple[int, tuple[str, ...], str]]:
    """Where a MoE layer's backward can peak: (bytes beyond its block's saved tensors and the incoming
    gradient, the layer's parameters whose gradients exist by then, the one whose gradient is being made
    there, whose bf16 gradient or unsharded copy sits beside its fp32 one; "" for none).

    The shared expert's backward runs first (it ran last in forward): its SwiGLU's input gradients
    (2 x N x hidden) beside everything the block saved. The routed experts' follow, the shared expert's
    saved tensors freed and its input gradient (N x dim) kept for the sum: the gather's gradient (the
    rows' gradient scattered into zeros, S x dim twice; top-k > 1: and the expanded gradient's copy),
    with EP the combine's (the reverse all-to-all and the regrouping, 2 x R x dim), then the SwiGLU's
    input gradients (2 x R x hidden) with w2's gradient made, then w13's backward (the rows' gradient
    R x dim, w13's gradient) with the experts' hidden tensors freed but the SwiGLU's gradient (2 x R x
    hidden).
    """
    a, c = s.args, s.c
    d, h = a.dim, a.expert_hidden
    sent, recv = rows(s, tokens, imbalance)
    shared: tuple[str, ...] = ()
    points = []
    after = 0  # what the shared expert's backward leaves: its saved tensors freed, its input gradient
    if a.shared_expert:
        shared = ("shared_expert.w1", "shared_expert.w3", "shared_expert.w2")
        after = -4 * c * tokens * h + c * tokens * d
        points.append((2 * c * tokens * h, ("shared_expert.w2",), ""))
    # the gather back to the tokens: its backward's zeros and scatter of the rows' gradient (top-k > 1:
    # with the summed gradient expanded to a copy)
    points.append((after + (3 if a.top_k > 1 else 2) * c * sent * d, shared, ""))
    if s.ep > 1:
        points.append((after + c * sent * d + 2 * c * recv * d, shared, ""))
    casts = local_casts(s)  # (local experts: cast again for these GEMMs)
    points.append((after + 2 * c * recv * h + casts, (*shared, "experts.w2"), ""))
    points.append(
        (
            after - 2 * c * recv * h + c * recv * d + casts,
            (*shared, "experts.w2", "experts.w13"),
            "experts.w13",
        )
    )
    return points
