"""Helpers of the parallel tests: run the real trainer as one process or as several ranks (gloo, CPU) and
read its metrics.jsonl.

Every run trains the debug model shrunk to a few CPU-seconds a step: seq_len 64, a global batch of 4
sequences whatever the mesh (local batch = 4 / dp), fp32, deterministic algorithms, a metrics row per
step. The data layer gives the same global batch for any dp degree, so a parallel run and the single
process see the same tokens and must agree up to floating-point reassociation.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
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


def spawn(entry: list[str], nproc: int, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python ENTRY` as `nproc` ranks of one gloo job on this host, with the environment torchrun gives
    its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) but without the
    launcher, whose own start-up (importing torch, the rendezvous) adds seconds to every test; as torchrun
    does, a rank that fails stops the others. Tests of the launch itself (run_train.sh, multi-node, signals,
    the console) use torchrun. Returns the exit status (the first failure's; -9 past `timeout`) and every
    rank's output."""
    cmd, port = [sys.executable, *entry], str(free_port())
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nproc)]
        procs: list[subprocess.Popen] = []
        try:
            for rank, log in enumerate(logs):
                ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc}
                env = {**child_env(), **{k: str(v) for k, v in ranks.items()}, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port}  # fmt: skip
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            while None in (codes := [p.poll() for p in procs]) and time.monotonic() < deadline:
                if any(codes):  # a rank failed: stop the others
                    break
                time.sleep(0.05)
            failed = [c for c in codes if c]
            status = failed[0] if failed else -9 if None in codes else 0
        finally:  # (also when the test is interrupted: no rank is left waiting for its peers)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        output = []
        for rank, log in enumerate(logs):
            log.seek(0)
            output.append(f"--- rank {rank}:\n{log.read()}")
    return subprocess.CompletedProcess(cmd, status, "".join(output), "")


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
    """Train in `nproc` processes (several: `spawn`); return rank 0's metrics rows, whatever steps ran."""
    run_ok(["-m", "titanrush.train", *train_args(dump, name, nproc if dp is None else dp, *overrides)], nproc)
    return read_metrics(dump / name)


def run_ok(entry: list[str], nproc: int) -> None:
    """`spawn` (one process: WORLD_SIZE 1, no process group), failing the test with the ranks' errors."""
    res = spawn(entry, nproc)
    assert res.returncode == 0, failure(res.args, res.stdout)


def run_train(dump: Path, name: str, nproc: int, *overrides: str, dp: int | None = None) -> list[dict]:
    """Train in `nproc` processes (several: `spawn`) and return the metrics rows of rank 0.

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
