"""`titanrush plot RUN_FOLDER [--out FILE]`: one PNG of a run from its metrics.jsonl, for a machine with no
TensorBoard at hand (a remote box: copy the PNG back, or open it where you are).

Panels, each where the run recorded it (the reason is printed for one left out):

- loss: training (`loss`, the mean over the steps since the previous logged row) and validation
  (`val_loss`);
- gradient norm and learning rate;
- tokens/s per GPU, MFU (none on CPU or on a GPU missing from the peak table: docs/mfu.md) and peak
  memory (active and reserved; on CPU the process's peak RSS);
- for a mixture of experts (docs/moe.md): the experts' load imbalance (max / mean tokens per expert of
  the worst layer, and the mean over layers, each summed over the logged window), and each layer's share
  of tokens per expert at the last logged step.

The rows read: training rows (those with `loss` and `lr`) and validation rows (`val_loss`). A resumed
attempt repeats the steps after its checkpoint: its rows replace the earlier attempts' from its first
step on, one series as of a run never interrupted (docs/operations.md, Attempts); a new run in a used
folder (an attempt from step 1) replaces them all. Where each later attempt starts is marked. Other
rows (checkpoint timings, restarts, stops, kinds added later) are read past, and so is a line that is
not whole JSON (a run that stopped while writing its last row).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrush.tools.rush_report import load_pyplot, save_figure
from titanrush.tools.rush_runner import read_metrics

METRICS_FILE = "metrics.jsonl"
Row = dict[str, Any]


class PlotError(Exception):
    """Input the plot cannot be made from: the one line printed, exit status 2."""


@dataclass(frozen=True)
class Panel:
    """One chart: lines of (row kind, key, legend); `hint` follows the reason it is left out."""

    name: str
    ylabel: str
    lines: tuple[tuple[str, str, str], ...]
    hint: str = ""


MOE_HINT = "a dense model: only mixture-of-experts runs record the experts' load"
PANELS = (
    Panel(
        "loss",
        "loss",
        (("train", "loss", "train (mean over the logged window)"), ("validation", "val_loss", "validation")),
    ),
    Panel("gradient norm", "global gradient norm", (("train", "grad_norm", "gradient norm"),)),
    Panel("learning rate", "learning rate", (("train", "lr", "learning rate"),)),
    Panel("tokens/s", "tokens/s per GPU", (("train", "tps", "tokens/s"),)),
    Panel(
        "MFU",
        "MFU %",
        (("train", "mfu", "MFU"),),
        "no peak TFLOP/s for the device: CPU, or a GPU missing from the peak table; set metrics.peak_tflops",
    ),
    Panel(
        "peak memory",
        "GiB",
        (
            ("train", "mem_active_gib", "peak active (CPU: process RSS)"),
            ("train", "mem_reserved_gib", "peak reserved"),
        ),
    ),
    Panel(
        "expert load",
        "max / mean tokens per expert",
        (
            ("train", "moe_imbalance_window", "worst layer"),
            ("train", "moe_imbalance_window_mean", "mean over layers"),
        ),
        MOE_HINT,
    ),
)
SHARES = "tokens per expert"  # the heatmap panel's name


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _kind(row: Row) -> str | None:
    if "loss" in row and "lr" in row:
        return "train"
    return "validation" if "val_loss" in row else None


def _attempt(row: Row) -> int:
    a = row.get("attempt", 1)
    return a if isinstance(a, int) and not isinstance(a, bool) else 1


def series_rows(rows: list[Row]) -> tuple[dict[str, list[Row]], dict[int, int]]:
    """The training and validation rows of the run's one series, by kind in step order, and the step at
    which each attempt after the first starts.

    An attempt starts at its first training step (a resume: the step after its checkpoint; a new run in
    a used folder: step 1) and its rows replace the earlier attempts' from that step on.
    """
    attempts: dict[int, list[tuple[str, Row]]] = {}
    for row in rows:
        if (kind := _kind(row)) is not None:
            attempts.setdefault(_attempt(row), []).append((kind, row))
    kept: dict[str, dict[int, Row]] = {"train": {}, "validation": {}}
    starts: dict[int, int] = {}
    for attempt in sorted(attempts):
        own = attempts[attempt]
        start = min((r["step"] for k, r in own if k == "train"), default=min(r["step"] for _, r in own))
        if kept["train"] or kept["validation"]:
            starts[attempt] = start
        for kind in kept:
            kept[kind] = {s: r for s, r in kept[kind].items() if s < start}
        for kind, row in own:
            kept[kind][row["step"]] = row
    return {kind: [by_step[s] for s in sorted(by_step)] for kind, by_step in kept.items()}, starts


def _absent(panel: Panel, rows: list[Row]) -> str:
    """Why a panel has no point (`rows`: every row of the kinds it reads)."""
    key = panel.lines[0][1]
    why = f"{key} is null in every row" if any(key in r for r in rows) else f"no {key} in metrics.jsonl"
    return f"{why} ({panel.hint})" if panel.hint else why


def shares_at_last_step(train: list[Row]) -> tuple[int, list[str], list[list[float]]] | None:
    """(step, layers, each layer's share of tokens per expert) of the last training row that records
    the experts' tokens (`moe_tokens_l<i>`, or `moe_share_l<i>`), None where none does."""
    for row in reversed(train):
        layers = {}
        for key, value in row.items():
            for prefix in ("moe_tokens_l", "moe_share_l"):
                if key.startswith(prefix) and isinstance(value, list) and all(_number(x) for x in value):
                    layers[key[len(prefix) :]] = value
        if layers:
            order = sorted(layers, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
            width = max(len(v) for v in layers.values())
            matrix = []
            for k in order:
                total = sum(layers[k]) or 1.0
                matrix.append([x / total for x in layers[k]] + [math.nan] * (width - len(layers[k])))
            return row["step"], order, matrix
    return None


def read_rows(folder: Path) -> tuple[Path, list[Row]]:
    """The metrics.jsonl of a run folder and its rows that are objects with an integer step."""
    if not folder.exists():
        raise PlotError(f"{folder} does not exist: give a run folder (<job.dump_folder>/<job.name>)")
    if not folder.is_dir():
        raise PlotError(f"{folder} is a file: give the run folder that holds metrics.jsonl")
    path = folder / METRICS_FILE
    if not path.exists():
        runs = sorted(p.parent.name for p in folder.glob(f"*/{METRICS_FILE}"))
        if runs:
            raise PlotError(
                f"{folder} has no {METRICS_FILE}: it holds run folders ({', '.join(runs[:8])}"
                f"{', ...' if len(runs) > 8 else ''}): titanrush plot {folder / runs[0]}"
            )
        raise PlotError(
            f"{folder} has no {METRICS_FILE}: not a run folder, or its run has not logged a step yet"
        )
    try:
        rows = read_metrics(path)
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or str(e)
        raise PlotError(f"cannot read {path} ({why})") from None
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]
    return path, rows


def plot_run(folder: Path, out: Path) -> list[str]:
    """Write the run's PNG at `out`; the lines that say what it holds and what it leaves out."""
    path, rows = read_rows(folder)
    by_kind, starts = series_rows(rows)
    train, val = by_kind["train"], by_kind["validation"]
    if not train and not val:
        held = f"{len(rows)} rows, none of a training step or a validation" if rows else "empty"
        raise PlotError(f"{path} holds no training step yet ({held}): nothing to plot")
    report = [f"{path}: {len(train)} training and {len(val)} validation rows"]
    drawn: list[tuple[Panel, list[tuple[str, list[int], list[float]]]]] = []
    for panel in PANELS:
        lines = []
        for kind, key, legend in panel.lines:
            points = [(r["step"], r[key]) for r in by_kind[kind] if _number(r.get(key))]
            if points:
                lines.append((legend, [s for s, _ in points], [v for _, v in points]))
        if lines:
            drawn.append((panel, lines))
            what = ", ".join(f"{legend.split(' (')[0]} {len(steps)} points" for legend, steps, _ in lines)
            report.append(f"  {panel.name}: {what}")
        else:
            kinds = {kind for kind, _, _ in panel.lines}
            report.append(
                f"  {panel.name}: omitted: {_absent(panel, [r for k in kinds for r in by_kind[k]])}"
            )
    shares = shares_at_last_step(train)
    if shares:
        report.append(
            f"  {SHARES}: {len(shares[1])} layers x {len(shares[2][0])} experts at step {shares[0]}"
        )
    else:
        report.append(f"  {SHARES}: omitted: no moe_tokens_l<i> in metrics.jsonl ({MOE_HINT})")
    _draw(out, folder, drawn, shares, starts)
    report.append(f"wrote {out} ({len(drawn) + bool(shares)} panels)")
    return report


def _draw(
    out: Path,
    folder: Path,
    drawn: list[tuple[Panel, list[tuple[str, list[int], list[float]]]]],
    shares: tuple[int, list[str], list[list[float]]] | None,
    starts: dict[int, int],
) -> None:
    plt = load_pyplot()
    from matplotlib.ticker import MaxNLocator

    n = len(drawn) + bool(shares)
    cols = 1 if n == 1 else 2
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 3.4 * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        fig.delaxes(ax)
    steps = [s for _, lines in drawn for _, xs, _ in lines for s in xs]
    for ax, (panel, lines) in zip(flat, drawn):
        for legend, xs, ys in lines:
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=legend)
        for attempt, step in starts.items():
            ax.axvline(step, color="grey", ls=":", lw=1, label=f"attempt {attempt} from step {step}")
        if panel.name == "expert load":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")  # (1.0: every expert gets the same load)
        ax.set_title(panel.name)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(panel.lines) > 1 or (starts and ax is flat[0]):
            ax.legend(fontsize=8)
    if shares:
        step, layers, matrix = shares
        ax = flat[len(drawn)]
        image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), layers)
        ax.set_title(f"{SHARES}, step {step} (even: {1 / len(matrix[0]):.3f})")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, label="share of the layer's tokens")
    span = f"steps {min(steps)}-{max(steps)}" if steps else ""
    tried = f", attempts 1-{max(starts)}" if starts else ""
    fig.suptitle(f"{folder.resolve().name}: {span}{tried}")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titanrush plot",
        description="One PNG of a run from its metrics.jsonl: loss, gradient norm, learning rate, tokens/s, "
        "MFU, memory and, for a mixture of experts, the experts' load. A panel the run did not record is "
        "left out, with the reason printed.",
    )
    parser.add_argument("run_folder", type=Path, help="the run folder (<job.dump_folder>/<job.name>)")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: RUN_FOLDER/plot.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Plot a run; return the exit status (2: no plot, with one line saying why)."""
    try:
        ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed it
        return int(e.code or 0)
    out = ns.out or ns.run_folder / "plot.png"
    try:
        lines = plot_run(ns.run_folder, out)
    except PlotError as e:
        print(f"titanrush plot: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # (the PNG, or its folder: a file in the way, no permission, a full disk)
        file_in_way = isinstance(e, FileExistsError) and e.filename
        why = f"{e.filename} is a file" if file_in_way else e.strerror or str(e)
        print(f"titanrush plot: error: cannot write {out} ({why})", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
