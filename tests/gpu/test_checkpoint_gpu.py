"""A run cut off after a checkpoint and resumed repeats the uninterrupted run's losses, on GPUs.

The CPU suite checks this bitwise in fp32 with deterministic settings (tests/unit/test_checkpoint.py);
here the same on 2 GPUs under FSDP2 (NCCL), in fp32 (TF32 off, SDPA): cuBLAS and SDPA kernels may
reassociate sums between runs, so the bound is the GPU parity suite's fp32 tolerance, 1e-4 relative.
Each async mode is run: the save path differs (pinned staging for async_pinned), the state must not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_launch import ROOT, free_port, launch, max_dev

from titanrush.checkpoint import integrity

pytestmark = pytest.mark.multigpu

STEPS = 6
FP32_RTOL = 1e-4
ARGS = [
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "4",
    "--training.precision",
    "fp32",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--no-metrics.tensorboard",
    "--model.attn_backend",
    "sdpa",
]
STOP_AT = str(Path(__file__).with_name("stop_at.py"))


def steps(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict[int, dict]:
    rows, _ = launch(tmp_path_factory.mktemp("full"), "full", 2, ARGS)
    return steps(rows)


@pytest.mark.parametrize("mode", ["disabled", "async", "async_pinned"])
def test_resume_repeats_the_uninterrupted_losses(tmp_path, full, mode):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.async_mode", mode]
    launch(tmp_path, "split", 2, [*ARGS, *ckpt], entry=(STOP_AT, "3"))  # cut off after step 3
    rows, log = launch(tmp_path, "split", 2, [*ARGS, *ckpt])  # resumes from step-3
    resumed = steps(rows)
    assert "resumed from" in log.lower() or any("ckpt_load_s" in r for r in rows), log[-2000:]
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoint").iterdir()) == ["step-3", "step-6"]
    later = range(4, STEPS + 1)
    got, want = [resumed[s] for s in later], [full[s] for s in later]
    assert max_dev(got, want, "loss") < FP32_RTOL
    assert max_dev(got, want, "grad_norm") < FP32_RTOL


def test_several_async_pinned_saves_in_one_run_then_resume(tmp_path, full):
    """torch 2.11's DCP stager cannot serve a second save (pytorch#183413): every save of one run must
    still land, and a run resumed from a middle one must repeat the uninterrupted losses."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async_pinned"]
    launch(tmp_path, "many", 2, [*ARGS, *ckpt])  # three saves in one process: steps 2, 4, 6
    folder = tmp_path / "many" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]
    shutil.rmtree(folder / "step-6")  # resume from step 4 and train steps 5-6 again
    rows, _ = launch(tmp_path, "many", 2, [*ARGS, *ckpt])
    resumed = steps(rows)
    assert max_dev([resumed[s] for s in (5, 6)], [full[s] for s in (5, 6)], "loss") < FP32_RTOL


def test_records_of_every_rank_verify_and_a_flipped_bit_stops_every_rank(tmp_path):
    """On 2 GPUs (NCCL): an async_pinned save's integrity record holds every rank's file, written on the
    save's background thread; a bit flipped in rank 1's file stops the relaunch on every rank with the
    same "corrupt" line (the ranks' findings are gathered over NCCL) before anything is read, no hang."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.async_mode", "async_pinned"]
    rows, _ = launch(tmp_path, "run", 2, [*ARGS, *ckpt], entry=(STOP_AT, "3"))
    assert [r["step"] for r in rows if "ckpt_integrity_s" in r] == [3]
    step = tmp_path / "run" / "checkpoint" / "step-3"
    record = integrity.read_record(step)
    shards = sorted(name for name in record["files"] if name.endswith(".distcp"))
    assert {f"__{r}_" for r in (0, 1)} == {name[:4] for name in shards}, shards  # both ranks' files
    assert integrity.verify(step, record) == []
    shard = step / shards[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    env = dict(
        os.environ, NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "-m",
        "titanrush.train",
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
        *ARGS,
        *ckpt,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("titanrush: config error:")]
    assert lines and all(f"step-3 is corrupt: {shard.name} bytes" in x for x in lines), res.stderr[-4000:]
