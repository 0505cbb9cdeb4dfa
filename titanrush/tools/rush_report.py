"""The rush's reports: results.jsonl, report.md, PNG charts, TensorBoard scalars, the progress lines
and the environment they record.

Each writer takes the finished rows (one dict per rung or run, as `rush_runner.execute` builds them) and
writes one artifact into the rush's output folder.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titanrush.tools.rush_runner import NEEDS_GPU, NOT_AVAILABLE, OK, ROOT, SKIPPED

Row = dict[str, Any]

# The per-rung series written to TensorBoard and the charts.
TB_METRICS = ("tps", "tflops", "mfu", "mem_active_gib", "mem_reserved_gib", "first_step_s", "speedup_first")


def write_jsonl(path: Path, rows: list[Row], env: dict[str, Any]) -> None:
    """One JSON object per row, each with the environment (rewritten whole, so a rerun starts clean)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps({**row, "env": env}) + "\n")


def cell(value: Any, spec: str) -> str:
    """A table cell: the value through `spec`, "-" where there is none."""
    return "-" if value is None else spec.format(value)


def times(value: float | None) -> str:
    """A ratio as "1.23x"."""
    return "-" if value is None else f"{value:.2f}x"


def status(row: Row) -> str:
    """The row's status, in bold unless it ran OK."""
    return row["status"] if row["status"] == OK else f"**{row['status']}**"


def estimated(row: Row) -> str:
    """The memory estimate's total GiB, marked where it does not fit."""
    est = row.get("estimate") or {}
    if est.get("total_gib") is None:
        return "-"
    return f"{est['total_gib']:.1f}" + ("" if est.get("fits") else " (no fit)")


def ladder_table(rows: list[Row]) -> str:
    """The single-GPU ladder as a markdown table."""
    head = (
        "| # | rung | adds | status | tokens/s | TFLOP/s | MFU | peak active GiB | peak reserved GiB "
        "| first step s | vs prev | vs first | estimate GiB |"
    )
    lines = [head, "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['index']} | {r['name']} | {r['adds']} | {status(r)} | {cell(r.get('tps'), '{:,.0f}')} "
            f"| {cell(r.get('tflops'), '{:.3g}')} | {cell(r.get('mfu'), '{:.1f}%')} "
            f"| {cell(r.get('mem_active_gib'), '{:.2f}')} | {cell(r.get('mem_reserved_gib'), '{:.2f}')} "
            f"| {cell(r.get('first_step_s'), '{:.1f}')} | {times(r.get('speedup_prev'))} "
            f"| {times(r.get('speedup_first'))} | {estimated(r)} |"
        )
    return "\n".join(lines)


def dist_table(rows: list[Row]) -> str:
    """The distributed ladder as a markdown table."""
    head = (
        "| strategy | GPUs | mesh | status | tokens/s (all) | tokens/s/GPU | efficiency | MFU "
        "| peak active GiB | peak reserved GiB | first step s | estimate GiB |"
    )
    lines = [head, "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['ngpu']} | {r.get('mesh', '-')} | {status(r)} "
            f"| {cell(r.get('tps_total'), '{:,.0f}')} | {cell(r.get('tps'), '{:,.0f}')} "
            f"| {cell(r.get('efficiency'), '{:.0%}')} | {cell(r.get('mfu'), '{:.1f}%')} "
            f"| {cell(r.get('mem_active_gib'), '{:.2f}')} | {cell(r.get('mem_reserved_gib'), '{:.2f}')} "
            f"| {cell(r.get('first_step_s'), '{:.1f}')} | {estimated(r)} |"
        )
    return "\n".join(lines)


def _reasons(rows: list[Row]) -> list[str]:
    return [f"- **{r['name']}** {r['status']}: {r['reason']}" for r in rows if r.get("reason")]


def ladder_summary(rows: list[Row]) -> list[str]:
    """One line per measured rung: what it bought over the rung it builds on and over the first."""
    out = []
    for r in rows:
        if r.get("speedup_prev") is not None:
            out.append(
                f"- {r['name']} ({r['adds']}): {times(r['speedup_prev'])} over {r['parent']}, "
                f"{times(r.get('speedup_first'))} over the first rung"
            )
    return out


