"""The report of side_by_side.py --parity: first the proof that both trainers started from the same weights
and drew the same token batches at every step, then their losses, gradient norms, learning rates and (Llama
4) the experts' load, step by step and over windows.

The goals (issue #51), over `steps` steps: every step's loss within 1% of torchtitan's over the first
quarter (steps 1-50 of 200), and the mean loss over the last quarter (steps 150-200) within 0.5%. On Llama 4,
where routing may drift apart, the same two goals are held on window means (the first quarter's mean loss).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, median
from typing import Any

from batch_dump import read_lines

FIRST_GOAL, LAST_GOAL = 0.01, 0.005  # relative


@dataclass
class Trace:
    """What one trainer's run logged, by step."""

    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)
    lr: dict[int, float] = field(default_factory=dict)
    tokens: dict[tuple[int, int], set[str]] = field(default_factory=dict)  # (step, dp rank) -> hashes seen
    weights: dict[str, str] = field(default_factory=dict)
    experts: dict[int, list[list[int]]] = field(default_factory=dict)  # step -> per layer, over all ranks


def _hashes(obs: Path, tokens: dict[tuple[int, int], set[str]]) -> dict[str, str]:
    for r in read_lines(sorted(obs.glob("tokens_rank*.jsonl"))):
        tokens.setdefault((r["step"], r["dp_rank"]), set()).add(r["hash"])
    lines = read_lines([obs / "weights.json"])
    return lines[0] if lines else {}


def titanrush_trace(run_dir: Path, obs: Path) -> Trace:
    """titanrush's metrics.jsonl (every step logged) and parity_observe.py's hashes."""
    t = Trace()
    t.weights = _hashes(obs, t.tokens)
    for r in read_lines([run_dir / "metrics.jsonl"]):
        if "grad_norm" not in r:
            continue
        s = r["step"]
        t.loss[s], t.grad_norm[s], t.lr[s] = r.get("loss_last", r["loss"]), r["grad_norm"], r["lr"]
        layers = sorted((k for k in r if k.startswith("moe_tokens_l")), key=lambda k: int(k[12:]))
        if layers:
            t.experts[s] = [r[k] for k in layers]
    return t


def torchtitan_trace(obs: Path) -> Trace:
    """tt_parity.py's files: metrics.jsonl, the hashes, each rank's experts' load."""
    t = Trace()
    t.weights = _hashes(obs, t.tokens)
    for r in read_lines([obs / "metrics.jsonl"]):
        s = r["step"]
        t.loss[s], t.grad_norm[s], t.lr[s] = r["loss_metrics/global_avg_loss"], r["grad_norm"], r["lr"]
    for r in read_lines(sorted(obs.glob("experts_rank*.jsonl"))):
        mine = t.experts.setdefault(r["step"], [[0] * len(layer) for layer in r["tokens"]])
        t.experts[r["step"]] = [[a + b for a, b in zip(x, y)] for x, y in zip(mine, r["tokens"])]
    return t


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


def check_inputs(tr: Trace, tt: Trace, tokens: list[list[str]], weights: dict[str, str]) -> dict[str, Any]:
    """Token batches: dump = titanrush = torchtitan at every (step, rank); weights: export = both."""
    bad_tokens = []
    for step, ranks in enumerate(tokens, start=1):
        for rank, want in enumerate(ranks):
            seen = (tr.tokens.get((step, rank), set()), tt.tokens.get((step, rank), set()))
            if seen != ({want}, {want}):
                bad_tokens.append(step)
    bad_weights = sorted(k for k in weights if not weights[k] == tr.weights.get(k) == tt.weights.get(k))
    extra = sorted((set(tr.weights) | set(tt.weights)) - set(weights))
    return {
        "token_batches": sum(len(r) for r in tokens),
        "token_steps_differing": sorted(set(bad_tokens)),
        "weights": len(weights),
        "weights_differing": bad_weights + extra,
        "identical": not bad_tokens and not bad_weights and not extra and bool(weights) and bool(tokens),
    }


def _window(values: dict[int, float], lo: int, hi: int) -> float | None:
    got = [values[s] for s in range(lo, hi + 1) if s in values]
    return fmean(got) if got else None


