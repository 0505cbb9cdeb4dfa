"""Check the memory estimator against real training runs: predicted vs measured peak memory per GPU.

Usage (on the GPU machine):
  python scripts/validate_estimator.py --out DIR [--ngpu N] [--steps 4] [--gpu-mem GiB] \
      --run "1b-bs8: --config train_configs/llama1b_single.toml" \
      --run "8b-fsdp4 @4: --config train_configs/llama8b_fsdp.toml --training.steps 4"

Each `--run` is "NAME[ @NGPU]: ARGS" (ARGS are run_train.sh's). For each: `estimate()` in this process,
then `NGPU=N ./run_train.sh ARGS --training.steps S --metrics.log_freq 1`, whose metrics.jsonl gives the
measured peaks (the max over steps of mem_active_gib = torch.cuda.max_memory_allocated and
mem_reserved_gib = max_memory_reserved, both rank 0's). Compared: the predicted peak allocated with the
measured active peak, and the predicted peak allocated + allocator slack with the measured reserved peak
(neither measure includes the CUDA context); with pipeline parallel, the first stage's prediction. A run
that runs out of memory is reported as OOM, which checks a "does not fit". Writes DIR/validation.md,
DIR/validation.jsonl and each run's log; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_run(spec: str, ngpu: int) -> tuple[str, int, list[str]]:
    """'NAME[ @NGPU]: ARGS' -> (name, ngpu, args)."""
    head, sep, args = spec.partition(":")
    if not sep:
        raise SystemExit(f"--run {spec!r}: expected 'NAME[ @NGPU]: ARGS'")
    name, _, at = head.strip().partition("@")
    return name.strip(), int(at) if at.strip() else ngpu, shlex.split(args)


def predict(args: list[str], ngpu: int, gpu_mem: float | None) -> dict:
    """The estimator's numbers for these run_train.sh arguments."""
    from titanrush import config as cfgmod
    from titanrush.tools.estimate import estimate
    from titanrush.train import split_args

    path, _, overrides = split_args(args)
    est = estimate(cfgmod.load(path, overrides), ngpu, gpu_mem)
    # The trainer's metrics.jsonl is rank 0's: with pipeline parallel, compare the first stage's prediction
    # (the estimate's peak is the largest over the pipeline ranks).
    alloc, slack = est.rank_peaks_gib[0], est.rank_slack_gib[0]
    return {
        "pred_alloc": alloc,
        "pred_reserved": alloc + slack,
        "pred_total": alloc + slack + est.cuda_context_gib,
        "pred_peak_rank": est.peak_rank,
        "pred_peak_alloc": est.peak_allocated_gib,
        "trace_alloc": est.trace_peak_allocated_gib,
        "fits": est.fits,
        "phase": est.peak_phase,
        "warning": est.warning,
    }


def measure(name: str, args: list[str], ngpu: int, steps: int, out: Path, dump: Path) -> dict:
    """Run a few steps and read the peak memory the trainer logged."""
    cmd = [str(ROOT / "run_train.sh"), *args, "--training.steps", str(steps), "--metrics.log_freq", "1",
           "--job.dump_folder", str(dump), "--job.name", name, "--metrics.tensorboard", "false"]  # fmt: skip
    env = {**os.environ, "NGPU": str(ngpu), "PYTHONUNBUFFERED": "1"}
    log = out / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    metrics = dump / name / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if r.get("mem_active_gib") is not None]
    status = "ok" if proc.returncode == 0 else f"failed rc={proc.returncode}"
    if proc.returncode != 0 and "OutOfMemoryError" in log.read_text(errors="replace"):
        status = "OOM"
    return {
        "status": status,
        "meas_alloc": max((r["mem_active_gib"] for r in rows), default=None),
        "meas_reserved": max((r["mem_reserved_gib"] or 0 for r in rows), default=None),
    }


def _err(pred: float | None, meas: float | None) -> str:
    if pred is None or not meas:
        return "-"
    return f"{100 * (pred - meas) / meas:+.1f}%"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| run | GPUs | predicted alloc GiB | measured active GiB | error | predicted reserved GiB "
        "| measured reserved GiB | error | trace alloc GiB | fits | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['ngpu']} | {_f(r.get('pred_alloc'))} | {_f(r.get('meas_alloc'))} "
            f"| {_err(r.get('pred_alloc'), r.get('meas_alloc'))} | {_f(r.get('pred_reserved'))} "
            f"| {_f(r.get('meas_reserved'))} | {_err(r.get('pred_reserved'), r.get('meas_reserved'))} "
            f"| {_f(r.get('trace_alloc'))} | {r.get('fits')} | {r['status']} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--ngpu", type=int, default=1, help="GPUs of runs without @N")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dump", type=Path, default=None, help="run folders (default: OUT/runs)")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default: the device's)")
    p.add_argument("--run", action="append", required=True, help="'NAME[ @NGPU]: run_train.sh ARGS'")
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in ns.run:
        name, ngpu, args = parse_run(spec, ns.ngpu)
        row: dict = {"name": name, "ngpu": ngpu, "command": f"NGPU={ngpu} ./run_train.sh {shlex.join(args)}"}
        try:
            row.update(predict(args, ngpu, ns.gpu_mem))
        except Exception as e:  # a config the estimator refuses: still run it, say why
            row["estimate_error"] = f"{type(e).__name__}: {e}"
        row.update(measure(name, args, ngpu, ns.steps, ns.out, ns.dump or ns.out / "runs"))
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        with open(ns.out / "validation.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    text = table(rows)
    (ns.out / "validation.md").write_text(text + "\n\nCommands:\n\n" + "\n".join(
        f"- {r['name']}: `{r['command']}`" for r in rows) + "\n")  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
