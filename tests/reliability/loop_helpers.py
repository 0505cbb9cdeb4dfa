"""Helpers of the training loop's reliability tests: runs in-process, under torchrun and as a child
process that the tests signal."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))

from faults import TINY  # noqa: E402
from harness import ROOT, child_env, failure, free_port, run_ok, spawn  # noqa: E402, F401


def small_args(dump: Path, name: str, *extra: str, tiny: bool = True) -> list[str]:
    """A run of a few CPU-seconds: seq 32, batch 2, a metrics row per step, no TensorBoard; of the
    one-layer model (faults.TINY), or with `tiny=False` of the debug model (4 layers), which learns
    visibly within a few steps."""
    return [
        *(TINY if tiny else []),
        "--job.dump_folder",
        str(dump),
        "--job.name",
        name,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.deterministic",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--no-metrics.tensorboard",
        "--training.gc_freq",
        "0",
        *extra,
    ]


def read_rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """metrics.jsonl's rows, parsed as strict JSON (a bare NaN or Infinity fails the test)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{run_dir / name} holds a bare {constant}: not JSON")

    return [json.loads(x, parse_constant=refuse) for x in (run_dir / name).read_text().splitlines()]


def launcher(nproc: int, entry: list[str]) -> list[str]:
    """The command that runs `entry` (after `python`) under `nproc` processes of torchrun (gloo, CPU)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        *entry,
    ]


class Child:
    """A training run in a child process (its own session), read line by line so a test can signal it
    at a known step. A thread reads the output as it comes, so that waiting for a line has a deadline
    even when the child falls silent."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.log: list[str] = []
        self.lines: queue.Queue[str | None] = queue.Queue()  # (None: the output has ended)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Read the output until a line contains `text`; fail after `timeout` s or at the output's end."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.lines.put(None)  # (for finish)
                break
            self.log.append(line)
            if text in line:
                return
        raise AssertionError(f"{text!r} never appeared:\n" + failure(self.cmd, "".join(self.log)))

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """(exit status, the whole output) once the process has ended (killed, with its group, after
        `timeout` s)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(timeout=30)  # (a worker left alive may hold the pipe: what came so far)
        while not self.lines.empty() and (line := self.lines.get()) is not None:
            self.log.append(line)
        return self.proc.returncode, "".join(self.log)


def children(pid: int) -> list[int]:
    """The pids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def finite_weights(checkpoint: Path) -> bool:
    """Whether every model weight stored in a titanrush checkpoint is finite (read through DCP, each tensor
    at the shape and dtype its metadata records)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {
        "model": {
            key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in stored.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
        }
    }
    assert state["model"], f"no model weights in {checkpoint}"
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return all(bool(torch.isfinite(v).all()) for v in state["model"].values())
