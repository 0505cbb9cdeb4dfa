"""Profiling on a GPU: each traced window holds exactly its own steps' kernels; a real trace's collectives."""

from __future__ import annotations

import gzip
import json

import pytest
from gpu_launch import launch

from titanrush import config
from titanrush.run.plan import build_plan
from titanrush.tools.trace_analysis import collectives, read_trace, timeline
from titanrush.trainer import Trainer


def test_a_traced_window_holds_exactly_its_steps(tmp_path):
    # The trainer runs ahead of the GPU across steps; without the profiler's sync at step boundaries a
    # window records kernels launched before it began (no launch event of theirs in the trace) and misses
    # kernels it launched that run after it ended (a launch event without its kernel). The model must be
    # large enough for the GPU to be the bottleneck (the debug model's steps never let the CPU run ahead).
    args = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "prof",
        "--training.steps",
        "8",
        "--model.flavor",
        "1B",
        "--data.dataset",
        "synthetic",
        "--training.precision",
        "bf16",
        "--training.seq_len",
        "2048",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--profiling.enable",
        "--profiling.freq",
        "4",
        "--profiling.active_steps",
        "1",
    ]
    cfg = config.load(None, args)
    trainer = Trainer(cfg, build_plan(cfg, 1))
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


@pytest.mark.multigpu(2)
def test_collectives_of_a_real_tensor_parallel_trace(tmp_path):
    # A real NCCL trace (TP 2 on two GPUs: sequence parallel's all-gathers and reduce-scatters):
    # `collectives` finds both kinds in the profiled step, exposed and concurrent parts never exceed a
    # kernel's time, and the exposed parts add up to at least the timeline's exposed communication (the
    # same window; overlapping collectives count once there).
    args = [
        "--training.steps",
        "6",
        "--model.flavor",
        "debug",
        "--training.seq_len",
        "512",
        "--training.local_batch_size",
        "4",
        "--training.precision",
        "bf16",
        "--parallelism.tp",
        "2",
        "--metrics.log_freq",
        "1",
        "--profiling.enable",
        "--profiling.freq",
        "4",
        "--profiling.active_steps",
        "1",
    ]
    launch(tmp_path, "coll", 2, args)
    trace = read_trace(next((tmp_path / "coll" / "profile").glob("step-4/rank0.trace.json.gz")))
    found = collectives(trace)
    names = " ".join(found)
    assert "AllGather" in names and "ReduceScatter" in names, names
    for key, row in found.items():
        assert row["calls"] >= 1 and 0 <= row["exposed"] <= row["ms"] + 1e-9, (key, row)
        assert 0 <= row["concurrent"] <= row["ms"] + 1e-9, (key, row)
    exposed = timeline(trace)["exposed_comm"]
    assert (
        sum(r["exposed"] for r in found.values()) >= exposed - 1e-6
    )  # (overlapping collectives count twice)
