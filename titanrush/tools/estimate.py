"""`titanrush estimate`: will this config fit on the GPUs, and what uses the memory.

    titanrush estimate --config FILE [--ngpu N] [--gpu-mem GiB] [--json] [--no-trace] [--section.key v ...]

Two methods check each other: the analytic model (`memory_model`) counts every tensor of a step from the
shapes and the parallel layout; the trace (`memory_trace`) runs one real step of the rank's local model on
fake tensors and follows the live bytes. Where they disagree by more than 10% on the part the trace runs,
the report says so. `estimate()` is the function the sweep and the rush call to skip shapes that will not
fit; `gpu_memory()` is the one rule all three use for the memory of a GPU. Exit status: 0 when the config
fits, 1 when it does not (the report then lists the nearest plans that would: `what_fits`, the run's own
`titanrush.run.nearest`), 2 on a config error (one line on stderr).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from titanrush import config as cfgmod
from titanrush.config import ConfigError, JobConfig
from titanrush.launch_env import whole_number
from titanrush.run import autoplan, validate
from titanrush.run import memory_model as mm
from titanrush.run.memory_fit import GIB, gpu_memory, slack, unmodelled  # (gpu_memory: sweep's, rush's too)
from titanrush.run.memory_fit import context_bytes as _context_bytes
from titanrush.run.memory_moe import DEFAULT_IMBALANCE, shard_degrees
from titanrush.run.nearest import Fix, fixes
from titanrush.run.plan import RunPlan, build_plan, describe_mesh

USAGE = """usage: titanrush estimate [--config FILE] [--ngpu N] [--gpu-mem GiB] [--json] [--no-trace]
                          [--moe-imbalance X] [--section.key value ...]

