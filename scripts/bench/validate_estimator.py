"""The memory estimator against real runs: predicted vs measured peak memory per GPU (estimator_gpu.md).

On the GPU machine, from the repo root: python scripts/bench/validate_estimator.py --out DIR [--steps 4]
[--gpu-mem GiB] --run "1b-bs8: --config train_configs/llama1b_single.toml" --run "8b-fsdp4 @4: ...".
Each `--run` is "NAME[ @NGPU]: run_train.sh ARGS": `estimate()`, then a short run whose rank-0 metrics.jsonl
gives the peaks: the largest `mem_active_gib` against the predicted allocated peak, `mem_reserved_gib`
against that + allocator slack (PP: the first stage's). Writes DIR/validation.{md,jsonl} and the logs.
Llama 4: `--moe-imbalance` is the estimate's (the busiest EP rank's load); each row records the largest
`moe_imbalance` logged (max / mean per expert, a bound of a rank's): estimate again with min(that, ep).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titanrush import config as cfgmod  # noqa: E402
from titanrush.config import split_args  # noqa: E402
from titanrush.run.memory_moe import DEFAULT_IMBALANCE  # noqa: E402
from titanrush.tools.estimate import estimate  # noqa: E402
from titanrush.tools.rush_runner import NOT_AVAILABLE, OK, OOM, classify, read_metrics  # noqa: E402


def predict(args: list[str], ngpu: int, gpu_mem: float | None, moe_imbalance: float) -> dict:
    """The estimator's peak allocated and reserved GiB (pipeline rank 0's) for run_train.sh arguments."""
    path, _, overrides = split_args(args)
    est = estimate(cfgmod.load(path, overrides), ngpu, gpu_mem, moe_imbalance=moe_imbalance)
    alloc, slack = est.rank_peaks_gib[0], est.rank_slack_gib[0]
    return {"pred_alloc": alloc, "pred_reserved": alloc + slack, "fits": est.fits, "phase": est.peak_phase}


def measure(name: str, args: list[str], ngpu: int, steps: int, out: Path) -> dict:
    """Train `steps` steps; the largest active and reserved GiB rank 0 logged."""
    cmd = [
        str(ROOT / "run_train.sh"),
        *args,
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(out / "runs"),
        "--job.name",
        name,
    ]
    log = out / f"{name}.log"
    with open(log, "w") as f:
        env = {**os.environ, "NGPU": str(ngpu), "PYTHONUNBUFFERED": "1"}
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    rows = [r for r in read_metrics(out / "runs" / name / "metrics.jsonl") if r.get("mem_active_gib")]
    status, reason = classify(rc, log.read_text(errors="replace"))
    if status == NOT_AVAILABLE:  # (the rush's word for a refused combination; here any config error)
        status = "config error"
    if status != OK:
        print(f"{name}: {status} (exit status {rc}): {reason} (log: {log})", file=sys.stderr)
    return {
        "status": status if status in (OK, OOM) else f"{status} ({rc})",
        "reason": reason,
        "meas_alloc": max((r["mem_active_gib"] for r in rows), default=None),
        "meas_reserved": max((r["mem_reserved_gib"] or 0 for r in rows), default=None),
        "meas_moe_imbalance": max((r["moe_imbalance"] for r in rows if r.get("moe_imbalance")), default=None),
    }


def table(rows: list[dict]) -> str:
    """Predicted against measured, with the error predicted / measured - 1."""

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def err(pred: float | None, meas: float | None) -> str:
        return "-" if pred is None or not meas else f"{100 * (pred - meas) / meas:+.1f}%"

    lines = [
        "| run | GPUs | predicted allocated | measured active | error | predicted reserved | measured "
        "reserved | error | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        pa, ma, pr, mr = (r.get(k) for k in ("pred_alloc", "meas_alloc", "pred_reserved", "meas_reserved"))
        cells = [r["name"], str(r["ngpu"]), f(pa), f(ma), err(pa, ma), f(pr), f(mr), err(pr, mr), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default: the device's)")
    p.add_argument("--moe-imbalance", type=float, default=DEFAULT_IMBALANCE, help="as titanrush estimate's")
    p.add_argument("--run", action="append", required=True, help="'NAME[ @NGPU]: run_train.sh ARGS'")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in a.run:
        head, sep, rest = spec.partition(":")
        name, _, at = head.partition("@")
        if not sep:
            p.error(f"--run {spec!r}: expected 'NAME[ @NGPU]: ARGS'")
        args, ngpu = shlex.split(rest), int(at) if at.strip() else 1
        command = f"NGPU={ngpu} ./run_train.sh {shlex.join(args)}"
        row: dict = {"name": name.strip(), "ngpu": ngpu, "command": command}
        try:
            row.update(predict(args, ngpu, a.gpu_mem, a.moe_imbalance))
        except Exception as e:  # noqa: BLE001 - a config the estimator refuses still runs; say why
            row["estimate_error"] = f"{type(e).__name__}: {e}"
        row.update(measure(row["name"], args, ngpu, a.steps, a.out))
        rows.append(row)
        with open(a.out / "validation.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
    commands = "\n".join(f"- {r['name']}: `{r['command']}`" for r in rows)
    (a.out / "validation.md").write_text(f"{table(rows)}\n\nCommands:\n\n{commands}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
