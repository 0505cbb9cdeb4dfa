"""One real training step of the local model, traced under FakeTensorMode: the peak of live tensor bytes.

No GPU and no memory are needed: fake tensors carry shapes, dtypes and strides only. A `TorchDispatchMode`
(`LiveBytes`) sees every op's outputs and follows their storages until they die (weak references), by
category: parameters, gradients, optimizer states, compute copies of the weights, buffers, and the rest
(activations and temporaries). The same tracker runs on real tensors, which is how the tests check it.

What runs is this rank's share of the work on one device: the single-device Llama (or Llama 4) with the
rank's layers (PP), its TP shard of the heads, FFN and vocabulary, its sequence share (CP) and micro-batch,
with the job's activation checkpointing (the real `apply_ac`), precision and optimizer. FSDP is emulated:
states are weighted 1/shard degree (each parameter its own: a MoE layer's experts and, under TP, the
whole layer are sharded over other ranks than the dense weights), and with bf16 the weights are bf16
copies while fp32 masters take the gradients. A MoE layer runs the real router, permutation and experts;
under expert parallel the rank holds its E / ep experts and expert parallel's dispatch and combine run
with their tensors but without peers, receiving `moe_imbalance` times the rows it sends
(`_LocalExchange`). What it cannot run (compile, float8, FSDP's buffers, sequence parallel, the CUDA
context) is listed in `not_traced`; the analytic model supplies those parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titanrush.models.llama.loss import cross_entropy
from titanrush.models.llama.model import Llama, RMSNorm
from titanrush.models.llama4 import Llama4, grouped_gemm
from titanrush.models.llama4.model import Llama4Block
from titanrush.models.llama4.moe import GroupedExperts
from titanrush.optim import build_optimizer
from titanrush.parallel.activation_checkpoint import apply_ac
from titanrush.parallel.expert_parallel import _Permute
from titanrush.parallel.grad_clip import clip_grad_norm_
from titanrush.run.memory_model import (
    LOWBIT,
    LOWBIT_MIN_NUMEL,
    RankPlan,
    keeps_all_matmuls,
    rank_plans,
)
from titanrush.run.memory_moe import DEFAULT_IMBALANCE, shard_degrees
from titanrush.run.plan import RunPlan

CATEGORIES = ("param", "param_copy", "grad", "optimizer", "buffer", "other")


class LiveBytes(TorchDispatchMode):
    """Live storage bytes by category, and the peak of their weighted sum.

    Args:
        weights: Per-category factor applied to the sum (e.g. 1/4 for states sharded 4 ways); 1 if absent.
    """

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        super().__init__()
        self.weights = {c: 1.0 for c in CATEGORIES} | (weights or {})
        # Storages of weights cast at every call, outside autocast's cache (a MoE layer's experts, which
        # the grouped GEMM casts itself): their casts are kept for backward like activations.
        self.cast_per_call: set[int] = set()
        self.live: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        self.phase = ""
        self.peak = 0.0
        self.peak_phase = ""
        self.peak_live: dict[str, float] = dict(self.live)
        self.snapshots: dict[str, dict[str, float]] = {}
        self.phase_peaks: dict[str, float] = {}
        self._info: dict[int, list[Any]] = {}  # id(storage) -> [category, nbytes, weakref]

    def track(self, t: torch.Tensor, category: str = "other", scale: float = 1.0) -> None:
        """Count t's storage under `category` if it is not counted yet (`scale` x its bytes: a tensor
        sharded over other ranks than its category's weight says)."""
        st = t.untyped_storage()
        key = id(st)
        if key in self._info:
            return
        ref = weakref.ref(st, lambda _, key=key: self._free(key))
        self._info[key] = [category, st.nbytes() * scale, ref]
        self.live[category] += st.nbytes() * scale

    def retag(self, t: torch.Tensor, category: str, scale: float = 1.0) -> None:
        """Move t's storage to another category (a new tensor that turned out to be a gradient), its bytes
        counted `scale` times."""
        self.track(t, category)
        info = self._info[id(t.untyped_storage())]
        self.live[info[0]] -= info[1]
        info[1] = t.untyped_storage().nbytes() * scale
        self.live[category] += info[1]
        info[0] = category
        self._update()

    def category(self, t: torch.Tensor) -> str | None:
        info = self._info.get(id(t.untyped_storage()))
        return info[0] if info else None

    def snapshot(self, name: str) -> None:
        self.snapshots[name] = dict(self.live)

    def weighted(self, live: dict[str, float]) -> dict[str, float]:
        return {c: live[c] * self.weights[c] for c in CATEGORIES}

    def _free(self, key: int) -> None:
        info = self._info.pop(key, None)
        if info is not None:
            self.live[info[0]] -= info[1]

    def _update(self) -> None:
        total = sum(self.live[c] * self.weights[c] for c in CATEGORIES)
        if total > self.phase_peaks.get(self.phase, 0.0):
            self.phase_peaks[self.phase] = total
        if total > self.peak:
            self.peak, self.peak_phase, self.peak_live = total, self.phase, dict(self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        category = "other"
        # A cast of a weight (autocast's cached bf16 copy) is a compute copy of the parameters.
        if func is torch.ops.aten._to_copy.default and self.category(args[0]) == "param":
            category = "other" if id(args[0].untyped_storage()) in self.cast_per_call else "param_copy"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, category)
        self._update()
        return out


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm saving what CUDA's fused kernel saves (input, 1/rms, weight); the CPU build decomposes
    `rms_norm` into ops that also keep the normalized input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        rstd = (norm.square_() / x.shape[-1] + eps).rsqrt_()
        out = x * rstd
        if weight is not None:
            out.mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        xhat = x * rstd
        gw = None
        if weight is not None:
            gw = (grad * xhat).flatten(0, -2).sum(0).to(weight.dtype)
            grad = grad * weight
        dot = (grad * xhat).mean(-1, keepdim=True)
        gx = (grad - xhat.mul_(dot)).mul_(rstd)
        return gx.to(x.dtype), gw, None