Per-GPU memory of one training step of the config (the trainer's --section.key overrides apply):
parameters, gradients, optimizer states, activations, logits, FSDP buffers, and whether it fits.
  --ngpu N       GPUs of the job (default: NGPU, else the visible GPUs, else 1; as run_train.sh)
  --gpu-mem GiB  memory per GPU (default: the CUDA device's here, else 80 GiB; the report says which)
  --json         print one JSON object instead of the table
  --no-trace     skip the fake-tensor trace (the analytic model alone; instant)
  --moe-imbalance X  Llama 4 with expert parallel: the busiest EP rank's routed rows over the balanced
                 share (default 1.25; 1 = perfect balance)

When it does not fit, the report ends with the nearest plans that would, one of each kind (the levers, a
smaller local batch, another mesh of these GPUs, offload, bf16, more GPUs), as titanrush train names them.

Exit status: 0 the config fits, 1 it does not fit, 2 config error (one line on stderr).
"""
TOLERANCE = 0.10  # the analytic model and the trace should agree within this on the traced part
NGPU_FLAG = "--ngpu {}"  # how the nearest plans spell a change of the GPU count


@dataclass
class Estimate:
    """Per-GPU memory of one training step, in GiB, on the rank that peaks highest.

    The `*_gib` components are sizes (gradients: all of them; activations: saved at the end of forward,
    for all micro-batches in flight); `at_peak` is what each takes at the peak moment, which sums to
    `peak_allocated_gib` (comparable with torch.cuda.max_memory_allocated). `total_gib` adds allocator
    slack and the CUDA context and is what must fit in `gpu_mem_gib`.
    """

    flavor: str
    n_params: int
    ngpu: int
    mesh: str
    local_batch_size: int
    seq_len: int
    precision: str
    params_gib: float
    master_weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    fsdp_buffers_gib: float
    ddp_buckets_gib: float
    float8_gib: float
    transient_gib: float
    buffers_gib: float
    peak_allocated_gib: float
    allocator_slack_gib: float
    cuda_context_gib: float
    total_gib: float
    gpu_mem_gib: float
    gpu_mem_note: str  # where gpu_mem_gib comes from (`gpu_memory`'s rule)
    fits: bool
    max_local_batch_size: int
    peak_phase: str
    peak_rank: int
    at_peak: dict[str, float]
    rank_peaks_gib: list[float] = field(default_factory=list)  # peak allocated of each pipeline rank
    rank_slack_gib: list[float] = field(default_factory=list)  # and its allocator slack
    details: dict[str, str] = field(default_factory=dict)
    trace_peak_allocated_gib: float | None = None
    trace_total_gib: float | None = None
    trace_vs_analytic_pct: float | None = None
    not_traced: list[str] = field(default_factory=list)
    warning: str | None = None
    notes: list[str] = field(default_factory=list)
    # Llama 4: the busiest expert-parallel rank's routed rows over the balanced share that the estimate
    # assumes (`memory_moe`); None for a dense model
    moe_imbalance: float | None = None
    # The config's auto levers: the planner's table (the chosen plan first) and the values it chose
    # (`titanrush.run.autoplan`); empty without auto levers
    auto_plan: list[str] = field(default_factory=list)
    auto_settings: dict[str, Any] = field(default_factory=dict)


def plan_for(cfg: JobConfig, ngpu: int) -> tuple[RunPlan, int, str]:
    """The run plan of `cfg` on `ngpu` GPUs, as the trainer builds it, with its parameter count and a
    note when only this machine would refuse it.

    The estimate is for the GPU machine the job will run on: what this machine lacks (CUDA for context
    parallel, flash-attn, float8 tensor cores) becomes a note instead of an error.
    """
    plan = build_plan(cfg, ngpu, machine=False)
    refused = ""
    try:
        validate.check_machine(cfg)
    except ConfigError as e:
        if torch.cuda.is_available():
            raise
        refused = f"the trainer refuses this config on this machine: {e}"
    whole = mm.RankPlan(
        0, list(range(plan.args.n_layers)), embedding=True, head=True, in_flight=1.0, microbatch=1
    )
    every = dataclasses.replace(plan, tp=1, ep=1)  # (the whole model: every expert, unsharded)
    n_params = sum(d0 * d1 for _, (d0, d1), _ in mm.param_shapes(every, whole))
    return plan, n_params, refused


def _total(s: RunPlan, b: mm.Breakdown, context: int) -> int:
    return b.peak + slack(s, b) + context


def max_local_batch(
    s: RunPlan, limit: float, context: int, cap: int = 1 << 16, *, moe_imbalance: float = DEFAULT_IMBALANCE
) -> int:
    """The largest local batch size (a multiple of the pipeline micro-batches) whose analytic total fits
    within `limit` bytes; 0 if none does."""
    step = s.microbatches if s.pp > 1 else 1

    def fits(k: int) -> bool:
        sk = dataclasses.replace(s, local_batch=k * step)
        return _total(sk, mm.analyze(sk, moe_imbalance=moe_imbalance), context) <= limit

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= cap and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def estimate(
    cfg: JobConfig,
    ngpu: int,
    gpu_mem_gib: float | None = None,
    *,
    trace: bool = True,
    moe_imbalance: float = DEFAULT_IMBALANCE,
) -> Estimate:
    """Per-GPU memory of one training step of `cfg` on `ngpu` GPUs, and whether it fits.

    Args:
        cfg: The job config (as `titanrush.config.load` returns it).
        ngpu: The number of GPUs (the world size).
        gpu_mem_gib: Memory per GPU; None: `gpu_memory`'s rule (the CUDA device's, else 80 GiB).
        trace: Also trace one step on fake tensors (seconds for 8B) to check the analytic model.
        moe_imbalance: Llama 4 under expert parallel: the busiest EP rank's routed rows over the balanced
            share (capacity-free routing: the load varies step to step); 1 is perfect balance, at most ep
            (every row on one rank). Without EP a rank's experts compute its own rows: no effect.

    Returns:
        The estimate; `fits` says whether `total_gib` fits in `gpu_mem_gib`.

    Raises:
        ConfigError: The config is invalid for this number of GPUs (the trainer would refuse it too).
    """
    if ngpu < 1:
        raise ConfigError(f"--ngpu must be >= 1, got {ngpu}")
    if gpu_mem_gib is None and cfg.plan.gpu_mem_gib:
        gpu_mem_gib, gpu_mem_note = gpu_memory(cfg.plan.gpu_mem_gib, given_by="plan.gpu_mem_gib")
    else:
        gpu_mem_gib, gpu_mem_note = gpu_memory(gpu_mem_gib)
    choice = None
    if validate.auto_levers(cfg):  # chosen as `titanrush train` would for this GPU memory
        choice = autoplan.resolve(
            cfg, ngpu, gpu_mem_gib, gpu_mem_note, machine=False, moe_imbalance=moe_imbalance
        )
        cfg = choice.cfg
    s, n_params, refused = plan_for(cfg, ngpu)
    if why := unmodelled(s):
        raise ConfigError(why)
    if not (math.isfinite(moe_imbalance) and moe_imbalance >= 1.0) or (s.ep > 1 and moe_imbalance > s.ep):
        top = (
            f"ep = {s.ep} (every row on one rank)"
            if s.ep > 1
            else "any higher value (it has no effect without ep)"
        )
        raise ConfigError(
            f"--moe-imbalance must be between 1 (balanced) and {top}, got {moe_imbalance:g}; from a run's "
            "moe_imbalance metric (max/mean per expert) pass min(metric, ep)"
        )
    mesh = describe_mesh(s)
    notes: list[str] = [refused] if refused else []
    ranks = [mm.analyze_rank(s, p, moe_imbalance=moe_imbalance) for p in mm.rank_plans(s)]
    b = max(ranks, key=lambda r: r.peak)  # as mm.analyze
    context = _context_bytes(ngpu)
    extra = slack(s, b)
    total = b.peak + extra + context
    limit = choice.limit if choice else gpu_mem_gib * GIB  # (auto levers: the margin, as train holds them)
    est = Estimate(
        flavor=cfg.model.flavor,
        n_params=n_params,
        ngpu=ngpu,
        mesh=mesh,
        local_batch_size=s.local_batch,
        seq_len=s.seq_len,
        precision=s.precision,
        **{f"{k}_gib": b.sizes[k] / GIB for k in mm.COMPONENTS},
        peak_allocated_gib=b.peak / GIB,
        allocator_slack_gib=extra / GIB,
        cuda_context_gib=context / GIB,
        total_gib=total / GIB,
        gpu_mem_gib=gpu_mem_gib,
        gpu_mem_note=gpu_mem_note,
        fits=total <= limit,
        max_local_batch_size=max_local_batch(s, limit, context, moe_imbalance=moe_imbalance),
        peak_phase=b.peak_phase,
        peak_rank=b.rank,
        at_peak={k: v / GIB for k, v in b.at_peak.items()},
        rank_peaks_gib=[r.peak / GIB for r in ranks],
        rank_slack_gib=[slack(s, r) / GIB for r in ranks],
        details={k: _describe(s, k) for k in mm.COMPONENTS if _describe(s, k)},
        notes=notes,
        moe_imbalance=moe_imbalance if s.moe else None,
        auto_plan=choice.report() if choice else [],
        auto_settings=choice.chosen.settings if choice and choice.chosen else {},
    )
    if s.moe:
        notes.append(_moe_note(s, moe_imbalance))
    if est.fits and total > 0.95 * gpu_mem_gib * GIB:
        notes.append("within 5% of the GPU's memory: fragmentation may still run it out of memory")
    if choice and not est.fits and total <= gpu_mem_gib * GIB:
        notes.append(
            f"an auto plan must leave plan.margin = {choice.margin:.0%} of the GPU's memory free "
            f"({limit / GIB:.1f} GiB): titanrush train refuses this one"
        )
    if trace:
        _add_trace(est, s, b, extra + context, moe_imbalance)
    return est


def what_fits(
    cfg: JobConfig, ngpu: int, est: Estimate, *, moe_imbalance: float = DEFAULT_IMBALANCE
) -> list[Fix]:
    """The nearest plans that fit, when `est` (of `cfg` on `ngpu` GPUs) does not: one of each kind of change
    that has one, the nearest first, as the run's verdict decides them (`titanrush.run.nearest.fixes`:
    the levers, a smaller batch with the global batch kept, another mesh of the same GPUs, offload, bf16,
    more GPUs), each with `plan.margin` of the memory left free and its levers the planner's cheapest."""
    plan = build_plan(autoplan.stand_in(cfg), ngpu, machine=False)
    limit = est.gpu_mem_gib * (1 - cfg.plan.margin) * GIB
    return fixes(cfg, plan, limit, machine=False, moe_imbalance=moe_imbalance, every=True)


