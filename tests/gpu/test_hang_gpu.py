"""A hang ends on NCCL (issue #48): with one of two GPU ranks stopped (`kill -STOP`), the other rank's step
watchdog ends the job with exit status 4, one line naming the rank that stalled and the NCCL collective the
waiting rank sat in, its Python stacks and the NCCL flight recorder's dump. The gloo version, on CPU, is the
last of the three faults in tests/reliability/test_restart.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titanrush.run.watchdog import HANG_STATUS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multigpu


def _env() -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        NCCL_NVLS_ENABLE="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def _rank_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), None)


def _children(pid: int) -> list[int]:
    """The launcher's workers: the processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def test_a_stopped_gpu_rank_ends_the_job_naming_the_nccl_collective(tmp_path):
    settings = {
        "job.dump_folder": str(tmp_path),
        "job.name": "hang",
        "data.dataset": "synthetic",
        "training.steps": "100000",
        "training.seq_len": "64",
        "training.local_batch_size": "2",
        "metrics.log_freq": "1",
        "training.step_timeout": "10",
    }
    args = [x for key, value in settings.items() for x in (f"--{key}", value)] + ["--no-metrics.tensorboard"]
    cmd = [sys.executable, "-m", "titanrush.run.launch", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, "-m", "titanrush.train", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    log: list[str] = []
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and not any("step 5  loss" in x for x in log[-1:]):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            log.append(line)
        assert log and "step 5  loss" in log[-1], "".join(log)[-4000:]
        workers = [p for p in _children(proc.pid) if _rank_of(p) is not None]
        rank1 = [p for p in workers if _rank_of(p) == "1"]
        assert len(rank1) == 1, workers
        os.kill(rank1[0], signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = proc.communicate(timeout=180)
        took = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):  # (never leave a stopped rank holding its GPU)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = "".join(log) + out
    assert proc.returncode == HANG_STATUS, text[-4000:]
    assert took < 90, took
    assert "is deprecated; use TORCH_FR_BUFFER_SIZE" not in text  # (the recorder's size, set by its name)
    lines = [x for x in text.splitlines() if x.startswith("titanrush:")]
    assert lines[-1].startswith("titanrush: the job ended with exit status 4 (a hang: "), lines
    assert "rank 1 stalled" in lines[-1] and ", in nccl:" in lines[-1], lines[-1]
    own = [x for x in lines if x.startswith("titanrush: rank 0: step ")]
    assert len(own) == 1 and " did not finish in 10 s (waiting in " in own[0], lines
    folder = tmp_path / "hang" / "hang"
    report = (folder / "rank0.txt").read_text()
    assert "Python stacks (every thread)" in report and '"profiling_name": "nccl:' in report, report[-3000:]
    assert (folder / "fr_trace_rank_0").stat().st_size > 0  # NCCL's own record, for torch's fr_trace