def write_report(
    path: Path,
    *,
    title: str,
    env: dict[str, Any],
    settings: list[str],
    table: str,
    summary: list[str],
    rows: list[Row],
    charts: list[Path],
    notes: list[str],
    summary_title: str = "What each step bought",
) -> None:
    """report.md: the environment, the exact command, the table, speedups, notes, charts and commands.

    Args:
        path: The file to write.
        title: The heading.
        env: `environment()`.
        settings: Lines about the measurement (steps, warm-up, base config).
        table: The markdown table.
        summary: Speedup or scaling lines.
        summary_title: Their heading.
        rows: The rows (for the failure reasons and the commands).
        charts: PNG files written next to the report.
        notes: Anything not measured and why.
    """
    gpu = env["device"] if not env.get("gpus") else f"{env['gpus']} x {env['device']}"
    lines = [
        f"# {title}",
        "",
        f"- date: {env['date']}",
        f"- device: {gpu} (capability {env.get('capability')}, {env.get('gpu_mem_gib')} GiB), "
        f"driver {env['driver']}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}",
        f"- torch {env['torch']}, python {env['python']}, titanrush commit {env['commit']}, "
        f"host {env['host']}",
        f"- command: `{env['command']}`",
        f"- GPU memory of the estimates (estimate GiB): {env.get('gpu_mem', '?')}",
        *[f"- {s}" for s in settings],
        "",
        table,
        "",
    ]
    if summary:
        lines += [f"## {summary_title}", "", *summary, ""]
    reasons = _reasons(rows)
    if reasons or notes:
        lines += ["## Not measured, and why", "", *reasons, *[f"- {n}" for n in notes], ""]
    if charts:
        lines += ["## Charts", "", *[f"![{c.stem}]({c.name})" for c in charts], ""]
    lines += ["## Commands", ""]
    for r in rows:
        ran = r["status"] not in (NEEDS_GPU, NOT_AVAILABLE, SKIPPED)
        lines.append(f"- {r['name']}{'' if ran else ' (not run here)'}: `{r['command']}`")
    path.write_text("\n".join(lines) + "\n")


def write_all(
    out: Path, kind: str, rows: list[Row], env: dict[str, Any], *, steps: int, warmup: int, notes: list[str]
) -> None:
    """Everything a finished rush writes: results.jsonl, report.md, the PNG charts, TensorBoard (tb/).

    Args:
        out: The rush's output folder.
        kind: `ladder` or `dist`.
        rows: The rows, in run order.
        env: `environment()`.
        steps: Steps per run.
        warmup: Steps left out of the means.
        notes: What was not measured and why, beyond the rows' own reasons.
    """
    write_jsonl(out / "results.jsonl", rows, env)
    device = env.get("device") or "?"
    settings = [
        f"{steps} steps per run; tokens/s, TFLOP/s and MFU are means over steps > {warmup}; peak memory is "
        "the maximum over all steps (process peak RSS on CPU); first step = step 1's time (compilation "
        "included); MFU is against the peak of the run's own precision (fp32 rungs: the fp32 peak), so "
        "compare rungs by tokens/s or TFLOP/s"
    ]
    heading = "What each step bought"
    if kind == "ladder":
        table, summary, charts = ladder_table(rows), ladder_summary(rows), ladder_charts(out, rows, device)
        title = "titanrush rush: the single-GPU optimization ladder"
    else:
        heading = "Scaling efficiency (tokens/s per GPU over the 1-GPU baseline)"
        table, charts = dist_table(rows), dist_charts(out, rows, device)
        summary = [
            f"- {r['name']}: {r['efficiency']:.0%}" for r in rows if r["ngpu"] > 1 and r.get("efficiency")
        ]
        title = "titanrush rush: data-parallel strategies"
    write_report(
        out / "report.md",
        title=title,
        env=env,
        settings=settings,
        table=table,
        summary=summary,
        rows=rows,
        charts=charts,
        notes=notes,
        summary_title=heading,
    )
    log_tensorboard(out, rows, tag=kind, table=table)


# ----------------------------------------------------------------------------------------------
# Charts


def load_pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay the figure out, write it as a PNG at `path` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    load_pyplot().close(fig)
    return path


def _bars(
    path: Path, rows: list[Row], series: list[tuple[str, str]], ylabel: str, title: str, label: Callable
) -> Path:
    plt = load_pyplot()
    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5))
    width = 0.8 / len(series)
    for j, (key, legend) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))]
        vals = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar(xs, vals, width, label=legend)
        for bar, r in zip(bars, rows):
            text = label(r, key) if j == 0 or r["status"] == OK else ""
            if text:
                ax.annotate(
                    text,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90 if r["status"] != OK else 0,
                )
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    ax.margins(y=0.25)
    return save_figure(fig, path)


def ladder_charts(out: Path, rows: list[Row], device: str) -> list[Path]:
    """ladder_tps.png (tokens/s per rung, with the speedup over the first) and ladder_memory.png."""

    def tps_label(r: Row, key: str) -> str:
        if r["status"] != OK:
            return r["status"]
        return times(r.get("speedup_first"))

    def mem_label(r: Row, key: str) -> str:
        return r["status"] if r["status"] != OK else ""

    return [
        _bars(
            out / "ladder_tps.png",
            rows,
            [("tps", "tokens/s")],
            "tokens/s per GPU",
            f"Optimization ladder on {device}: throughput",
            tps_label,
        ),
        _bars(
            out / "ladder_memory.png",
            rows,
            [("mem_active_gib", "peak active"), ("mem_reserved_gib", "peak reserved")],
            "GiB",
            f"Optimization ladder on {device}: peak memory",
            mem_label,
        ),
    ]


