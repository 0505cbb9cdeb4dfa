"""Helpers of the parallel tests: run the real trainer as one process or under torchrun (gloo, CPU) and
read its metrics.jsonl.

Every run trains the debug model shrunk to a few CPU-seconds a step: seq_len 64, a global batch of 4
sequences whatever the mesh (local batch = 4 / dp), fp32, deterministic algorithms, a metrics row per
step. The data layer gives the same global batch for any dp degree, so a parallel run and the single
process see the same tokens and must agree up to floating-point reassociation.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
GLOBAL_BATCH = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """CPU only, one thread per process (2 cores host up to 4 ranks), the checkout importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def train_args(dump: Path, name: str, dp: int, *overrides: str) -> list[str]:
    """The shrunk debug run, with `overrides` last (they win)."""
    return [
        "--job.dump_folder", str(dump), "--job.name", name,
        "--training.steps", str(STEPS), "--training.seq_len", "64",
        "--training.local_batch_size", str(GLOBAL_BATCH // dp),
        "--training.global_batch_size", str(GLOBAL_BATCH),
        "--training.deterministic", "--training.precision", "fp32", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--no-metrics.tensorboard", "--training.gc_freq", "0",
        *overrides,
    ]  # fmt: skip


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(dump: Path, name: str, nproc: int, *overrides: str, dp: int | None = None) -> list[dict]:
    """Train under `nproc` processes (1: no launcher); return rank 0's metrics rows, whatever steps ran."""
    args = train_args(dump, name, nproc if dp is None else dp, *overrides)
    if nproc == 1:
        cmd = [sys.executable, "-m", "titanrush.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "titanrush.train",
               *args]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, failure(cmd, res.stdout + res.stderr)
    return read_metrics(dump / name)


def run_train(dump: Path, name: str, nproc: int, *overrides: str, dp: int | None = None) -> list[dict]:
    """Train under `nproc` processes (1: no launcher) and return the metrics rows of rank 0.

    Args:
        dump: The dump folder; the run writes `dump/name/metrics.jsonl`.
        name: The job name.
        nproc: Processes on this host.
        overrides: Extra `--section.key value` arguments.
        dp: The data-parallel degree (sets the local batch so that the global batch stays fixed);
            defaults to nproc.
    """
    rows = launch(dump, name, nproc, *overrides, dp=dp)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return rows


def failure(cmd: list[str], log: str) -> str:
    """The command, the lines that name the error (whichever rank hit it first), and the log's tail."""
    keys = ("Error", "error:", "terminate", "what()", "Assertion", "Traceback", "Signal")
    hits = [line for line in log.splitlines() if any(k in line for k in keys)]
    return "\n".join([" ".join(cmd), "--- error lines:", *hits[:60], "--- tail:", log[-4000:]])


def max_rel_dev(rows: list[dict], ref: list[dict], key: str) -> float:
    """The largest relative deviation of `key` over the steps."""
    return max(abs(r[key] - q[key]) / abs(q[key]) for r, q in zip(rows, ref, strict=True))
