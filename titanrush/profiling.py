"""torch.profiler traces and CUDA memory snapshots, written to the run folder.

Traces (`<run>/profile/step-<N>/rank<R>.trace.json.gz`) open in Perfetto (ui.perfetto.dev) or in
TensorBoard's profiler plugin; memory snapshots (`<run>/memory_snapshot/step-<N>-rank<R>.pickle`) open in
pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

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
        self._prof: torch.profiler.profile | None = None
        self._snapshot_taken = False
        if not self.enable:
            return
        if self.memory_snapshot and not torch.cuda.is_available():
            logger.warning("profiling.memory_snapshot needs CUDA: no snapshot on this machine")
            self.memory_snapshot = False
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
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
        logger.info(f"profiler trace written to {path}")
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
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


@contextlib.contextmanager
def record(name: str) -> Iterator[None]:
    """A named range in the trace (e.g. around the optimizer step)."""
    with torch.profiler.record_function(name):
        yield