class _TraceRMSNorm(RMSNorm):
    """The model's RMSNorm through `_FusedRMSNorm`, so that a CPU trace keeps what a CUDA run keeps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x.float(), self.weight.float(), self.eps).type_as(x)


@dataclass
class TraceResult:
    """The traced peak of one rank, weighted to per-GPU bytes."""

    rank: int
    peak: int
    peak_phase: str
    at_peak: dict[str, int]
    activations: int  # saved at the end of forward, times the micro-batches in flight
    phase_peaks: dict[str, int] = field(default_factory=dict)
    not_traced: list[str] = field(default_factory=list)


class _LowBitStates:
    """Optimizer states laid out as torchao's AdamW8bit/4bit keeps them (codes, block scales, qmap); the
    step itself (a compiled kernel) is not traced."""

    def __init__(self, params: list[nn.Parameter], name: str) -> None:
        code, block, qmap = LOWBIT[name]
        self.params = params
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for p in params:
            st: dict[str, torch.Tensor] = {"step": torch.zeros(())}
            for key in ("exp_avg", "exp_avg_sq"):
                if p.numel() >= LOWBIT_MIN_NUMEL and p.numel() % block == 0:
                    st[key + ".codes"] = torch.empty(int(p.numel() * code), dtype=torch.uint8)
                    st[key + ".scale"] = torch.empty(p.numel() // block)
                    st[key + ".qmap"] = torch.empty(qmap)
                else:
                    st[key] = torch.zeros_like(p)
            self.state[p] = st

    def step(self) -> None:
        pass


def _rows_of(src: torch.Tensor, rows: int) -> torch.Tensor:
    """A new tensor of `rows` rows shaped as `src`'s: its first rows, zeros after (only shapes matter)."""
    out = src.new_empty((rows, *src.shape[1:]))
    k = min(rows, src.shape[0])
    out[:k].copy_(src[:k])
    out[k:].zero_()
    return out


