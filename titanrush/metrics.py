"""Training metrics: FLOPs per token, peak TFLOP/s by GPU, MFU, memory, and the three sinks
(console, metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

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

    active_gib: float | None
    reserved_gib: float | None
    active_pct: float | None
    reserved_pct: float | None


class MemoryMonitor:
    """Peak active / reserved memory per logging interval (process RSS on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.reset_peak_memory_stats(device)
        else:
            import os

            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def read_and_reset(self) -> DeviceMemory:
        gib = 1024**3
        if self.device.type == "cuda":
            active = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return DeviceMemory(
                active / gib, reserved / gib, 100 * active / self.capacity, 100 * reserved / self.capacity
            )
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS, kB on Linux
        return DeviceMemory(rss / gib, None, 100 * rss / self.capacity, None)


class MetricsLogger:
    """One console line, one metrics.jsonl object and TensorBoard scalars per logged step."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, rank: int) -> None:
        self.enabled = enabled
        self.rank = rank
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        name = "metrics.jsonl" if rank == 0 else f"metrics_rank{rank}.jsonl"
        self.jsonl = open(run_dir / name, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb" / ("" if rank == 0 else f"rank{rank}")))

    def log(self, step: int, values: dict[str, Any], *, prefix: str = "") -> None:
        """Write values for this step; None values stay null in JSON and are skipped in TensorBoard."""
        if not self.enabled:
            return
        record = {"step": step, **{f"{prefix}{k}": v for k, v in values.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k.replace("val_", "validation/"), v, step)
                elif isinstance(v, list):  # one scalar per entry (e.g. the tokens of each expert)
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i}", x, step)
        logger.info(format_line(record))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


_FORMATS = [
    ("loss", "loss {:.4f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("val_ppl", "val_ppl {:.2f}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("lr", "lr {:.2e}"),
    ("tps", "tps {:,.0f}"),
    ("tflops", "tflops {:.1f}"),
    ("mfu", "mfu {:.1f}%"),
    ("mem_active_gib", "mem {:.2f}GiB"),
    ("mem_active_pct", "({:.0f}%)"),
    ("mem_reserved_gib", "reserved {:.2f}GiB"),
    ("offload_gib", "offload {:.1f}GiB"),
    ("moe_imbalance", "experts max/mean {:.2f}"),
    ("data_wait_pct", "data {:.1f}%"),
    ("step_time", "step {:.3f}s"),
    ("ckpt_mode", "checkpoint ({})"),
    ("ckpt_blocking_s", "training blocked {:.2f}s"),
    ("ckpt_save_s", "saved in {:.2f}s"),
    ("ckpt_load_s", "checkpoint loaded in {:.2f}s"),
]


def format_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']:>6}"]
    parts += [fmt.format(record[k]) for k, fmt in _FORMATS if record.get(k) is not None]
    return "  ".join(parts)


class Throughput:
    """Accumulates tokens and time between logs; turns them into tps, TFLOP/s and MFU."""

    def __init__(self, flops_per_token: float, peak: float | None) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.steps = 0
        self.data_wait = 0.0

    def add(self, tokens: int, data_wait: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.data_wait += data_wait

    def read(self) -> dict[str, float | None]:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        tps = self.tokens / elapsed
        tflops = tps * self.flops_per_token / 1e12
        return {
            "tps": tps,
            "tflops": tflops,
            "mfu": 100 * tflops / self.peak if self.peak else None,
            "data_wait_pct": 100 * self.data_wait / elapsed,
            "step_time": elapsed / max(self.steps, 1),
        }
