"""Training metrics: FLOPs per token, peak TFLOP/s by GPU, MFU, memory, and the three sinks
(console, metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from titanrush.config import ConfigError
from titanrush.errors import RunError
from titanrush.files import JsonLines, free_bytes, is_disk_full
from titanrush.logging_utils import format_line

logger = logging.getLogger("titanrush")

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' datasheets, by precision.
# Matched against torch.cuda.get_device_name() in order: the first pattern contained in the name wins,
# so the more specific names come first.
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.0, "fp32": 67.0, "fp8": 1979.0}),
    ("H200 NVL", {"bf16": 835.0, "fp32": 60.0, "fp8": 1671.0}),
    ("H200", {"bf16": 989.0, "fp32": 67.0, "fp8": 1979.0}),
    ("H100 NVL", {"bf16": 835.0, "fp32": 60.0, "fp8": 1671.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0, "fp8": 1513.0}),
    ("H100", {"bf16": 989.0, "fp32": 67.0, "fp8": 1979.0}),  # SXM ("H100 80GB HBM3")
    ("H800", {"bf16": 989.0, "fp32": 67.0, "fp8": 1979.0}),
    ("H20", {"bf16": 148.0, "fp32": 44.0, "fp8": 296.0}),
    ("GB200", {"bf16": 2500.0, "fp32": 80.0, "fp8": 5000.0}),
    ("B200", {"bf16": 2250.0, "fp32": 80.0, "fp8": 4500.0}),
    ("B100", {"bf16": 1750.0, "fp32": 60.0, "fp8": 3500.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp32": 91.6, "fp8": 733.0}),
    ("L4", {"bf16": 121.0, "fp32": 30.3, "fp8": 242.0}),
    ("A10G", {"bf16": 70.0, "fp32": 35.0}),
    ("RTX 4090", {"bf16": 165.2, "fp32": 82.6, "fp8": 330.3}),
    ("MI300X", {"bf16": 1307.4, "fp32": 163.4, "fp8": 2614.9}),
    ("MI325X", {"bf16": 1307.4, "fp32": 163.4, "fp8": 2614.9}),
    ("MI250X", {"bf16": 383.0, "fp32": 95.7}),
]


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Datasheet peak for this device and precision, or None when the device is not in the table."""
    for pattern, peaks in GPU_PEAKS:
        if pattern in device_name:
            return peaks.get(precision)
    return None


