"""`titanrush rush moe`: a dense Llama against a Llama 4 mixture of experts at equal active parameters.

The dense twin of a MoE flavor has the flavor's embedding, attention, norms, layers and output, and in
each layer a SwiGLU as wide as what one token goes through in a MoE layer: the shared expert's hidden
plus top_k routed experts' (`model.flavor = custom` with `model.ffn_hidden`: the width is exact). A token
then meets the same matmul weights in both models, the MoE's routers aside (a `dim x E` gate per MoE
layer, which a dense model has no counterpart for), so both do the same FLOPs per token while the MoE
holds E / top_k times the routed weights. The two rungs run from the same base, on the same batches in
the same order; the report gives the MoE / dense ratio of tokens/s and the loss difference at equal
steps (= equal tokens: same batch and sequence).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.metrics import flops_per_token, matmul_params
from titanrush.models.llama import Llama
from titanrush.models.llama4 import FLAVORS as LLAMA4_FLAVORS
from titanrush.models.llama4 import Llama4, Llama4Args
from titanrush.models.llama4.balance import JUDGE_STEPS
from titanrush.run.plan import resolve_model_args
from titanrush.tools import rush_report as report
from titanrush.tools import rush_runner as runner
from titanrush.tools.rush_runner import OK, Rung, to_args

# The MoE counterpart of the dense flavors the rush's configs start from (a Llama 4 flavor is its own).
MOE_OF = {"debug": "llama4_debug", "1B": "llama4_1Bx8E"}


def moe_flavor(flavor: str) -> str:
    """The Llama 4 flavor the group compares: the config's own, or the MoE counterpart of debug / 1B."""
    if flavor in LLAMA4_FLAVORS:
        return flavor
    if flavor in MOE_OF:
        return MOE_OF[flavor]
    raise ConfigError(
        f"model.flavor = {flavor!r} has no mixture-of-experts counterpart: set it to a Llama 4 flavor "
        f"({', '.join(LLAMA4_FLAVORS)}) or to {' / '.join(MOE_OF)} (their MoE: {', '.join(MOE_OF.values())})"
    )


def twin_hidden(args: Llama4Args) -> tuple[int, bool]:
    """The dense SwiGLU width whose parameters per token equal the MoE's feed-forwards' (routers aside),
    and whether they are exactly equal.

    A MoE layer's token goes through the shared expert and top_k routed experts, all `expert_hidden`
    wide: (shared + top_k) x expert_hidden. A flavor whose dense layers (`moe_every > 1`) have another
    width gets the mean over the layers, exact when it is a whole number.
    """
    per_moe = (int(args.shared_expert) + args.top_k) * args.expert_hidden
    widths = [per_moe if args.is_moe(i) else args.ffn_hidden for i in range(args.n_layers)]
    return round(sum(widths) / len(widths)), sum(widths) % len(widths) == 0


def dense_twin(args: Llama4Args) -> dict[str, str]:
    """The overrides (`model.flavor = custom` and its shape keys) of the dense Llama at the MoE's active
    parameters; ConfigError for attention options a dense Llama has no key for (iRoPE)."""
    if args.nope_every or args.attn_chunk or args.qk_norm:
        raise ConfigError(
            "the dense twin of a Llama 4 flavor with iRoPE (NoPE layers, chunked attention, QK-norm) cannot "
            "be shaped with model.flavor = 'custom': compare llama4_debug, llama4_1Bx8E or llama4_1Bx16E"
        )
    shape = {
        "model.flavor": "custom",
        "model.dim": args.dim,
        "model.n_layers": args.n_layers,
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.vocab_size": args.vocab_size,
        "model.ffn_hidden": twin_hidden(args)[0],
        "model.max_seq_len": args.max_seq_len,
        "model.tie_embeddings": "tied" if args.tie_embeddings else "untied",
        "model.norm_eps": args.norm_eps,
        "model.rope_theta": args.rope_theta,
        "model.rope_scaling": "llama3" if args.rope_scaling else "none",
    }
    if args.rope_scaling:
        for key in ("scale_factor", "low_freq_factor", "high_freq_factor", "original_max_len"):
            shape[f"model.rope_{key}"] = getattr(args, f"rope_{key}")
    return {k: str(v) for k, v in shape.items()}