class _LocalAllToAll(torch.autograd.Function):
    """`expert_parallel._AllToAll` without peers: forward a new tensor of the `rows` rows received,
    backward a new tensor of the gradient sent back (as many rows as were sent)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.sent = x.shape[0]
        return _rows_of(x, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _rows_of(grad, ctx.sent), None


class _LocalExchange(nn.Module):
    """Expert parallel's dispatch and combine around the rank's E / ep experts (`parallel/expert_parallel`:
    `ExpertParallel.dispatch` and `combine`), with the tensors they allocate: the received counts, the
    regrouping sort of the received rows, the two all-to-alls' outputs and the two permutations (the
    indices kept for backward); not the padding of a rank that receives fewer than two rows. The rank
    receives `imbalance` times the rows it sends (1: a balanced load; the busiest rank's share
    otherwise). Only the values differ (no peers)."""

    def __init__(self, experts: GroupedExperts, ep: int, imbalance: float) -> None:
        super().__init__()
        self.experts, self.ep, self.imbalance = experts, ep, imbalance

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local = counts.numel() // self.ep
        rows = math.ceil(x.shape[0] * self.imbalance)  # (memory_moe.rows)
        with torch.no_grad():
            matrix = counts.new_empty(counts.shape).copy_(counts).reshape(self.ep, local)
            index = torch.argsort(torch.zeros(rows, dtype=torch.long), stable=True)
            inverse = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel()))
        received = _Permute.apply(_LocalAllToAll.apply(x, rows), index, inverse)
        out = self.experts(received, matrix.sum(0))
        return _LocalAllToAll.apply(_Permute.apply(out, inverse, index), x.shape[0])


class _GroupedMMShapes(torch.autograd.Function):
    """The grouped GEMM's allocations for dtypes its fake-tensor shape function refuses (it takes bf16
    only, as CUDA's kernel; the CPU kernel the trace stands for takes fp32 too): the (T, N) output, the
    inputs and offsets kept for backward, the two gradients. The fake trace equals a real CPU step
    through the real kernel (tests/unit/test_estimate_moe.py)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        a, b, _ = ctx.saved_tensors
        return grad.new_empty(a.shape), grad.new_empty(b.shape), None