def dist_charts(out: Path, rows: list[Row], device: str) -> list[Path]:
    """dist_scaling.png: tokens/s per GPU vs GPUs, and the scaling efficiency, per strategy (each curve
    starts at the shared 1-GPU baseline)."""
    plt = load_pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ok = [r for r in rows if r.get("scaling") and r["status"] == OK]
    base = [r for r in ok if r["ngpu"] == 1]
    gpus = sorted({r["ngpu"] for r in rows if r.get("scaling")})
    for s in dict.fromkeys(r["strategy"] for r in ok if r["ngpu"] > 1):
        pts = sorted(
            (r["ngpu"], r["tps"], r.get("efficiency") or 1.0)
            for r in base + ok
            if r["strategy"] == s or r in base
        )
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax2.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", label=s)
    for ax, ylabel in ((ax1, "tokens/s per GPU"), (ax2, "scaling efficiency % (of 1 GPU)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    ax2.axhline(100, color="grey", lw=0.8, ls="--")
    fig.suptitle(f"Data-parallel scaling on {device}")
    return [save_figure(fig, out / "dist_scaling.png")]


# ----------------------------------------------------------------------------------------------
# TensorBoard


def log_tensorboard(out: Path, rows: list[Row], *, tag: str, table: str) -> None:
    """`<out>/tb`: one scalar series per metric indexed by rung number, per-strategy series indexed by
    GPU count (dist), and the table as text."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tb"))
    try:
        for r in rows:
            if r["status"] != OK:
                continue
            for key in (*TB_METRICS, "efficiency", "tps_total"):
                value = r.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(f"{tag}/{key}", value, r["index"])
                    if r.get("scaling"):
                        writer.add_scalar(f"{tag}/{r['strategy']}/{key}", value, r["ngpu"])
        writer.add_text(f"{tag}/table", table, 0)
        legend = "\n".join(f"{r['index']}: {r['name']} ({r['status']})" for r in rows)
        writer.add_text(f"{tag}/rungs", legend, 0)
    finally:
        writer.close()


# ----------------------------------------------------------------------------------------------
# Environment


def git_commit(path: Path = ROOT, var: str = "TITANRUSH_COMMIT") -> str:
    """The checkout's HEAD, "+changes" where tracked files differ from it or git cannot tell (a result
    never names a commit it did not run; untracked files are not looked at); `var` from the environment
    where set (a checkout without .git); "unknown" without git."""
    if os.environ.get(var):
        return os.environ[var]
    git = ["git", "-C", str(path)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if not head.stdout.strip():
            return "unknown"
        changed = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed.returncode or changed.stdout.strip() else "")


def _driver() -> str:
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a (no nvidia-smi)"


def environment(device: dict[str, Any], command: str, gpu_mem_note: str) -> dict[str, Any]:
    """The environment every row and report records (`gpu_mem_note`: what the memory estimates are held
    against, `titanrush.tools.estimate.gpu_memory`'s sentence)."""
    return {
        "device": device.get("name"),
        "gpus": device.get("count", 0),
        "capability": ".".join(map(str, device["capability"])) if device.get("capability") else None,
        "gpu_mem_gib": round(device["mem_gib"], 1) if device.get("mem_gib") else None,
        "driver": _driver() if device.get("cuda") else "n/a (cpu)",
        "cuda": device.get("cuda_version"),
        "cudnn": device.get("cudnn"),
        "torch": device.get("torch"),
        "python": platform.python_version(),
        "host": platform.node(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "gpu_mem": gpu_mem_note,
    }


# ----------------------------------------------------------------------------------------------
# Progress


class Progress:
    """One line per rung as it starts and ends: `[3/9] name ...`, with an ETA from the runs so far."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.index = 0
        self.durations: list[float] = []

    def start(self, name: str, what: str) -> None:
        """A rung starts (or is recorded without running)."""
        self.index += 1
        print(f"[{self.index:>2}/{self.total}] {name:<16} {what}", flush=True)

    def end(self, name: str, row: dict[str, Any], started: bool = True) -> None:
        """A rung ended (or, started=False, will not run here): its status, figures, the time left."""
        self.index += 0 if started else 1
        parts = [f"[{self.index:>2}/{self.total}] {name:<16} {row['status']}"]
        if row.get("tps") is not None:
            parts.append(f"{row['tps']:,.0f} tok/s/GPU")
        if row.get("mem_active_gib") is not None:
            parts.append(f"peak {row['mem_active_gib']:.2f} GiB")
        if row.get("reason"):
            reason = row["reason"]
            short = reason if len(reason) <= 160 else reason[:160].rsplit(" ", 1)[0] + " ... (report.md)"
            parts.append(f"({short})")
        timing = self.timing(row)
        if len(timing) > 1:
            timing[-1] += f" (at most {self.total - self.index} more)"
        print("  ".join(parts + timing), flush=True)

    def timing(self, row: dict[str, Any]) -> list[str]:
        """The run's wall time and the ETA of the rest from the mean so far (empty if it did not run)."""
        if row.get("wall_s") is None:
            return []
        self.durations.append(row["wall_s"])
        parts = [f"{row['wall_s']:.0f}s"]
        left = self.total - self.index
        if left > 0:
            eta = left * sum(self.durations) / len(self.durations)
            parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        return parts

    def shrink(self, by: int) -> None:
        """Fewer rungs than planned will run (the batch ladder stopped early)."""
        self.total -= by