def model_figures(config: str | None, settings: dict[str, str]) -> dict[str, Any]:
    """The model of a run, built on the meta device: total and active (per token) parameters, the
    routers' parameters, and the training FLOPs per token (`titanrush.metrics`, as the trainer counts)."""
    cfg = cfgmod.load(config, to_args(settings))
    args = resolve_model_args(cfg)
    with torch.device("meta"):
        model = (Llama4 if isinstance(args, Llama4Args) else Llama)(args)
    total = sum(p.numel() for p in model.parameters())
    moes = model.moe_modules() if isinstance(model, Llama4) else []
    routed = [m.experts.w13.numel() + m.experts.w2.numel() for m in moes]  # a token uses top_k / E of them
    active = total - sum(n - n * m.top_k // m.n_experts for n, m in zip(routed, moes))
    return {
        "params_total": total,
        "params_active": active,
        "params_router": sum(m.router.gate.weight.numel() for m in moes),
        "gflop_per_token": flops_per_token(args, matmul_params(model), cfg.training.seq_len) / 1e9,
        # (one GPU, and the rush fixes training.global_batch_size = -1: no gradient accumulation)
        "tokens_per_step": cfg.training.local_batch_size * cfg.training.seq_len,
    }


def count(n: float) -> str:
    """1.25B, 7.05M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def moe_plan(config: str | None, base: dict[str, str]) -> list[Rung]:
    """The dense twin, then the MoE flavor (the config's Llama 4 flavor, or the counterpart of its dense
    one); ConfigError when the group cannot shape them."""
    flavor = moe_flavor(cfgmod.load(config, to_args(base)).model.flavor)
    moe_settings = {**base, "model.flavor": flavor}
    args = resolve_model_args(cfgmod.load(config, to_args(moe_settings)))
    if not args.moe_layers:
        raise ConfigError(f"model.flavor = {flavor!r} has no MoE layer")
    twin = dense_twin(args)
    dense, moe = model_figures(config, {**base, **twin}), model_figures(config, moe_settings)
    hidden, exact = twin_hidden(args)
    shared = "1 shared + " if args.shared_expert else ""
    return [
        Rung(
            "dense",
            f"dense Llama, FFN hidden {hidden}{'' if exact else ' (closest)'}: "
            f"{count(dense['params_total'])} parameters, all active",
            twin,
            "moe",
            fields=dense,
        ),
        Rung(
            "moe",
            f"{flavor}: {shared}top-{args.top_k} of {args.n_experts} experts x {args.expert_hidden}: "
            f"{count(moe['params_total'])} total, {count(moe['params_active'])} active",
            {"model.flavor": flavor},
            "moe",
            fields=moe,
        ),
    ]


def load_windows(
    metrics: list[dict[str, Any]], every: int = JUDGE_STEPS, after: int = 0
) -> list[tuple[int, int, list[float], bool]]:
    """A Llama 4 run's expert load summed per window of `every` steps > `after`, from the rows that hold
    `moe_tokens_l<i>` (each the logged step's load: a run logging every step). Per window: its first and
    last step, each layer's max / mean load (over the layers every row of the window holds; a layer
    without a token left out), and whether every step of it was logged."""
    windows: dict[int, list[dict[str, Any]]] = {}
    for r in metrics:
        if r.get("step", 0) > after and any(k.startswith("moe_tokens_l") for k in r):
            windows.setdefault((r["step"] - after - 1) // every, []).append(r)
    out = []
    for i, rows in sorted(windows.items()):
        first = after + i * every + 1
        keys = set.intersection(*({k for k in r if k.startswith("moe_tokens_l")} for r in rows))
        loads = ([sum(tokens) for tokens in zip(*(r[key] for r in rows))] for key in sorted(keys))
        per_layer = [max(load) * len(load) / sum(load) for load in loads if sum(load)]
        whole = {r["step"] for r in rows} == set(range(first, first + every))
        out.append((first, first + every - 1, per_layer, whole))
    return out


def routing(metrics: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The experts' balance after the warm-up (`load_windows` of JUDGE_STEPS steps > `warmup`, a window
    with a step missing left out): the most imbalanced layer's max / mean load in the worst window (with
    its steps) and in the last one (with the mean over layers). Empty without a whole window."""
    figures = [
        (first, last, max(per_layer), sum(per_layer) / len(per_layer))
        for first, last, per_layer, whole in load_windows(metrics, JUDGE_STEPS, warmup)
        if whole and per_layer
    ]
    if not figures:
        return {}
    worst, last = max(figures, key=lambda f: f[2]), figures[-1]
    return {
        "moe_window_worst": worst[2],
        "moe_window_worst_steps": [worst[0], worst[1]],
        "moe_window_last": last[2],
        "moe_window_last_mean": last[3],
        "moe_window_last_steps": [last[0], last[1]],
    }


def loss_at(row: dict[str, Any], step: int) -> float | None:
    """The row's training loss at `step` (None where it was not logged)."""
    return dict((s, loss) for s, loss in row.get("loss_curve") or []).get(step)


def compare(dense: dict[str, Any], moe: dict[str, Any]) -> dict[str, Any]:
    """The MoE row's ratios to the dense one: tokens/s, and the loss difference at the last step both
    logged (equal steps; equal tokens when both take the same tokens per step). Both saw the same batch at
    that step, so the difference is not the batches' noise."""
    out: dict[str, Any] = {"vs_dense": runner.speedup(moe.get("tps"), dense.get("tps"))}
    steps = [max(s for s, _ in r["loss_curve"]) for r in (dense, moe) if r.get("loss_curve")]
    if len(steps) < 2:
        return out
    step = min(steps)
    same = dense["tokens_per_step"] == moe["tokens_per_step"]
    out.update(loss_step=step, loss_tokens=step * moe["tokens_per_step"] if same else None)
    out.update(loss_dense=loss_at(dense, step), loss_moe=loss_at(moe, step))
    both = out["loss_moe"] is not None and out["loss_dense"] is not None
    out["loss_diff"] = out["loss_moe"] - out["loss_dense"] if both else None
    return out


# ----------------------------------------------------------------------------------------------
# The report


def table(rows: list[dict[str, Any]]) -> str:
    """The two rungs as a markdown table."""
    f = report.cell
    head = (
        "| rung | model | status | total params | active params | GFLOP/token | tokens/s | TFLOP/s | MFU "
        "| peak active GiB | peak reserved GiB | final loss | tokens/s vs dense | loss - dense |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['adds']} | {report.status(r)} | {r['params_total']:,} "
            f"| {r['params_active']:,} "
            f"| {r['gflop_per_token']:.4g} | {f(r.get('tps'), '{:,.0f}')} | {f(r.get('tflops'), '{:.3g}')} "
            f"| {f(r.get('mfu'), '{:.1f}%')} | {f(r.get('mem_active_gib'), '{:.2f}')} "
            f"| {f(r.get('mem_reserved_gib'), '{:.2f}')} | {f(r.get('final_loss'), '{:.4f}')} "
            f"| {report.times(r.get('vs_dense'))} | {f(r.get('loss_diff'), '{:+.4f}')} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """What the comparison says: parameters, the tokens/s ratio, the loss differences, what they mean."""
    dense, moe = rows
    extra = moe["params_active"] - dense["params_active"]
    share = 100 * extra / dense["params_active"]
    rest = extra - moe["params_router"]
    rest = f", and {rest:+,} the closest dense width's" if rest else ""
    lines = [
        f"- Active parameters per token (embedding and output included): dense {dense['params_active']:,}, "
        f"MoE {moe['params_active']:,}. The difference, {extra:,} ({share:.3f}%), is the MoE's routers "
        f"({moe['params_router']:,}: a dim x E gate per MoE layer, which a dense Llama has no counterpart "
        f"for{rest}). FLOPs per token: {dense['gflop_per_token']:.4g} and "
        f"{moe['gflop_per_token']:.4g} GFLOP. Total parameters: the MoE holds {count(moe['params_total'])}, "
        f"{moe['params_total'] / moe['params_active']:.1f}x its active ones."
    ]
    if moe.get("vs_dense") is not None:
        lines.append(
            f"- Tokens/s, MoE / dense: {moe['vs_dense']:.2f}x ({moe['tps']:,.0f} against "
            f"{dense['tps']:,.0f}): at the same FLOPs per token, what the routing, the token permutation "
            "and the grouped expert GEMMs cost on this device (1.00x would be free)."
        )
    if moe.get("loss_diff") is not None:
        tokens = f" = {moe['loss_tokens']:,} tokens each" if moe.get("loss_tokens") else ""
        lines.append(
            f"- Loss at step {moe['loss_step']}{tokens}, the same batches in the same order: MoE "
            f"{moe['loss_moe']:.4f}, dense {moe['loss_dense']:.4f}, MoE - dense = {moe['loss_diff']:+.4f} "
            "at equal steps and equal tokens (negative: the MoE is ahead)."
        )
    scale = "1.00 is balanced, E: one expert took every token and the others learned nothing"
    if moe.get("moe_window_worst") is not None:
        (a, b), (c, d) = moe["moe_window_worst_steps"], moe["moe_window_last_steps"]
        lines.append(
            f"- Routing, the tokens of each {JUDGE_STEPS} steps after the warm-up summed: the busiest "
            f"expert of the most imbalanced layer took at most {moe['moe_window_worst']:.2f}x the mean load "
            f"(steps {a}-{b}), {moe['moe_window_last']:.2f}x over steps {c}-{d} "
            f"({moe['moe_window_last_mean']:.2f}x averaged over the layers); {scale} (docs/moe.md, 'Load "
            "balance')."
        )
        if moe.get("moe_imbalance") is not None:
            lines.append(
                f"- Routing at the last step alone: {moe['moe_imbalance']:.2f}x (one step's batch swings "
                "more than the windows above)."
            )
    elif moe.get("moe_imbalance") is not None:
        lines.append(
            f"- Routing at the last step: the busiest expert of the most imbalanced layer took "
            f"{moe['moe_imbalance']:.2f}x the mean load ({scale}; too few steps after the warm-up for a "
            f"window of {JUDGE_STEPS})."
        )
    lines.append(
        "- What it means: the MoE has more parameters for the same FLOPs per token. Its extra experts cost "
        "memory (weights, gradients and optimizer state of every expert: the peak memory columns) and the "
        "routing costs time (the tokens/s ratio); they pay off when the loss per token falls by more than "
        "the time per token rises, i.e. when the MoE is ahead at equal time (moe.png's last panel), not "
        "only at equal tokens. A short run shows the start of the curves, not where they end."
    )
    return lines


def chart(out: Path, rows: list[dict[str, Any]], device: str) -> Path:
    """moe.png: tokens/s, total vs active parameters, and the loss over the tokens seen and over the
    training time (tokens / the mean tokens/s), per rung."""
    plt = report.load_pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax1, ax2), (ax3, ax4) = axes
    names, xs = [r["name"] for r in rows], range(len(rows))
    bars = ax1.bar(names, [r.get("tps") or 0.0 for r in rows], color=["tab:blue", "tab:orange"][: len(rows)])
    for bar, r in zip(bars, rows):
        label = r["status"] if r["status"] != OK else report.times(r.get("vs_dense") or 1.0)
        ax1.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax1.set(ylabel="tokens/s", title="throughput (labels: vs dense)")
    ax2.bar([x - 0.2 for x in xs], [r["params_total"] / 1e6 for r in rows], 0.4, label="total")
    ax2.bar([x + 0.2 for x in xs], [r["params_active"] / 1e6 for r in rows], 0.4, label="active per token")
    ax2.set_xticks(list(xs), names)
    ax2.set(ylabel="parameters (M)", title="parameters")
    ax2.legend()
    for r in rows:
        curve = r.get("loss_curve") or []
        tokens = [s * r["tokens_per_step"] for s, _ in curve]
        ax3.plot(tokens, [loss for _, loss in curve], label=r["name"])
        if r.get("tps"):
            ax4.plot([t / r["tps"] for t in tokens], [loss for _, loss in curve], label=r["name"])
    ax3.set(xlabel="tokens seen", ylabel="training loss", title="loss at equal tokens")
    ax4.set(xlabel="seconds at the mean tokens/s", ylabel="training loss", title="loss at equal time")
    for ax in (ax3, ax4):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    ax1.margins(y=0.15)
    fig.suptitle(f"Dense vs MoE at equal active parameters on {device}")
    return report.save_figure(fig, out / "moe.png")


def write_all(
    out: Path, rows: list[dict[str, Any]], env: dict[str, Any], *, steps: int, warmup: int, notes: list[str]
) -> None:
    """results.jsonl, report.md, moe.png and TensorBoard (tb/) of a finished moe group."""
    report.write_jsonl(out / "results.jsonl", rows, env)
    settings = [
        f"{steps} steps per run, the same batches in the same order; tokens/s, TFLOP/s and MFU are means "
        f"over steps > {warmup}, and TFLOP/s and MFU count the MoE's active parameters (docs/mfu.md); "
        "peak memory is the maximum over all steps (process peak RSS on CPU)"
    ]
    md = table(rows)
    charts = [chart(out, rows, env.get("device") or "?")]
    report.write_report(
        out / "report.md",
        title="titanrush rush: dense vs MoE at equal active parameters",
        env=env,
        settings=settings,
        table=md,
        summary=summary(rows),
        rows=rows,
        charts=charts,
        notes=notes,
        summary_title="What the experts buy",
    )
    report.log_tensorboard(out, rows, tag="moe", table=md)