def _fits_text(cfg: JobConfig, found: list[Fix], est: Estimate) -> list[str]:
    """The lines under a `does not fit`: what would, or that none of the nearest changes does."""
    if not found:
        return [
            f"nothing near fits in {est.gpu_mem_gib:g} GiB (the levers, a smaller local batch, another mesh "
            "of these GPUs, offload, bf16, up to 8x the GPUs): a GPU with more memory, or a smaller model"
        ]
    flags = [f.flags(cfg, est.ngpu, gpus=NGPU_FLAG) for f in found]
    w = max(len(x) for x in flags)
    lines = [
        f"the nearest plans that fit in {est.gpu_mem_gib:g} GiB with {cfg.plan.margin:.0%} kept free "
        "(plan.margin), nearest first; add a line's flags to the same command:"
    ]
    for f, text in zip(found, flags):
        note = f"  ({f.note})" if f.note else ""
        lines.append(f"  {f.kind:<7} {text:<{w}}  {f.gib:6.2f} GiB{note}")
    return lines


def _add_trace(est: Estimate, s: RunPlan, b: mm.Breakdown, extra: int, moe_imbalance: float) -> None:
    """Trace the step, compare with the analytic model on the same scope, record both."""
    from titanrush.tools import memory_trace

    est.not_traced = memory_trace.not_traced(s)
    try:
        tr = memory_trace.trace(s, moe_imbalance=moe_imbalance)
    except Exception as e:  # the trace is a check: report its failure, keep the analytic answer
        est.notes.append(f"trace failed ({type(e).__name__}: {e}); the analytic model stands alone")
        return
    same_scope = mm.analyze(s, as_traced=True, moe_imbalance=moe_imbalance)
    err = (same_scope.peak - tr.peak) / max(tr.peak, 1)
    est.trace_vs_analytic_pct = 100 * err
    # What the trace does not run (FSDP buffers, compile, sequence parallel ...) comes from the model.
    traced_alloc = tr.peak + (b.peak - same_scope.peak)
    est.trace_peak_allocated_gib = traced_alloc / GIB
    est.trace_total_gib = (traced_alloc + extra) / GIB
    if abs(err) > TOLERANCE:
        est.warning = (
            f"the analytic model and the trace disagree by {100 * err:+.0f}% on the traced part "
            f"({same_scope.peak / GIB:.2f} vs {tr.peak / GIB:.2f} GiB at {tr.peak_phase}): check both"
        )


