"""The rush's child runs: launch one training run, read its metrics.jsonl, classify how it ended.

Every rung runs in its own process (`python -m titanrush.train`, or `./run_train.sh` under torchrun for
several GPUs) so that an out-of-memory error, a CUDA context or a compile cache cannot leak into the
next rung. The pure functions here (OOM detection, the last error line, the figures of a metrics file,
speedups) are what the unit tests exercise with fake child output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Statuses a row can have. Only OK rows carry figures.
OK, OOM, FAILED, TIMEOUT = "ok", "OOM", "failed", "timeout"
NEEDS_GPU, NOT_AVAILABLE, SKIPPED, PLANNED = "needs GPU", "not available", "skipped", "planned"

# Lower-cased fragments that only an allocation failure prints (CUDA, ROCm, cuBLAS, NCCL, the host).
_OOM_MARKERS = (
    "outofmemoryerror",  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError
    "cuda out of memory",
    "cuda error: out of memory",
    "hip out of memory",
    "cublas_status_alloc_failed",
    "cudaerrormemoryallocation",
    "failed to cuda calloc",
    "cudnn_status_alloc_failed",
    "memoryerror",  # Python's own, on the host
)
_ERROR_LINE = re.compile(
    r"^(?:\[(?:rank|default)\d+\]:\s*)*"  # torchrun's per-rank prefixes
    r"((?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)|(?:titanrush: config error: .*))$"
)
_CONFIG_ERROR = re.compile(r"titanrush: config error: (.*)")

# The figures averaged over the steady steps (after the warm-up).
_MEAN_KEYS = ("tps", "tflops", "mfu", "step_time", "data_wait_pct")

# Run in a child so that the rush's own process never creates a CUDA context (which would take GPU
# memory from the rungs) and reports what the children will see.
_PROBE = r"""
import importlib.util, json, os, torch
d = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
     "host_mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30}
if d["cuda"]:
    p = torch.cuda.get_device_properties(0)
    flash = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    d.update(name=p.name, count=torch.cuda.device_count(), capability=[p.major, p.minor],
             mem_gib=p.total_memory / 2**30, cuda_version=torch.version.cuda,
             cudnn=torch.backends.cudnn.version(), flash_sdp=bool(flash and p.major >= 8),
             cudnn_sdp=bool(torch.backends.cudnn.is_available() and p.major >= 8
                            and (torch.backends.cudnn.version() or 0) >= 90000))
else:
    d.update(name="cpu", count=0, capability=None, mem_gib=d["host_mem_gib"], flash_sdp=False,
             cudnn_sdp=False)
d["flash_attn"] = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface"))
d["torchao"] = importlib.util.find_spec("torchao") is not None
print(json.dumps(d))
"""


# ----------------------------------------------------------------------------------------------
# Pure functions: classification and figures


def detect_oom(output: str) -> bool:
    """Whether a child's output shows an out-of-memory failure.

    Args:
        output: The child's stdout and stderr together.

    Returns:
        True when any allocator's out-of-memory message appears.
    """
    low = output.lower()
    return any(marker in low for marker in _OOM_MARKERS)


def last_error_line(output: str, limit: int = 300) -> str:
    """The last line that names an error (`SomeError: ...`), without torchrun's rank prefixes.

    torchrun's closing `ChildFailedError` summary is skipped: it names no cause. Falls back to the last
    non-empty line.

    Args:
        output: The child's stdout and stderr together.
        limit: Truncate the line to this many characters.

    Returns:
        The line, or "" for an empty output.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m and "ChildFailedError" not in line:
            return m.group(1)[:limit]
    return lines[-1][:limit] if lines else ""


def classify(returncode: int | None, output: str, timed_out: bool = False) -> tuple[str, str]:
    """How a child ended: (status, reason).

    Args:
        returncode: The exit status (negative: killed by that signal); None when it never ran.
        output: The child's stdout and stderr together.
        timed_out: The rush killed it at its time limit.

    Returns:
        (`ok`, ""), (`OOM`, error line), (`not available`, config error: a feature this version lacks
        or a combination it refuses), (`timeout`, ...) or (`failed`, the last error line).
    """
    if timed_out:
        return TIMEOUT, "killed at the time limit (--timeout)"
    if returncode == 0:
        return OK, ""
    if detect_oom(output):
        return OOM, last_error_line(output)
    m = _CONFIG_ERROR.search(output)
    if m:
        return NOT_AVAILABLE, m.group(1).strip()[:300]
    if returncode is not None and returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return FAILED, "killed by SIGKILL (the host may have run out of memory)"
    return FAILED, last_error_line(output) or f"exit status {returncode}"


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The rung's figures from its metrics.jsonl rows.

    Throughput figures are means over the steps after `warmup` (compilation and allocator warm-up
    excluded); peak memory is the maximum over all steps (what decides whether a run fits); the
    first-step time is step 1's step_time (compilation, cuDNN autotuning and allocation).

    Args:
        records: metrics.jsonl rows (training rows carry `loss`; validation rows are ignored).
        warmup: Steps excluded from the means.

    Returns:
        tps, tflops, mfu, step_time, data_wait_pct, mem_active_gib, mem_reserved_gib, first_step_s,
        final_loss and steps_measured; a figure is None where no step reported it.
    """
    rows = [r for r in records if "loss" in r]
    steady = [r for r in rows if r["step"] > warmup]
    out: dict[str, Any] = {"steps_measured": len(steady)}
    for key in _MEAN_KEYS:
        vals = [r[key] for r in steady if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    for key in ("mem_active_gib", "mem_reserved_gib"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = max(vals) if vals else None
    first = next((r for r in rows if r["step"] == 1), None)
    out["first_step_s"] = first.get("step_time") if first else None
    out["final_loss"] = rows[-1]["loss"] if rows else None
    return out


def speedup(value: float | None, base: float | None) -> float | None:
    """value / base, or None when either is missing or the base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file ([] when it is missing); a torn last line is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


