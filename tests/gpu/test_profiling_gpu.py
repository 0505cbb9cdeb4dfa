"""Profiling on a GPU: each traced window holds exactly its own steps' kernels."""

from __future__ import annotations

import gzip
import json

from titanrush import config
from titanrush.trainer import Trainer


def test_a_traced_window_holds_exactly_its_steps(tmp_path):
    # The trainer runs ahead of the GPU across steps; without the profiler's sync at step boundaries a
    # window records kernels launched before it began (no launch event of theirs in the trace) and misses
    # kernels it launched that run after it ended (a launch event without its kernel). The model must be
    # large enough for the GPU to be the bottleneck (the debug model's steps never let the CPU run ahead).
    args = [
        "--job.dump_folder", str(tmp_path), "--job.name", "prof", "--training.steps", "8",
        "--model.flavor", "1B", "--data.dataset", "synthetic", "--training.precision", "bf16",
        "--training.seq_len", "2048", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--profiling.enable", "--profiling.freq", "4", "--profiling.active_steps", "1",
    ]  # fmt: skip
    trainer = Trainer(config.load(None, args))
    try:
        trainer.train()
    finally:
        trainer.close()
    traces = sorted((tmp_path / "prof" / "profile").glob("step-*/rank0.trace.json.gz"))
    assert [t.parent.name for t in traces] == ["step-4", "step-8"]
    for path in traces:
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        kernels = {e["args"]["correlation"] for e in events if e.get("cat") == "kernel"}
        launches = {
            e["args"]["correlation"]
            for e in events
            # runtime (cudaLaunchKernel) or driver (cuLaunchKernelEx: cuBLAS, Triton) launches
            if e.get("cat") in ("cuda_runtime", "cuda_driver")
            and "Launch" in e.get("name", "")
            and "args" in e
        }
        assert kernels, "no GPU kernels recorded"
        assert kernels <= launches, f"{len(kernels - launches)} kernels launched before the window"
        assert launches <= kernels, f"{len(launches - kernels)} launches whose kernels ran after it"