def _load(experts: dict[int, list[list[int]]], lo: int, hi: int) -> list[list[int]] | None:
    steps = [experts[s] for s in range(lo, hi + 1) if s in experts]
    if not steps:
        return None
    return [[sum(x) for x in zip(*layer)] for layer in zip(*steps)]


def _imbalance(load: list[list[int]]) -> tuple[float, float]:
    """(worst layer, mean over layers) of the largest expert's tokens over the mean."""
    per = [max(x) * len(x) / sum(x) for x in load if sum(x)]
    return max(per), fmean(per)


def _distance(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over layers of the total-variation distance between the two trainers' token shares."""
    d = [
        0.5 * sum(abs(p / sum(x) - q / sum(y)) for p, q in zip(x, y))
        for x, y in zip(a, b)
        if sum(x) and sum(y)
    ]
    return fmean(d)


def compare(tr: Trace, tt: Trace, steps: int, moe: bool) -> dict[str, Any]:
    """The figures of one row: per step over the first quarter, windows of a quarter, the goals."""
    q = max(steps // 4, 1)
    first, last = (1, q), (steps - q, steps)  # 200 steps: 1-50 and 150-200
    both = sorted(set(tr.loss) & set(tt.loss))
    rel = {s: _rel(tr.loss[s], tt.loss[s]) for s in both}
    g_rel = {
        s: _rel(tr.grad_norm[s], tt.grad_norm[s]) for s in both if s in tr.grad_norm and s in tt.grad_norm
    }
    early = [s for s in both if first[0] <= s <= first[1]]
    g_early = [g_rel[s] for s in early if s in g_rel]
    peak = max(max(tt.lr.values(), default=0), 1e-30)
    lr_diff = {s: abs(tr.lr[s] - tt.lr[s]) / peak for s in both if s in tr.lr and s in tt.lr}
    windows = [(lo, min(lo + q - 1, steps)) for lo in range(1, steps + 1, q)]
    if windows[-1] != last:
        windows.append(last)
    out: dict[str, Any] = {
        "steps_compared": len(both),
        "first": first,
        "last": last,
        "loss_first_max_rel": max((rel[s] for s in early), default=None),
        "loss_first_max_step": max(early, key=lambda s: rel[s]) if early else None,
        "grad_norm_first_median_rel": median(g_early) if g_early else None,
        "grad_norm_first_max_rel": max(g_early, default=None),
        "lr_max_diff_of_peak": max(lr_diff.values(), default=None),
        "lr_steps_equal": sum(d < 1e-6 for d in lr_diff.values()),
        "windows": [],
    }
    for lo, hi in windows:
        w = {"steps": [lo, hi]}
        for key in ("loss", "grad_norm", "lr"):
            a, b = _window(getattr(tr, key), lo, hi), _window(getattr(tt, key), lo, hi)
            w[key] = [a, b, _rel(a, b) if a is not None and b is not None else None]
        la, lb = _load(tr.experts, lo, hi), _load(tt.experts, lo, hi)
        if la and lb:
            w["experts"] = {
                "titanrush": _imbalance(la),
                "torchtitan": _imbalance(lb),
                "distance": _distance(la, lb),
            }
        out["windows"].append(w)
    last_w = next(w for w in out["windows"] if w["steps"] == list(last))
    first_w = out["windows"][0]
    out["loss_last_mean_rel"] = last_w["loss"][2]
    out["loss_first_mean_rel"] = first_w["loss"][2]
    first_fig = out["loss_first_mean_rel"] if moe else out["loss_first_max_rel"]
    out["goal_first"] = first_fig is not None and first_fig < FIRST_GOAL
    out["goal_last"] = out["loss_last_mean_rel"] is not None and out["loss_last_mean_rel"] < LAST_GOAL
    out["per_step"] = [
        [s, tr.loss[s], tt.loss[s], tr.grad_norm.get(s), tt.grad_norm.get(s), tr.lr.get(s), tt.lr.get(s)]
        for s in both
    ]
    return out


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.3f}%" if x >= 1e-4 or x == 0 else f"{100 * x:.1e}%"


_EXPERTS_HEAD = (
    " experts' load, largest / mean over experts, worst, mean layer: titanrush / torchtitan; share distance |"
)


def markdown(
    name: str, inputs: dict[str, Any], fig: dict[str, Any], moe: bool, extra: str = "", runs: str = ""
) -> str:
    """One row's section of parity.md (`runs`: a line on how each run ended)."""
    ok = "identical" if inputs["identical"] else "**NOT identical**"
    tok_bad, w_bad = inputs["token_steps_differing"], inputs["weights_differing"]
    lines = [
        f"### {name}",
        "",
        *([runs, ""] if runs else []),
        f"Inputs {ok}: {inputs['token_batches']} token batches (dump = titanrush = torchtitan), steps "
        f"differing: {tok_bad[:10] or 'none'}; {inputs['weights']} weight tensors (export = titanrush = "
        f"torchtitan), differing: {w_bad[:6] or 'none'}.",
        "",
        "| figure | goal | result |",
        "|---|---|---|",
    ]
    (a, b), (c, d) = fig["first"], fig["last"]
    if moe:
        lines.append(f"| mean loss, steps {a}-{b} | < 1% | {_pct(fig['loss_first_mean_rel'])} |")
    else:
        at, worst = fig["loss_first_max_step"], _pct(fig["loss_first_max_rel"])
        lines.append(f"| loss, steps {a}-{b}: largest difference | < 1% | {worst} (step {at}) |")
    lines += [
        f"| mean loss, steps {c}-{d} | < 0.5% | {_pct(fig['loss_last_mean_rel'])} |",
        f"| grad norm, steps {a}-{b}: median / largest difference | alike | "
        f"{_pct(fig['grad_norm_first_median_rel'])} / {_pct(fig['grad_norm_first_max_rel'])} |",
        f"| learning rate: largest difference (of the peak); steps equal | - | "
        f"{_pct(fig['lr_max_diff_of_peak'])}; {fig['lr_steps_equal']} of {fig['steps_compared']} |",
        f"| goals met | both | {'yes' if fig['goal_first'] and fig['goal_last'] else '**no**'} |",
        "",
        "| steps | loss titanrush / torchtitan (diff) | grad norm titanrush / torchtitan (diff) "
        "| lr titanrush / torchtitan |" + (_EXPERTS_HEAD if moe else ""),
        "|---|---|---|---|" + ("---|" if moe else ""),
    ]
    for w in fig["windows"]:
        (l1, l2, lr_), (g1, g2, gr), (r1, r2, _) = w["loss"], w["grad_norm"], w["lr"]
        cells = [
            f"{w['steps'][0]}-{w['steps'][1]}",
            f"{_f(l1, '.4f')} / {_f(l2, '.4f')} ({_pct(lr_)})",
            f"{_f(g1, '.3f')} / {_f(g2, '.3f')} ({_pct(gr)})",
            f"{_f(r1, '.3e')} / {_f(r2, '.3e')}",
        ]
        if moe:
            e = w.get("experts")
            cells.append(
                "-"
                if not e
                else f"{e['titanrush'][0]:.2f}, {e['titanrush'][1]:.2f} / {e['torchtitan'][0]:.2f}, "
                f"{e['torchtitan'][1]:.2f}; {e['distance']:.3f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\n" + extra if extra else "") + "\n"


def ablation(vs_own: dict[str, Any], vs_tt: dict[str, Any]) -> str:
    """The schedule ablation's lines: titanrush on torchtitan's learning-rate schedule beside titanrush on its
    own (the effect of the schedule alone) and beside torchtitan (what is left)."""
    (a, b), (c, d) = vs_own["first"], vs_own["last"]

    def figs(f: dict[str, Any]) -> str:
        return (
            f"loss steps {a}-{b} largest difference {_pct(f['loss_first_max_rel'])}, mean loss steps "
            f"{c}-{d} {_pct(f['loss_last_mean_rel'])}, learning rate largest difference "
            f"{_pct(f['lr_max_diff_of_peak'])}"
        )

    return (
        "titanrush on torchtitan's learning-rate schedule (`--ablate-schedule`): against titanrush on its "
        f"own, {figs(vs_own)}; against torchtitan, {figs(vs_tt)}."
    )


def write(out: Path, sections: list[str], header: str, records: list[dict[str, Any]]) -> str:
    """parity.md and parity.jsonl under `out`; the markdown text."""
    text = f"{header}\n\n" + "\n".join(sections)
    (out / "parity.md").write_text(text)
    with open(out / "parity.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return text
