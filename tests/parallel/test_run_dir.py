"""The run folder under several ranks: rank 0 checks and makes it (or refuses an existing one) and every
rank gets the outcome (`distributed.from_rank0`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import ROOT, child_env, free_port, train_args

pytestmark = pytest.mark.parallel


def _rank(rank: int, port: int, out: str) -> None:
    from pathlib import Path

    from titanrush.distributed import from_rank0

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        got = [from_rank0(f"a from {rank}"), from_rank0("" if rank == 0 else "b")]
        Path(out, f"rank{rank}.txt").write_text("|".join(got))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_rank0s_value(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=3)
    for rank in range(3):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "a from 0|"


def test_an_existing_run_folder_stops_every_rank_and_stays_as_it_was(tmp_path):
    run = tmp_path / "taken"
    run.mkdir()
    (run / "config.toml").write_text("# an earlier run's\n")
    args = train_args(tmp_path, "taken", 2, "--no-job.overwrite")
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
        *args,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-3000:]
    assert "exists and job.overwrite = false" in log, log[-3000:]
    assert (run / "config.toml").read_text() == "# an earlier run's\n"
    assert sorted(p.name for p in run.iterdir()) == ["config.toml"]


def _prepare(rank: int, port: int, folder: str, out: str) -> None:
    import datetime
    from pathlib import Path

    from titanrush.config import ConfigError
    from titanrush.run import run_dir

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        run_dir.check(Path(folder, "taken"), overwrite=False, rank=rank)
        outcome = "went on"
    except ConfigError as e:
        outcome = f"refused: {e}"
    except Exception as e:  # (a rank left waiting would time out here)
        outcome = f"{type(e).__name__}"
    Path(out, f"rank{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


def test_a_refused_run_folder_is_a_config_error_on_every_rank(tmp_path):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    mp.spawn(_prepare, args=(free_port(), str(tmp_path / "runs"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith("refused: run folder"), rank
