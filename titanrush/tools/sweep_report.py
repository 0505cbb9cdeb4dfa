"""The sweep's reports: results.jsonl, results.md (sorted by tokens/s), sweep.png, TensorBoard hparams,
and the progress line of each shape.

Rows are `rush_runner.execute`'s, with the shape's dimensions added at the top level (see
`titanrush.tools.sweep.shape_row`); the environment and the markdown page are the rush's.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from titanrush.tools.rush_report import Progress as RushProgress
from titanrush.tools.rush_report import cell, estimated, save_figure, status, write_jsonl, write_report
from titanrush.tools.rush_runner import OK

Row = dict[str, Any]
# TensorBoard hparams metric -> row key.
HPARAM_METRICS = {
    "sweep/tps": "tps",
    "sweep/mfu": "mfu",
    "sweep/tflops": "tflops",
    "sweep/mem_gib": "mem_active_gib",
    "sweep/mem_reserved_gib": "mem_reserved_gib",
}


def rank(rows: list[Row]) -> list[Row]:
    """The OK rows by tokens/s per GPU, fastest first, then the others in run order."""
    ok = sorted((r for r in rows if r["status"] == OK and r.get("tps")), key=lambda r: -r["tps"])
    return ok + [r for r in rows if r not in ok]


def rank_planned(planned: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[int]:
    """A dry run's order of the shapes, before anything is measured (a guess, said so where printed): the
    ones the estimator says fit first (then those without an estimate, then those that do not fit); then
    the fewest GPUs in tensor, pipeline and context parallel (tp x pp x cp: their collectives and the
    pipeline's bubble sit on each step's critical path, where FSDP's overlap with compute); then the least
    estimated memory.

    Args:
        planned: (the shape: its degrees tp, pp, cp; its `estimate_fit`: total_gib and fits, or a note).

    Returns:
        The indices into `planned`, the likeliest fastest first.
    """

    def key(i: int) -> tuple[int, int, float]:
        shape, est = planned[i]
        fit = {True: 0, None: 1, False: 2}[est.get("fits")]
        return fit, shape["tp"] * shape["pp"] * shape["cp"], est.get("total_gib", float("inf"))

    return sorted(range(len(planned)), key=key)


def sweep_table(ranked: list[Row]) -> str:
    """The shapes as a markdown table, in the order given (rank() order: the fastest first)."""
    head = (
        "| rank | shape | status | tokens/s/GPU | tokens/s (all) | TFLOP/s | MFU | peak active GiB "
        "| peak reserved GiB | first step s | estimate GiB |"
    )
    lines = [head, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    place = 0
    for r in ranked:
        ok = r["status"] == OK and r.get("tps")
        place += 1 if ok else 0
        lines.append(
            f"| {place if ok else '-'} | `{r['shape']}` | {status(r)} | {cell(r.get('tps'), '{:,.0f}')} "
            f"| {cell(r.get('tps_total'), '{:,.0f}')} | {cell(r.get('tflops'), '{:.3g}')} "
            f"| {cell(r.get('mfu'), '{:.1f}%')} | {cell(r.get('mem_active_gib'), '{:.2f}')} "
            f"| {cell(r.get('mem_reserved_gib'), '{:.2f}')} | {cell(r.get('first_step_s'), '{:.1f}')} "
            f"| {estimated(r)} |"
        )
    return "\n".join(lines)


def sweep_chart(out: Path, ranked: list[Row], device: str) -> Path:
    """sweep.png: tokens/s per GPU and peak memory per shape (horizontal bars, the fastest on top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ranked[::-1]  # barh draws bottom-up
    ys = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 1.8 + 0.45 * len(rows)), sharey=True)
    bars = ax1.barh(ys, [r.get("tps") or 0.0 for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows):
        text = f" {r['tps']:,.0f}" if r["status"] == OK and r.get("tps") else f" {r['status']}"
        ax1.annotate(text, (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    for j, (key, legend) in enumerate(
        (("mem_active_gib", "peak active"), ("mem_reserved_gib", "peak reserved"))
    ):
        ax2.barh([y + (j - 0.5) * 0.4 for y in ys], [r.get(key) or 0.0 for r in rows], 0.4, label=legend)
    ax1.set_yticks(ys, [r["shape"] for r in rows], fontsize=8)
    ax1.set_xlabel("tokens/s per GPU")
    ax2.set_xlabel("GiB (CPU: process peak RSS)")
    ax2.legend(fontsize=8, loc="lower right")
    ax1.margins(x=0.25)
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Mesh shapes on {device}: throughput and peak memory")
    return save_figure(fig, out / "sweep.png")


def log_hparams(out: Path, rows: list[Row], dims: list[str], table: str) -> None:
    """`<out>/tb`: one hparams session per shape (its dimensions and status as hparams; tps, mfu, tflops
    and memory as metrics, where the run reported them) and the table as text."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tb"))
    try:
        for r in rows:
            hparams = {d: r[d] for d in dims if d in r} | {"status": r["status"]}
            metrics = {
                tag: float(r[key])
                for tag, key in HPARAM_METRICS.items()
                if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
            }
            writer.add_hparams(hparams, metrics, run_name=r["name"])
        writer.add_text("sweep/table", table, 0)
    finally:
        writer.close()


def write_all(
    out: Path,
    rows: list[Row],
    invalid: list[Row],
    env: dict[str, Any],
    *,
    dims: list[str],
    steps: int,
    warmup: int,
    notes: list[str],
    config: str = "FILE",
    flavor: str = "",
) -> None:
    """Everything a finished sweep writes: results.jsonl, results.md, sweep.png, tb/.

    Args:
        out: The sweep's output folder.
        rows: The rows of the shapes that were run (or skipped), in run order.
        invalid: The rows of the invalid shapes.
        env: `rush_report.environment()`.
        dims: The shape dimensions (hparams in TensorBoard).
        steps: Steps per run.
        warmup: Steps left out of the means.
        notes: What was not measured and why, beyond the rows' own reasons.
        config: The swept TOML config (the best shape's training command names it).
        flavor: Its model flavor (the rush's 8B run is offered for an 8B sweep only).
    """
    write_jsonl(out / "results.jsonl", rows + invalid, env)
    ranked = rank(rows)
    table = sweep_table(ranked)
    chart = sweep_chart(out, ranked, env.get("device") or "?")
    best = ranked[0] if ranked and ranked[0]["status"] == OK and ranked[0].get("tps") else None
    summary = []
    if best:
        train = ["./run_train.sh", "--config", config, *best.get("base_overrides", [])]
        train += [a for key, value in best["overrides"].items() for a in (f"--{key}", str(value))]
        summary = [
            f"- `{best['shape']}`: {best['tps']:,.0f} tokens/s per GPU",
            f"- trains this config with this mesh: `NGPU={best['ngpu']} {shlex.join(train)}`",
        ]
        if flavor == "8B":  # (the rush's distributed run trains the 8B, whatever the sweep swept)
            summary.append(
                f"- `titanrush rush dist --ngpu {best['ngpu']} --sweep-results {out / 'results.jsonl'}` "
                "runs the rush's 8B rung with this mesh"
            )
    settings = [
        f"{steps} steps per shape on {rows[0]['ngpu'] if rows else '?'} GPUs; tokens/s, TFLOP/s and MFU are "
        f"means over steps > {warmup}; tokens/s is per GPU (all = x GPUs); peak memory is rank 0's maximum "
        "over all steps (process peak RSS on CPU); sorted by tokens/s per GPU",
        f"shapes not run (invalid, or the same run as another; why below): {len(invalid)}",
    ]
    refused = [f"`{r['shape']}` invalid: {r['reason']}" for r in invalid]
    write_report(
        out / "results.md",
        title="titanrush sweep: mesh shapes ranked by tokens/s",
        env=env,
        settings=settings,
        table=table,
        summary=summary,
        rows=ranked,
        charts=[chart],
        notes=notes + refused,
        summary_title="Best shape",
    )
    log_hparams(out, rows, dims, table)


class Progress(RushProgress):
    """One line per shape: `[3/7] dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1 ... ok 8,344 tok/s/GPU`."""

    def start(self, name: str, what: str) -> None:
        """A shape starts: the line's head; its end is printed when the run ends."""
        self.index += 1
        print(f"[{self.index}/{self.total}] {what} ... ", end="", flush=True)

    def end(self, name: str, row: Row, started: bool = True) -> None:
        """A shape ended (started=False: it does not run): status, figures, wall time, ETA."""
        if not started:
            self.start(name, row.get("adds") or name)
        head = row["status"] + (f" {row['tps']:,.0f} tok/s/GPU" if row.get("tps") is not None else "")
        if row.get("reason"):
            head += f" ({row['reason'][:160]})"
        parts = [head]
        if row.get("mfu") is not None:
            parts.append(f"MFU {row['mfu']:.1f}%")
        if row.get("mem_active_gib") is not None:
            parts.append(f"peak {row['mem_active_gib']:.2f} GiB")
        print(", ".join(parts + self.timing(row)), flush=True)