@contextlib.contextmanager
def _fake_grouped_kernel() -> Any:
    """Within the fake trace: the grouped GEMM of non-bf16 inputs through `_GroupedMMShapes`."""
    kernel = grouped_gemm.KERNEL
    if kernel is None:
        yield
        return

    def run(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.bfloat16:
            return kernel(a, b, offs=offs)
        return _GroupedMMShapes.apply(a, b, offs)

    with grouped_gemm.kernel_in_use(run):
        yield


def _llama4_layers(s: RunPlan, plan: RankPlan, model: Llama4, imbalance: float) -> None:
    """The rank's Llama 4 blocks with their indices in the whole model (which are MoE, which use RoPE),
    numbered 0.. as the local model runs them; under EP each MoE layer holds its E / ep experts and
    receives `imbalance` times the rows it sends."""
    a = model.args
    model.layers = nn.ModuleDict({str(j): Llama4Block(i, a) for j, i in enumerate(plan.layers)})
    if s.ep > 1:
        for block in model.layers.values():
            if block.moe is not None:
                local = GroupedExperts(a.dim, a.expert_hidden, a.n_experts // s.ep, grouped=a.grouped_mm)
                block.moe.experts = _LocalExchange(local, s.ep, imbalance)


def build_local_model(s: RunPlan, plan: RankPlan, *, moe_imbalance: float = DEFAULT_IMBALANCE) -> Llama:
    """The rank's share of the Llama as a single-device model: its layers, TP-local shapes, AC applied
    (a Llama 4's busiest EP rank: `moe_imbalance`, `memory_moe`)."""
    a = s.args
    backend = "math" if a.attn_backend == "math" else "sdpa"  # flash, cudnn, flex: no CPU backward
    # compile_loss off: the trace runs eager (the analytic model says what compile changes)
    local = dataclasses.replace(
        a, n_layers=len(plan.layers), attn_backend=backend, compile_loss=False, expand_kv=False
    )
    model = Llama4(local) if s.moe else Llama(local)
    if s.moe:
        _llama4_layers(s, plan, model, moe_imbalance)
    if s.tp > 1:  # what each TP rank holds: its heads, its FFN columns, its vocabulary rows (a MoE layer
        # is whole on every tp rank)
        d, hd, tp = a.dim, a.head_dim, s.tp
        hq, hkv, f = a.n_heads // tp * hd, a.kv_heads // tp * hd, math.ceil(a.ffn_hidden / tp)
        for block in model.layers.values():
            att, ffn = block.attention, block.feed_forward
            att.wq, att.wk, att.wv = (
                nn.Linear(d, hq, bias=False),
                nn.Linear(d, hkv, bias=False),
                nn.Linear(d, hkv, bias=False),
            )
            att.wo = nn.Linear(hq, d, bias=False)
            if ffn is None:
                continue
            ffn.w1, ffn.w3, ffn.w2 = (
                nn.Linear(d, f, bias=False),
                nn.Linear(d, f, bias=False),
                nn.Linear(f, d, bias=False),
            )
        vocab = math.ceil(a.vocab_size / tp)
        model.tok_embeddings = nn.Embedding(vocab, d)
        model.output = nn.Linear(d, vocab, bias=False)
        if a.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
    if not plan.embedding:
        model.tok_embeddings = None
    if not plan.head:
        model.norm, model.output = None, None
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = _TraceRMSNorm
    # The local model numbers its blocks 0..len(plan.layers) - 1: the plan's share of the last N; the trace
    # offloads nothing.
    last = sum(keeps_all_matmuls(s, layer) for layer in plan.layers)
    apply_ac(model, dataclasses.replace(s.ac, op_all_last=last, offload_first=0, moe_by_parts=s.moe_by_parts))
    return model


def _to_bf16(model: nn.Module) -> list[nn.Parameter]:
    """Replace every parameter by a bf16 one (tied ones stay tied); return the new parameters."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in new:
                new[id(p)] = nn.Parameter(p.detach().to(torch.bfloat16))
            setattr(module, name, new[id(p)])
    return list(new.values())


def _moe_scales(s: RunPlan, model: nn.Module) -> dict[int, float]:
    """id(parameter) -> (the dense weights' FSDP degree / its own) for a MoE layer's parameters whose FSDP
    degree differs (`memory_moe.shard_degrees`: the experts under EP, the whole layer under TP)."""
    dense = s.fsdp_shard if s.fsdp else 1
    layer, experts = shard_degrees(s) if s.moe else (dense, dense)
    out = {}
    for name, p in model.named_parameters():
        if ".moe." in name:
            degree = experts if ".moe.experts." in name else layer
            if degree != dense:
                out[id(p)] = dense / degree
    return out


def _unique(params: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def trace_rank(
    s: RunPlan,
    plan: RankPlan,
    *,
    fake: bool = True,
    watch: contextlib.AbstractContextManager | None = None,
    moe_imbalance: float = DEFAULT_IMBALANCE,
) -> TraceResult:
    """Trace one optimizer step of the rank's local model and weight the live bytes to per-GPU bytes.

    The optimizer states are created first (by a step on zero gradients), so the traced step is a
    steady-state one.

    Args:
        s: The setup.
        plan: The pipeline rank to trace.
        fake: Fake tensors (no memory); False runs the step on real CPU tensors (tests use it).
        watch: A context entered around the traced step only (tests measure the step with it).
        moe_imbalance: Llama 4 under expert parallel: the rank receives this many times the rows it sends
            (the busiest rank's share; `memory_moe`).
    """
    master_copies = s.fsdp and s.precision == "bf16"  # FSDP: bf16 compute weights, fp32 sharded masters
    # offloaded states: on the host
    state = 0.0 if s.fsdp_plan.cpu_offload else 1 / (s.fsdp_shard if s.fsdp else 1)
    tracker = LiveBytes(
        {"param": state, "grad": state, "optimizer": state, "param_copy": 0.0 if s.fsdp else 1.0}
    )
    steady = s.accum > 1 or s.microbatches > 1  # earlier micro-batches left their gradients
    b, t = plan.microbatch, s.seq_len // s.cp
    fake_mode = contextlib.ExitStack()
    if fake:
        fake_mode.enter_context(FakeTensorMode())
        fake_mode.enter_context(_fake_grouped_kernel())
    with fake_mode:
        model = build_local_model(s, plan, moe_imbalance=moe_imbalance)
        weights = _unique(model.parameters())
        if master_copies:
            weights = _to_bf16(model)
            masters = {id(p): nn.Parameter(torch.empty(p.shape)) for p in weights}
            opt_params = list(masters.values())
        else:
            opt_params = weights
        # A MoE layer's parameters are sharded over other ranks than the dense ones: their states count
        # (dense degree / their degree) times the categories' weight.
        scales = _moe_scales(s, model)
        if master_copies:
            scales |= {id(masters[key]): x for key, x in scales.items()}
        scale = lambda p: scales.get(id(p), 1.0)  # noqa: E731
        for p in opt_params:
            p.grad = torch.zeros_like(p)
        if s.optimizer == "adamw":
            optimizer: Any = build_optimizer(
                opt_params,
                name="adamw",
                lr=1e-4,
                betas=(0.9, 0.95),
                eps=1e-8,
                weight_decay=0.1,
                implementation=s.optimizer_impl,
            )
            optimizer.step()  # creates the states
        else:
            optimizer = _LowBitStates(opt_params, s.optimizer)
        for p in opt_params:
            p.grad = p.grad if steady else None
            if p.grad is not None:
                tracker.track(p.grad, "grad", scale(p))
        for p in weights:
            tracker.track(p, "param_copy" if master_copies else "param", scale(p))
        tracker.cast_per_call = {
            id(p.untyped_storage()) for name, p in model.named_parameters() if ".moe.experts." in name
        }
        for p in opt_params:
            tracker.track(p, "param", scale(p))
        for buf in model.buffers():
            tracker.track(buf, "buffer")
        for p, st in optimizer.state.items():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    tracker.track(v, "optimizer", scale(p))

        def on_grad(p: torch.Tensor) -> None:
            if not master_copies:
                tracker.retag(p.grad, "grad", scale(p))
                return
            m = masters[id(p)]
            g = p.grad.float()  # FSDP reduces in fp32 into the sharded fp32 gradient
            p.grad = None
            if m.grad is None:
                m.grad = g
                tracker.retag(g, "grad", scale(p))
            else:
                m.grad.add_(g)

        hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in weights]
        with tracker, watch or contextlib.nullcontext():
            tracker.phase = "forward"
            if plan.embedding:
                x = torch.zeros(b, t, dtype=torch.long)
            else:
                x = torch.zeros(b, t, s.args.dim, dtype=torch.bfloat16 if s.r == 2 else torch.float32)
                x.requires_grad_(True)
            labels = torch.zeros(b, t, dtype=torch.long)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if s.autocast else contextlib.nullcontext()
            with autocast:
                if plan.head and s.loss == "chunked":
                    out = model(x, labels=labels)
                elif plan.head:
                    out = cross_entropy(model(x), labels)
                else:
                    out = model(x)
                tracker.snapshot("forward end")
                tracker.phase = "backward"
                out.backward(None if plan.head else torch.ones_like(out))
                del out, x
            tracker.phase = "optimizer step"
            if s.max_norm > 0:
                clip_grad_norm_(opt_params, s.max_norm)
            optimizer.step()
        for h in hooks:
            h.remove()
    acts = tracker.snapshots["forward end"]["other"]
    # The other micro-batches in flight (PP) hold their saved activations through forward and backward.
    extra = (plan.in_flight - 1) * acts
    peaks = {ph: int(v + (0 if ph == "optimizer step" else extra)) for ph, v in tracker.phase_peaks.items()}
    at_peak = {k: int(v) for k, v in tracker.weighted(tracker.peak_live).items()}
    if tracker.peak_phase != "optimizer step":
        at_peak["other"] += int(extra)
    phase = max(peaks, key=peaks.get)
    return TraceResult(
        rank=plan.rank,
        peak=peaks[phase],
        peak_phase=phase,
        at_peak=at_peak,
        activations=int(plan.in_flight * acts),
        phase_peaks=peaks,
    )


def not_traced(s: RunPlan) -> list[str]:
    """The parts of this configuration that the trace does not run (the analytic model covers them)."""
    out = []
    if s.compile.enable:
        out.append(
            "compile: the trace runs eager (blocks and loss); it is compared with the analytic model's eager "
            "numbers"
        )
    if s.float8.enable:
        out.append(
            "float8: linears run in bf16 in the trace (no float8 weight casts; compiled float8 blocks keep "
            "fewer bf16 inputs)"
        )
    if s.fsdp:
        out.append("FSDP all-gather / reduce-scatter buffers (states are traced unsharded, weighted 1/shard)")
    if s.tp > 1 and s.tp_plan.sequence_parallel:
        what = "norms, residuals and MoE layers" if s.moe else "norms and residuals"
        out.append(f"sequence parallel: {what} traced at full sequence length (an over-count)")
    if s.ep > 1:
        out.append(
            "expert parallel: the all-to-alls run as local copies (the rank receiving the assumed "
            "imbalance times the rows it sends)"
        )
    if s.tp > 1 and not s.tp_plan.loss_parallel:
        out.append("tp without loss_parallel: traced logits are the vocabulary shard, not all-gathered")
    if s.cp > 1:
        out.append(
            "context parallel: ring attention's K/V exchange (the trace runs the local sequence share); "
            "compiled, the received K/V kept for backward"
        )
    if s.pp > 1:
        out.append("pipeline: one micro-batch traced; the others in flight added as its saved activations")
        if s.fsdp:
            out.append("pipeline with FSDP: unsharded fp32 gradients until the last micro-batch's backward")
    if s.ddp:
        out.append("DDP gradient buckets")
    if s.fsdp_plan.cpu_offload:
        out.append(
            "FSDP CPU offload: states weighted 0 (on the host); their copies to the device are not traced"
        )
    if s.optimizer != "adamw":
        out.append(f"{s.optimizer}: states laid out as torchao's; its compiled step is not traced")
    if s.args.attn_backend in ("flash", "cudnn"):
        out.append(f"attn_backend {s.args.attn_backend}: traced with sdpa")
    return out + ["CUDA context, NCCL and allocator slack"]


def trace(s: RunPlan, *, moe_imbalance: float = DEFAULT_IMBALANCE) -> TraceResult:
    """Trace the rank(s) that can peak (with PP: the first and the last) and return the largest (a
    Llama 4's busiest EP rank: `moe_imbalance`)."""
    plans = rank_plans(s)
    chosen = {plans[0].rank: plans[0], plans[-1].rank: plans[-1]}
    ranks = (trace_rank(s, p, moe_imbalance=moe_imbalance) for p in chosen.values())
    result = max(ranks, key=lambda r: r.peak)
    result.not_traced = not_traced(s)
    return result