# ----------------------------------------------------------------------------------------------
# Child processes


def run_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> tuple[int | None, bool]:
    """Run one command in its own process group, its output to `log_path`.

    Args:
        cmd: The command.
        env: Its environment.
        log_path: Where its stdout and stderr go.
        timeout_s: Kill it (its whole process group: torchrun and its ranks) after this many seconds.

    Returns:
        (exit status, timed out).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return proc.returncode, True
        except BaseException:  # Ctrl-C: take the child's group down with us
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def run_training(
    cmd: list[str],
    *,
    env: dict[str, str],
    run_dir: Path,
    log_path: Path,
    warmup: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Run one training child and return its row: status, reason, figures, wall time, log path.

    Args:
        cmd: The training command (its `--job.dump_folder/--job.name` must point at `run_dir`).
        env: The child's environment.
        run_dir: The run folder; emptied first, since metrics.jsonl is appended to.
        log_path: Where the child's output goes.
        warmup: Steps excluded from the means.
        timeout_s: The child's time limit.
    """
    if run_dir.exists():
        for f in ("metrics.jsonl", "config.toml"):
            (run_dir / f).unlink(missing_ok=True)
    t0 = time.perf_counter()
    rc, timed_out = run_child(cmd, env, log_path, timeout_s)
    output = log_path.read_text(errors="replace")
    status, reason = classify(rc, output, timed_out)
    row: dict[str, Any] = {"status": status, "reason": reason, "returncode": rc}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["log"] = str(log_path)
    records = read_metrics(run_dir / "metrics.jsonl")
    if status == OK:
        row.update(summarize(records, warmup))
    elif records:  # how far it got (an OOM at step 5 still tells the first-step time)
        row["steps_done"] = max(r["step"] for r in records)
    return row


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: ours, unbuffered output, the checkout importable."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


# ----------------------------------------------------------------------------------------------
# The machine


def probe_device(timeout_s: float = 120) -> dict[str, Any]:
    """What the children will see: GPU name, count, capability, memory, attention kernels, packages."""
    try:
        res = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, env=child_env()
        )
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        return {"cuda": False, "name": "unknown", "count": 0, "capability": None, "mem_gib": None,
                "torch": "unknown", "flash_sdp": False, "cudnn_sdp": False, "flash_attn": False,
                "torchao": False, "probe_error": str(e)}  # fmt: skip


def _commit() -> str:
    if os.environ.get("TITANRUSH_COMMIT"):  # set by the caller where the checkout has no .git
        return os.environ["TITANRUSH_COMMIT"]
    try:
        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return res.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _driver() -> str:
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a (no nvidia-smi)"


def environment(device: dict[str, Any], command: str) -> dict[str, Any]:
    """The environment every row and report records."""
    import platform

    return {
        "device": device.get("name"),
        "gpus": device.get("count", 0),
        "capability": device.get("capability"),
        "gpu_mem_gib": round(device["mem_gib"], 1) if device.get("mem_gib") else None,
        "driver": _driver() if device.get("cuda") else "n/a (cpu)",
        "cuda": device.get("cuda_version"),
        "cudnn": device.get("cudnn"),
        "torch": device.get("torch"),
        "python": platform.python_version(),
        "host": platform.node(),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
    }


# ----------------------------------------------------------------------------------------------
# Progress


class Progress:
    """One line per rung as it starts and ends: `[3/9] name ...`, with an ETA from the runs so far."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.index = 0
        self.durations: list[float] = []

    def start(self, name: str, what: str) -> None:
        """A rung starts (or is recorded without running)."""
        self.index += 1
        print(f"[{self.index:>2}/{self.total}] {name:<16} {what}", flush=True)

    def end(self, name: str, row: dict[str, Any]) -> None:
        """A rung ended: its status, figures and the estimated time left."""
        parts = [f"[{self.index:>2}/{self.total}] {name:<16} {row['status']}"]
        if row.get("tps") is not None:
            parts.append(f"{row['tps']:,.0f} tok/s/GPU")
        if row.get("mem_active_gib") is not None:
            parts.append(f"peak {row['mem_active_gib']:.2f} GiB")
        if row.get("reason"):
            parts.append(f"({row['reason'][:120]})")
        if row.get("wall_s") is not None:
            self.durations.append(row["wall_s"])
            parts.append(f"{row['wall_s']:.0f}s")
            left = self.total - self.index
            if left > 0:
                eta = left * sum(self.durations) / len(self.durations)
                parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s (at most {left} more)")
        print("  ".join(parts), flush=True)

    def shrink(self, by: int) -> None:
        """Fewer rungs than planned will run (the batch ladder stopped early)."""
        self.total -= by
