"""Multi-node launch on one host: two torchrun launchers (one per "node") join one job through the c10d
rendezvous and train FSDP over both; and scripts/slurm_train.sh under a fake srun/scontrol does the same.

Both must match the single-process run to the parity tolerance of test_parity.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, child_env, free_port, max_rel_dev, read_metrics, train_args

pytestmark = pytest.mark.parallel

RTOL = 1e-5


def wait_all(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout))
    return out


def assert_matches(rows: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for key in ("loss", "grad_norm"):
        assert max_rel_dev(rows, ref, key) <= RTOL, (key, [r[key] for r in rows], [r[key] for r in ref])


def test_two_torchrun_launchers_form_one_job(tmp_path, reference):
    port = free_port()
    args = train_args(tmp_path, "two_nodes", 2)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=titanrush-test",
                "--max_restarts=0",
                "-m",
                "titanrush.train",
                *args,
            ],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    results = wait_all(procs)
    for node, (rc, log) in enumerate(results):
        assert rc == 0, f"node {node}:\n{log[-6000:]}"
    assert "on 2 x cpu" in "".join(log for _, log in results)  # one job of world size 2
    assert_matches(read_metrics(tmp_path / "two_nodes"), reference())


FAKE_SRUN = """#!/usr/bin/env bash
# Fake srun: run the command once per node of the allocation, each with its SLURM_NODEID.
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
echo 127.0.0.1
echo 127.0.0.1
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_script_launches_one_job_over_the_allocation(tmp_path, reference):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    env = child_env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHON=sys.executable,
        NGPU="1",
        RDZV_PORT=str(free_port()),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_train.sh"), *train_args(tmp_path, "slurm", 2)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "rendezvous 127.0.0.1:" in res.stdout and "titanrush-4242" in res.stdout
    assert_matches(read_metrics(tmp_path / "slurm"), reference())
