"""One way for the GPU tests to run the real trainer: torchrun over the visible GPUs, metrics back.

The children see the same CUDA_VISIBLE_DEVICES as the test (so a suite run on GPUs 2-3 stays there),
with NVLink multicast off as the GPU machine needs (../shared/gpu/GPU.md).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    tmp: Path,
    name: str,
    ngpu: int,
    args: list[str],
    timeout: float = 600,
    entry: tuple[str, ...] = ("-m", "titanrush.train"),
) -> tuple[list[dict], str]:
    """Train `name` under `ngpu` processes (1: no launcher); return the metrics rows and the log.

    Args:
        tmp: The dump folder; the run writes `tmp/name/metrics.jsonl`.
        name: The job name.
        ngpu: Processes, one per GPU.
        args: Trainer arguments (`--section.key value`), the job's folder and name added here.
        timeout: Seconds before the run counts as failed.
        entry: What the processes run: the trainer's module, or a script and its own arguments.
    """
    res = torchrun(ngpu, [*entry, "--job.dump_folder", str(tmp), "--job.name", name, *args], timeout)
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    return rows, res.stdout + res.stderr


def torchrun(ngpu: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`python argv` under `ngpu` processes (1: no launcher), asserting a zero exit."""
    env = dict(
        os.environ, NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={ngpu}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
    ]
    cmd = [sys.executable, *(launcher if ngpu > 1 else []), *argv]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-2000:]}\n{res.stderr[-8000:]}"
    return res


def max_dev(rows: list[dict], ref: list[dict], key: str) -> float:
    """The largest relative deviation of `key` over the steps."""
    return max(abs(r[key] - q[key]) / abs(q[key]) for r, q in zip(rows, ref, strict=True))