def resolve_peak(device: torch.device, *, configured: float, precision: str, float8: bool) -> float | None:
    """Peak TFLOP/s per device for MFU: `metrics.peak_tflops` when set, else the GPU's table entry; None
    (no MFU) on CPU and on GPUs not in the table. Says why in the log when there is none."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak, where = peak_tflops(name, "bf16" if float8 else precision), f"{name!r} is not in the peak table"
    else:
        peak, where = None, "CPU"
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if peak is None and rank0:  # (every rank's device is alike: rank 0 says it for the job)
        logger.warning(
            f"MFU: not reported ({where}; set metrics.peak_tflops to the device's dense "
            f"{precision} TFLOP/s): mfu is null in metrics.jsonl and TensorBoard has no mfu series"
        )
    elif peak is not None and float8:
        logger.info(f"float8: MFU is against the bf16 peak ({peak:.0f} TFLOP/s); TFLOP/s is exact")
    return peak


def log_header(
    flavor: str,
    plan: Any,
    mesh: str,
    n_params: int,
    flops_per_token: float,
    run_dir: Path,
    *,
    peak: float | None = None,
) -> None:
    """The run's first lines: the model, the mesh (`mesh`: its description), the batch and the run folder
    (`plan`: the run's RunPlan), and the peak that MFU is measured against."""
    a, batch = plan.args, plan.local_batch * plan.dp * plan.accum
    logger.info(
        f"titanrush: {flavor} ({n_params / 1e6:,.1f}M params, {a.n_layers} layers, dim {a.dim}) on "
        f"{plan.world_size} x {'cuda' if torch.cuda.is_available() else 'cpu'}; mesh {mesh}"
    )
    logger.info(
        f"batch: local {plan.local_batch} x seq {plan.seq_len}, accumulation {plan.accum}, global {batch}; "
        f"{flops_per_token / 1e9:.3f} GFLOP/token; run folder {run_dir}"
    )
    if peak is not None:
        logger.info(
            f"mfu: model TFLOP/s over a peak of {peak:,.0f} per device (TFLOP/s: metrics.jsonl's tflops)"
        )


def flops_per_token(model_args: Any, n_matmul_params: float, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + 12 x heads x head_dim x (keys each query sees,
    summed over layers).

    The first term is the forward (2) plus backward (4) FLOPs of every weight matrix a token goes
    through (the embedding lookup is no matmul and is excluded; the output projection is included, tied
    or not; of a mixture of experts, only the experts a token is routed to: `matmul_params`). The second
    is the attention scores and their weighted sum (PaLM appendix B), counted for the full square
    (T x T), as is customary, not halved for the causal mask; a layer with chunked attention (Llama 4)
    sees its chunk, not the whole sequence.
    """
    a = model_args
    chunk = getattr(a, "attn_chunk", 0)
    if chunk:
        spans = sum(min(seq_len, chunk) if a.uses_rope(i) else seq_len for i in range(a.n_layers))
    else:
        spans = a.n_layers * seq_len
    return 6 * n_matmul_params + 12 * a.n_heads * a.head_dim * spans


def matmul_params(model: nn.Module) -> float:
    """Parameters a token's matmuls use: all but the embedding table and the norms' weights (the output
    projection counts even when it shares the embedding's weight); routed experts count top_k of
    n_experts (each token goes through top_k of them: the active parameters)."""
    args = getattr(model, "args", None)
    active = getattr(args, "top_k", 1) / getattr(args, "n_experts", 1)
    total = 0.0
    for name, p in model.named_parameters(remove_duplicate=False):
        if "tok_embeddings" in name or p.dim() < 2:
            continue
        total += p.numel() * (active if ".moe.experts." in name else 1)
    return total


@dataclass
class DeviceMemory:
    """Peak memory since the last reset, in GiB, and as a share of the device's capacity."""

    mem_active_gib: float | None
    mem_reserved_gib: float | None
    mem_active_pct: float | None
    mem_reserved_pct: float | None


class MemoryMonitor:
    """Peak active / reserved memory per logging interval (process RSS on CPU); `apart` measures a block
    (a validation) on its own without losing the interval's peak so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._carried: DeviceMemory | None = None  # the interval's peak from before an `apart` block
        self.run_peak: DeviceMemory | None = None  # the largest of every reading: the run's peak
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def read_and_reset(self) -> DeviceMemory:
        """The peak since the last read (blocks measured `apart` left out)."""
        now, self._carried = _peak(self._read_and_reset(), self._carried), None
        return now

    @contextlib.contextmanager
    def apart(self) -> Iterator[list[DeviceMemory]]:
        """Measure the block's own peak (appended to the yielded list once it ends). On CPU, where the
        peak RSS cannot be reset, it is the process's peak so far."""
        self._carried = _peak(self._read_and_reset(), self._carried)
        out: list[DeviceMemory] = []
        yield out
        out.append(self._read_and_reset())

    def _read_and_reset(self) -> DeviceMemory:
        gib = 1024**3
        if self.device.type == "cuda":
            active = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            now = DeviceMemory(
                active / gib, reserved / gib, 100 * active / self.capacity, 100 * reserved / self.capacity
            )
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS, kB on Linux
            now = DeviceMemory(rss / gib, None, 100 * rss / self.capacity, None)
        self.run_peak = _peak(now, self.run_peak)
        return now


def _peak(a: DeviceMemory, b: DeviceMemory | None) -> DeviceMemory:
    """The larger of two peaks, field by field (None where neither is known)."""
    if b is None:
        return a
    pairs = zip(dataclasses.astuple(a), dataclasses.astuple(b))
    return DeviceMemory(*(y if x is None else x if y is None else max(x, y) for x, y in pairs))


def _write_fix(e: OSError, path: Path) -> str:
    """What to do about a metrics file that cannot be written: free space on a full disk, else access."""
    if is_disk_full(e, path.parent):
        free = free_bytes(path.parent) / 2**30
        return f"the disk of {path.parent} is full ({free:.2f} GiB free): free space"
    return f"make {path} a file this user can write"


class MetricsLogger:
    """One console line, one metrics.jsonl object and TensorBoard scalars per logged step.

    Every row carries the run's `attempt` (see `titanrush.run.run_dir`); TensorBoard writes under
    `tb/attempt-<n>/`, and `sinks` (Weights & Biases) take the same scalars at the same steps. Numbers
    that are not finite are written as null (JSON has no NaN) and skipped in TensorBoard and the sinks;
    the console shows them as they are. metrics.jsonl only ever holds whole rows
    (`titanrush.files.JsonLines`): a row that cannot be written (a full disk) stops the run with a
    `RunError`.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        rank: int,
        attempt: int = 1,
        sinks: Sequence[Any] = (),
    ) -> None:
        self.enabled = enabled
        self.rank = rank
        self.attempt = attempt
        self.jsonl: JsonLines | None = None
        self.tb = None
        self.sinks = list(sinks)  # more scalar sinks, given each row's `scalars` (titanrush.run.wandb_sink)
        if not enabled:
            return
        path = run_dir / ("metrics.jsonl" if rank == 0 else f"metrics_rank{rank}.jsonl")
        try:
            self.jsonl = JsonLines(path)
        except OSError as e:
            raise ConfigError(f"cannot open {path} ({e.strerror}); {_write_fix(e, path)}") from None
        if self.jsonl.cut:
            logger.warning(
                f"{path} ended in a cut-off row ({self.jsonl.cut} bytes, from a run that stopped while "
                "writing it): removed, so that every row is whole"
            )
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = run_dir / "tb" / f"attempt-{attempt}" / ("" if rank == 0 else f"rank{rank}")
            self.tb = SummaryWriter(str(folder))

    def log(self, step: int, values: dict[str, Any], *, prefix: str = "") -> None:
        """Write values for this step; None and non-finite values are null in JSON and skipped in
        TensorBoard."""
        if not self.enabled:
            return
        record = {"step": step, "attempt": self.attempt, **{f"{prefix}{k}": v for k, v in values.items()}}
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        logger.info(format_line(record))  # (before the file: a row that cannot be written is still seen)
        if self.jsonl is None:  # (a write failed: the run is stopping)
            return
        try:
            self.jsonl.write(json.dumps(clean, allow_nan=False))
        except OSError as e:
            self._stop_writing(e)
        if self.tb is not None or self.sinks:
            tags = scalars(clean)
            if self.tb is not None:
                for tag, v in tags.items():
                    self.tb.add_scalar(tag, v, step)
            for sink in self.sinks:
                sink.add_scalars(tags, step)

    def flush(self) -> None:
        """Push what is written to disk (before an exit the process may not survive)."""
        if self.jsonl is not None:
            try:
                self.jsonl.sync()
            except OSError as e:
                self._stop_writing(e)
        if self.tb is not None:
            self.tb.flush()

    def _stop_writing(self, e: OSError) -> NoReturn:
        """A row could not be written (`JsonLines` cut it back): no more rows, and the run stops."""
        path = self.jsonl.path
        self.jsonl.close()
        self.jsonl = None
        raise RunError(
            f"cannot write {path} ({e.strerror}): the run stopped, and every row in the file is whole (the "
            f"row the failure cut off was removed); {_write_fix(e, path)}, then run the same command again "
            "(with checkpoints, the run resumes from its newest)"
        ) from None

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A row's TensorBoard scalars by tag: every number but `step` and `attempt` (`val_x` as
    `validation/x`), and a list as one scalar per entry (`moe_tokens_l0/3`: the tokens of each expert);
    null, text and booleans are left out."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k not in ("step", "attempt") and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k.replace("val_", "validation/")] = v
        elif isinstance(v, list):
            out |= {f"{k}/{i}": x for i, x in enumerate(v)}
    return out


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Throughput:
    """Accumulates tokens and training time between logs; turns them into tps, TFLOP/s and MFU.

    Time spent `paused` (validation, checkpoint saves) is left out: step time and tokens/s count
    training only, and the paused work reports its own time.
    """

    def __init__(self, flops_per_token: float, peak: float | None) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.run_tokens, self.run_seconds = 0, 0.0  # the windows before this one
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        """Start a new window (the one ending is added to the run's totals)."""
        if self.steps:
            self.run_tokens += self.tokens
            self.run_seconds += self._elapsed()
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.steps = 0
        self.data_wait = 0.0
        self.excluded = 0.0

    @contextlib.contextmanager
    def paused(self, device: torch.device) -> Iterator[None]:
        """Leave the block's time out of the window. The device is synchronized first (only here, not
        per step), so that training work still queued at its start counts as training."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t0

    def add(self, tokens: int, data_wait: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.data_wait += data_wait

    def _elapsed(self) -> float:
        return max(time.perf_counter() - self.t0 - self.excluded, 1e-9)

    def read(self) -> dict[str, float | None]:
        """The window's figures (per device)."""
        elapsed = self._elapsed()
        tps = self.tokens / elapsed
        tflops = tps * self.flops_per_token / 1e12
        return {
            "tps": tps,
            "tflops": tflops,
            "mfu": 100 * tflops / self.peak if self.peak else None,
            "data_wait_pct": 100 * self.data_wait / elapsed,
            "step_time": elapsed / max(self.steps, 1),
        }

    def totals(self) -> tuple[int, float]:
        """(tokens, seconds) of training over the whole run so far, this window included (per device)."""
        if not self.steps:
            return self.run_tokens, self.run_seconds
        return self.run_tokens + self.tokens, self.run_seconds + self._elapsed()
