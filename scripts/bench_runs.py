"""Run named training configurations one after another and tabulate their steady-state figures.

Usage:
  python scripts/bench_runs.py --out DIR [--ngpu N] [--steps S] [--warmup W] \
      --run "name: --config train_configs/llama1b_single.toml --compile.enable" --run "..."

Each run goes through ./run_train.sh with NGPU=N and logs every step; the figures are the means over the
steps after the first W (warm-up and compilation excluded). Writes DIR/results.jsonl, DIR/results.md and
each run's log; prints the markdown table last. A failed run is recorded with its status and the
table goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    env["gpus"] = str(torch.cuda.device_count())
    if os.environ.get("TITANRUSH_COMMIT"):  # set by the caller where the checkout has no .git
        env["commit"] = os.environ["TITANRUSH_COMMIT"]
        return env
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        env["commit"] = "unknown"
    return env


def run_one(name: str, args: list[str], out: Path, ngpu: int, steps: int, warmup: int) -> dict:
    dump = out / "runs"
    cmd = [str(ROOT / "run_train.sh"), *args, "--training.steps", str(steps), "--metrics.log_freq", "1",
           "--job.dump_folder", str(dump), "--job.name", name]  # fmt: skip
    env = {**os.environ, "NGPU": str(ngpu), "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    row: dict = {"name": name, "command": f"NGPU={ngpu} ./run_train.sh " + shlex.join(args[:]), "ngpu": ngpu}
    row["wall_s"] = round(time.time() - t0, 1)
    metrics = dump / name / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "loss" in r]
    if proc.returncode != 0:
        text = (out / f"{name}.log").read_text()
        oom = "OutOfMemoryError" in text or "out of memory" in text
        row["status"] = "OOM" if oom else f"failed ({proc.returncode})"
    else:
        row["status"] = "ok"
    steady = [r for r in rows if r["step"] > warmup]
    if steady:
        for key in ("tps", "tflops", "mfu", "step_time", "data_wait_pct"):
            vals = [r[key] for r in steady if r.get(key) is not None]
            row[key] = sum(vals) / len(vals) if vals else None
        row["mem_active_gib"] = max(r["mem_active_gib"] or 0 for r in steady)
        row["mem_reserved_gib"] = max(r["mem_reserved_gib"] or 0 for r in steady)
        row["final_loss"] = rows[-1]["loss"]
        first = next((r for r in rows if r["step"] == 1), None)
        row["first_step_s"] = first["step_time"] if first else None
    return row


def table(rows: list[dict]) -> str:
    cols = [
        "run",
        "status",
        "tokens/s/GPU",
        "TFLOP/s",
        "MFU",
        "peak active GiB",
        "reserved GiB",
        "first step s",
        "loss",
    ]
    head = "| " + " | ".join(cols) + " |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:

        def f(key: str, fmt: str, r: dict = r) -> str:
            return fmt.format(r[key]) if r.get(key) is not None else "-"

        lines.append(
            f"| {r['name']} | {r['status']} | {f('tps', '{:,.0f}')} | {f('tflops', '{:.1f}')} | "
            f"{f('mfu', '{:.1f}%')} | {f('mem_active_gib', '{:.1f}')} | {f('mem_reserved_gib', '{:.1f}')} | "
            f"{f('first_step_s', '{:.1f}')} | {f('final_loss', '{:.3f}')} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--run", action="append", required=True, help='"name: overrides..."')
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = []
    for spec in a.run:
        name, _, rest = spec.partition(":")
        print(f"[bench] {name.strip()} ...", flush=True)
        row = run_one(name.strip(), shlex.split(rest), a.out, a.ngpu, a.steps, a.warmup)
        print(f"[bench] {name.strip()}: {row['status']} tps={row.get('tps')}", flush=True)
        rows.append(row)
        with open(a.out / "results.jsonl", "a") as fh:
            fh.write(json.dumps({**row, "env": env}) + "\n")
    md = table(rows)
    header = (
        f"{env['date']}, {env['gpus']} x {env['device']}, torch {env['torch']}, commit {env['commit']}, "
        f"steps {a.steps} (means over steps > {a.warmup})"
    )
    commands = "\n".join(f"- {r['name']}: `{r['command']}`" for r in rows)
    (a.out / "results.md").write_text(f"{header}\n\n{md}\n\nCommands:\n\n{commands}\n")
    print(header)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
