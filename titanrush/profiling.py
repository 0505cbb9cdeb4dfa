"""torch.profiler traces and CUDA memory snapshots, written to the run folder.

Traces (`<run>/profile/step-<N>/rank<R>.trace.json.gz`) open in Perfetto (ui.perfetto.dev) or in
TensorBoard's profiler plugin; beside each, `rank<R>.summary.txt` says where the time went (device time
by kind: matmul, attention, communication, optimizer, compiled and other kernels; then the top ops).
Memory snapshots (`<run>/memory_snapshot/step-<N>-rank<R>.pickle`) open in pytorch.org/memory_viz.
Reading traces offline (timeline, kernels, collectives, two runs compared) is
`titanrush.tools.trace_analysis`'s job.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerAction

logger = logging.getLogger("titanrush")


class Profiler:
    """Call `step()` once per training step; traces `active` steps every `freq` steps."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enable: bool,
        freq: int,
        active: int,
        memory_snapshot: bool,
        rank: int,
        all_ranks: bool,
        start_step: int,
    ) -> None:
        self.enable = enable and (rank == 0 or all_ranks)
        self.rank = rank
        self.trace_dir = run_dir / "profile"
        self.snapshot_dir = run_dir / "memory_snapshot"
        self.memory_snapshot = self.enable and memory_snapshot
        self.step_num = start_step
        self.active = active
        self._prof: torch.profiler.profile | None = None
        self._snapshot_taken = False
        if not self.enable:
            return
        if self.memory_snapshot and not torch.cuda.is_available():
            logger.warning("profiling.memory_snapshot needs CUDA: no snapshot on this machine")
            self.memory_snapshot = False
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # wait, one warm-up step, then `active` recorded steps, every `freq` steps.
        schedule = torch.profiler.schedule(wait=freq - active - 1, warmup=1, active=active)
        self._prof = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._save_trace, record_shapes=True
        )
        self._prof.__enter__()

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        out = self.trace_dir / f"step-{self.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}.trace.json.gz"
        prof.export_chrome_trace(str(path))
        summary = time_summary(prof, self.active)
        (out / f"rank{self.rank}.summary.txt").write_text(summary)
        logger.info(f"profiler trace written to {path}\n{summary.split(chr(10) + chr(10))[0]}")
        if self.memory_snapshot and not self._snapshot_taken:
            self.snapshot_dir.mkdir(parents=True, exist_ok=True)
            snap = self.snapshot_dir / f"step-{self.step_num}-rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshot_taken = True
            logger.info(f"CUDA memory snapshot written to {snap}")

    def step(self) -> None:
        self.step_num += 1
        if self._prof is not None:
            # The trainer does not wait for the GPU between steps, so without a sync a recorded window
            # would take in the previous step's last kernels and miss its own (a trace of step N held
            # 1.4 steps of backward kernels on the 8B). Synced only where a window opens or closes: at
            # the end of the warm-up step and of each recorded one; the other steps run as unprofiled.
            if torch.cuda.is_available() and self._prof.current_action != ProfilerAction.NONE:
                torch.cuda.synchronize()
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


# Kinds of work, recognized by kernel or op name (first match wins).
_KINDS = [
    ("communication", ("nccl", "gloo", "all_gather", "allgather", "reduce_scatter", "all_reduce", "c10d")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    (
        "matmul",
        ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm"),
    ),
    ("optimizer", ("adam", "multi_tensor")),
    ("compiled", ("triton",)),
]


def kind_of(name: str) -> str:
    """The kind of work a kernel or op name stands for; `other` for the rest (mostly element-wise)."""
    low = name.lower()
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other")


def time_summary(prof: torch.profiler.profile, steps: int) -> str:
    """Self time per step by kind of work, then the 25 most expensive ops or kernels.

    On a GPU the figures are kernel time; kernels on different streams overlap (communication beside
    compute), so the kinds can add up to more than the step time. Without a GPU, CPU op self time.
    Ranges that only annotate the timeline (ProfilerStep#N, compiled-graph calls, `record_function`
    ranges shown on the GPU) are left out: they would count their kernels twice.
    """
    totals: dict[str, list[float]] = {}  # name -> [microseconds, calls]
    kernels = [e for e in prof.events() if _on_device(e) and not _annotation(e)]
    for e in kernels:
        acc = totals.setdefault(e.name, [0.0, 0])
        acc[0] += e.time_range.elapsed_us()
        acc[1] += 1
    if not kernels:  # no GPU: CPU op self time (aggregated by op)
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep"):
                totals[e.key] = [e.self_cpu_time_total, e.count]
    rows = sorted(((n, t, c) for n, (t, c) in totals.items()), key=lambda r: -r[1])
    total = sum(t for _, t, _ in rows) or 1.0
    kinds: dict[str, float] = {}
    for name, t, _ in rows:
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + t
    what = "device (kernel)" if kernels else "CPU op"
    lines = [f"{what} self time per step over {steps} recorded step(s): {total / steps / 1e3:.1f} ms"]
    lines += [
        f"  {k:<14} {t / steps / 1e3:9.1f} ms  {100 * t / total:5.1f}%"
        for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])
    ]
    lines += ["", f"top {what}s by self time (ms per step, calls per step):"]
    for name, t, n in rows[:25]:
        lines.append(f"  {t / steps / 1e3:9.2f}  {n / steps:7.1f}  {kind_of(name):<14} {name[:90]}")
    return "\n".join(lines) + "\n"


def _on_device(event: object) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and device_type != torch.autograd.DeviceType.CPU


def _annotation(event: object) -> bool:
    name = getattr(event, "name", "")
    return bool(getattr(event, "is_user_annotation", False)) or name.startswith(
        ("ProfilerStep", "## ", "Optimizer.", "titanrush.")
    )


@contextlib.contextmanager
def record(name: str) -> Iterator[None]:
    """A named range in the trace (e.g. around the optimizer step)."""
    with torch.profiler.record_function(name):
        yield