LABELS = {
    "params": "parameters",
    "master_weights": "master weights (fp32)",
    "grads": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations (saved)",
    "logits": "logits / loss",
    "fsdp_buffers": "FSDP all-gather + reduce-scatter",
    "ddp_buckets": "DDP gradient buckets",
    "float8": "float8 casts",
    "transient": "temporaries (backward, optimizer)",
    "buffers": "buffers (RoPE table)",
}


def _shards(s: RunPlan) -> str:
    """How the states are split: `, 1/4 (FSDP)`; a MoE model's experts (and layers under TP) too."""
    dense = f", 1/{s.fsdp_shard} (FSDP)" if s.fsdp else ""
    if not s.moe:
        return dense
    layer, experts = shard_degrees(s)
    out = dense + (f"; MoE layers 1/{layer} (FSDP over tp too)" if s.moe_tp else "")
    if s.ep > 1:
        out += f"; experts {s.args.n_experts // s.ep} of {s.args.n_experts} (EP)" + (
            f", 1/{experts} (FSDP)" if experts > 1 else ""
        )
    return out


def _describe(s: RunPlan, key: str) -> str:
    states = ("params", "master_weights", "grads", "optimizer")
    shard = _shards(s) if key in states else ""
    if key == "params":
        if s.precision == "fp32":
            return "fp32" + shard
        return "bf16 copies, autocast" if s.autocast else "bf16: in the FSDP buffers"
    if key == "grads":
        if s.fsdp and s.pp > 1:  # see memory_model.analyze_rank
            return f"fp32, unsharded until the last micro-batch's backward, then 1/{s.fsdp_shard}"
        return "fp32" + shard
    if key == "optimizer":
        kind = {"adamw": "AdamW, 2 x fp32", "adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[s.optimizer]
        return kind + shard
    if key == "master_weights":
        return "bf16 compute" + shard
    if key == "activations":
        ac = s.ac.mode if s.ac.mode != "selective" else f"selective {s.ac.selective}"
        if ac == "selective op" and s.ac.op_matmuls == "alternate":
            ac = "op alternate" + (f", all in the last {s.ac.op_all_last} blocks" if s.ac.op_all_last else "")
        elif ac == "selective op" and s.ac.op_matmuls == "all_but_w3":
            ac = "op all but w3"
        return f"AC {ac}" + (", compiled" if s.compile.enable else "")
    if key == "buffers" and s.moe:
        return "+ each MoE layer's routing bias and token counts"
    if key == "logits":
        if s.loss == "chunked":
            return f"chunked ({s.loss_chunk} tokens)"
        if s.vocab_parallel_loss:
            return "vocabulary-parallel (no fp32 logits)"
        return "plain, compiled (no fp32 logits)" if s.compiled_loss else "plain, fp32"
    return ""


def _moe_note(s: RunPlan, imbalance: float) -> str:
    """What the estimate assumes of a MoE model's routing (the load is capacity-free: it varies)."""
    a = s.args
    what = f"MoE: {len(a.moe_layers)} of {a.n_layers} layers, {a.n_experts} experts, top-{a.top_k}"
    if s.ep == 1:
        return f"{what}; without expert parallel each rank's experts compute its own rows (balance-free)"
    return (
        f"{what}, {a.n_experts // s.ep} per EP rank; the busiest EP rank assumed to receive {imbalance:g}x "
        "the balanced rows (--moe-imbalance; from the trainer's moe_imbalance metric, max/mean per expert, "
        "which bounds it: min(metric, ep))"
    )


def format_report(est: Estimate) -> str:
    """The human-readable table."""
    rows = []
    for key in mm.COMPONENTS:
        size, peak = getattr(est, f"{key}_gib"), est.at_peak.get(key, 0.0)
        if size == 0 and peak == 0:
            continue
        desc = est.details.get(key, "")
        rows.append((f"{LABELS[key]}" + (f" [{desc}]" if desc else ""), size, peak))
    w = max([52] + [len(label) for label, _, _ in rows])  # (a MoE model's states say more)
    lines = [
        f"titanrush estimate: {est.flavor} ({est.n_params / 1e9:.2f}B params) on {est.ngpu} GPU(s), "
        f"{est.mesh}; local batch {est.local_batch_size} x seq {est.seq_len}, {est.precision}",
        *est.auto_plan,
        f"{f'per-GPU memory, GiB (pipeline rank {est.peak_rank})':<{w + 2}} {'size':>8} {'at peak':>8}",
    ]
    lines += [f"  {label:<{w}} {size:8.2f} {peak:8.2f}" for label, size, peak in rows]
    lines += [
        f"  {'= peak allocated (at ' + est.peak_phase + ')':<{w}} {'':8} {est.peak_allocated_gib:8.2f}",
        f"  {'+ allocator slack (heuristic)':<{w}} {'':8} {est.allocator_slack_gib:8.2f}",
        f"  {'+ CUDA context' + (' and NCCL' if est.ngpu > 1 else ''):<{w}} {'':8} "
        f"{est.cuda_context_gib:8.2f}",
        f"  {'= total':<{w}} {'':8} {est.total_gib:8.2f}   of {est.gpu_mem_gib:.1f} GiB: "
        + ("fits" if est.fits else "does not fit"),
        f"GPU memory: {est.gpu_mem_note}",
        f"largest local batch size that fits: {est.max_local_batch_size or 'none (not even 1)'}",
    ]
    if est.trace_peak_allocated_gib is not None:
        lines.append(
            f"trace (one step on fake tensors): peak allocated {est.trace_peak_allocated_gib:.2f} GiB, total "
            f"{est.trace_total_gib:.2f} GiB; analytic vs trace on the traced part: "
            f"{est.trace_vs_analytic_pct:+.1f}%"
        )
    if est.not_traced:
        lines.append("not traced (analytic only): " + "; ".join(est.not_traced))
    if est.warning:
        lines.append(f"WARNING: {est.warning}")
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    """Pull the estimator's own flags out of argv; the rest goes to the config loader."""
    opts: dict = {
        "ngpu": None,
        "gpu_mem": None,
        "moe_imbalance": DEFAULT_IMBALANCE,
        "json": False,
        "trace": True,
    }
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--ngpu", "--gpu-mem", "--moe-imbalance"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            try:
                opts[name[2:].replace("-", "_")] = int(value) if name == "--ngpu" else float(value)
            except ValueError:
                raise ConfigError(f"{name} must be a number, got {value!r}") from None
        elif arg == "--json":
            opts["json"] = True
        elif arg == "--no-trace":
            opts["trace"] = False
        else:
            rest.append(arg)
        i += 1
    return opts, rest


def _default_ngpu() -> int:
    ngpu = whole_number(os.environ, "NGPU", 0, 1, "or pass --ngpu N")
    return ngpu or torch.cuda.device_count() or 1


def main(argv: list[str] | None = None) -> int:
    """Run the estimate; print the table or JSON; return the exit status (0 fits, 1 does not, 2 bad input)."""
    from titanrush.config import split_args

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    try:
        opts, rest = _split(argv)
        path, check, overrides = split_args(rest)
        if check:
            raise ConfigError(
                "--check is the trainer's (./run_train.sh --check); estimate never trains: drop it"
            )
        cfg = cfgmod.load(path, overrides)
        ngpu = opts["ngpu"] if opts["ngpu"] is not None else _default_ngpu()
        est = estimate(cfg, ngpu, opts["gpu_mem"], trace=opts["trace"], moe_imbalance=opts["moe_imbalance"])
    except ConfigError as e:
        print(f"titanrush estimate: config error: {e}", file=sys.stderr)
        return 2
    found = [] if est.fits else what_fits(cfg, ngpu, est, moe_imbalance=opts["moe_imbalance"])
    if opts["json"]:
        would = [
            {"kind": f.kind, "flags": f.flags(cfg, ngpu, gpus=NGPU_FLAG), "total_gib": f.gib, "note": f.note}
            for f in found
        ]
        out = dataclasses.asdict(est) | ({} if est.fits else {"would_fit": would})
        print(json.dumps(out, indent=2))
    else:
        print("\n".join([format_report(est), *([] if est.fits else _fits_text(cfg, found, est))]))
    return 0 if est.fits else 1


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
